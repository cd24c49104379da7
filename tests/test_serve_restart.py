"""`slotserve serve` started twice on the same caches: the second start reads the prepared weights back and
takes every program it compiles before /ready from the program store and the XLA compilation cache
(asserted on what /ready says was loaded, not on time); with a background warm-up it is ready before every
program is compiled and still answers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import httpx
import pytest
import yaml
from test_server_helpers import VOCAB, free_port, is_ready, ready_reply, wait_until

pytestmark = pytest.mark.slow  # builds a transformers checkpoint; two real server starts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_gguf) -> Path:
    """A tiny Gemma 3 checkpoint with the real tokenizer (so its vocabulary is the real one)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    import tiny_models
    from core.tokenizer import Tokenizer

    directory = tmp_path_factory.mktemp("tiny-serve")
    fields = {k: v for k, v in tiny_models.GEMMA3.items() if k != "model_type"}
    Gemma3ForCausalLM(Gemma3TextConfig(**{**fields, "vocab_size": VOCAB})).save_pretrained(directory)
    Tokenizer.from_pretrained(default_gguf).save(directory)
    return directory


def start(config: Path, cache: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "SLOTSERVE_CACHE_DIR": str(cache)}
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--config", str(config), "--port",
                             str(port)], stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env,
                            cwd=Path(__file__).resolve().parent.parent)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}; see {log}")
        return is_ready(url)

    wait_until(ready, timeout=300, interval=0.2)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def test_a_restart_loads_weights_and_programs_from_its_caches(checkpoint, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"name": str(checkpoint), "slots": 2, "max_len": 2048, "chunk_sizes": [16, 64],
                  "compile_cache": str(tmp_path / "xla")},
        "server": {"log_json": False},
    }))
    cache, log = tmp_path / "cache", tmp_path / "serve.log"
    readies, finals = [], []
    for _ in range(2):
        proc, url = start(config, cache, log)
        try:
            readies.append(ready_body(url))
            reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "assistant", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
            assert reply.status_code == 200, reply.text
            # Every program compiled before the stop, so the next start finds each one in the caches.
            wait_until(partial(all_compiled, url), timeout=300, interval=0.5)
            finals.append(ready_body(url)["programs"])
        finally:
            stop(proc)
    first, second = readies
    assert first["weights_from_cache"] is False and first["programs"]["from_compile_cache"] == 0
    assert first["programs"]["from_program_store"] == 0 and finals[0]["from_program_store"] == 0
    # Ready before the larger buckets were compiled (they come after the smallest bucket's programs).
    assert first["programs"]["compiled"] < first["programs"]["total"]
    assert second["weights_from_cache"] is True
    assert second["programs"]["compiled"] > 0
    # Neither traced nor compiled again: every exported module read back, every executable from the XLA cache.
    for counts in (second["programs"], finals[1]):
        assert counts["from_program_store"] == counts["compiled"]
        assert counts["from_compile_cache"] == counts["compiled"]
    assert finals[1]["compiled"] == finals[1]["total"]


def ready_body(url: str) -> dict:
    reply = ready_reply(url)
    assert reply is not None, f"{url}/ready gave no answer in time"
    return reply.json()


def all_compiled(url: str) -> bool:
    reply = ready_reply(url)
    if reply is None:
        return False
    programs = reply.json()["programs"]
    return programs["compiled"] == programs["total"]


SYSTEM_PROMPT = " ".join(f"Rule {i}: answer plainly and cite the rule you follow." for i in range(1, 31))


def chat(url: str, messages: list[dict], **extra) -> dict:
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "assistant", "messages": messages, "max_tokens": 8, "temperature": 0, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_session_continues_warm_after_sigterm(checkpoint, tmp_path):
    """Turn 1, SIGTERM (the server writes what its slots hold), turn 2 on a new process: warm from disk, it
    restores at least turn 1's whole prompt and answers exactly what the same request answers cold (another
    cache salt: nothing cached). After kill -9 instead, what earlier turns wrote serves the same way:
    tests/test_cluster.py (a session moved to another replica)."""
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"name": str(checkpoint), "slots": 2, "max_len": 2048, "chunk_sizes": [16, 64],
                  "compile_cache": str(tmp_path / "xla")},
        "scheduler": {"disk_tier_dir": str(tmp_path / "kv")},
        "server": {"log_json": False},
    }))
    cache, log = tmp_path / "cache", tmp_path / "serve.log"
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hi"}]
    proc, url = start(config, cache, log)
    try:
        first = chat(url, messages)
    finally:
        stop(proc)
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And then?"}]
    proc, url = start(config, cache, log)
    try:
        warm = chat(url, messages)
        cold = chat(url, messages, cache_salt="cold")
        shown = httpx.get(f"{url}/admin/slots", timeout=5).json()["disk_tier"]
    finally:
        stop(proc)
    assert first["usage"]["prompt_tokens"] > 3 * 64
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert shown["hits"] == 1 and shown["entries"] > 0 and shown["damaged"] == 0
    files = list((tmp_path / "kv").iterdir())
    assert files and all(f.stat().st_mode & 0o077 == 0 for f in files)
