"""LoRA adapters through HTTP (issue #31, docs/lora.md): vLLM's load/unload routes and the admin API create
agents that run under an adapter, `/v1/models` lists them, and every path a client sends is held to the
operator's adapter directories (traversal, symlinks, absolute paths, runtime loading off), with the admin key
when auth is on. The tiny random-weight runtime (W8A8, int8 KV) with two adapter slots; adapters are written
in PEFT's file layout."""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file
from test_server_helpers import LiveServer, build_tiny_runtime, server_config, wait_until

from core.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, TARGETS, adapted_projections
from server.app import create_app

ADMIN = {"Authorization": "Bearer admin-key"}
USER = [{"role": "user", "content": "Name three colors."}]


def write_adapter(directory, cfg, rank: int = 4, seed: int = 0, alpha: float = 16, shape_of=None) -> None:
    """A PEFT-layout LoRA adapter with random non-zero weights on every projection of ``cfg``."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for (layer, target), (i, o) in adapted_projections(shape_of or cfg).items():
        prefix = f"base_model.model.model.layers.{layer}.{TARGETS[target]}.{target}"
        tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, i)).astype(np.float32) * 0.3
        tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((o, rank)).astype(np.float32) * 0.3
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS))
    (directory / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                                                        "target_modules": sorted(TARGETS)}))


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory, runtime):
    root = tmp_path_factory.mktemp("lora")
    cfg = runtime.engine.cfg
    for name, seed in (("calm", 1), ("loud", 2)):
        write_adapter(root / "adapters" / name, cfg, seed=seed)
    write_adapter(root / "outside" / "evil", cfg, seed=3)
    (root / "adapters" / "link").symlink_to(root / "outside" / "evil")
    (root / "adapters" / "broken").mkdir()
    (root / "adapters" / "broken" / ADAPTER_CONFIG).write_text('{"peft_type": "LORA", "r": 4}')
    (root / "adapters" / "broken" / ADAPTER_WEIGHTS).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    return root


@pytest.fixture(scope="module")
def runtime():
    rt = build_tiny_runtime(adapter_slots=2, adapter_rank=8)
    rt.start()
    yield rt
    rt.stop()


@pytest.fixture(scope="module")
def server(runtime, adapters_dir):
    config = server_config(adapters__dirs=[str(adapters_dir / "adapters")], auth__enabled=True,
                           auth__admin_keys=["admin-key"])
    with LiveServer(create_app(config, runtime=runtime)) as srv:
        yield srv


def post(server, path: str, body, headers=ADMIN) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=120)


def chat(server, model: str) -> str:
    r = post(server, "/v1/chat/completions", {"model": model, "messages": USER, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_vllm_routes_load_list_serve_and_unload_an_adapter(server):
    base = chat(server, "assistant")
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "calm", "lora_path": "calm"})
    assert r.status_code == 200 and "calm" in r.text
    models = httpx.get(f"{server.url}/v1/models", headers=ADMIN).json()["data"]
    assert {"id": "calm", "adapter": "calm"}.items() <= next(m for m in models if m["id"] == "calm").items()
    adapted = chat(server, "calm")
    assert adapted != base  # the adapter changes the greedy output

    def dashboard_shows_it() -> bool:  # the slot that served it, and the snapshot's host-tier breakdown
        doc = httpx.get(f"{server.url}/admin/slots", headers=ADMIN, timeout=10).json()
        return any(slot.get("adapter") == "calm" and slot["agent"] == "calm" for slot in doc["slots"])

    wait_until(dashboard_shows_it, timeout=10)
    assert chat(server, "calm") == adapted and chat(server, "assistant") == base  # and each is reproducible
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "calm", "lora_path": "loud"}).status_code == 409
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "calm"})
    assert r.status_code == 200
    assert post(server, "/v1/chat/completions", {"model": "calm", "messages": USER}).status_code == 404
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "assistant"}).status_code == 400  # no adapter


@pytest.mark.parametrize(("path", "why"), [
    ("../outside/evil", "not inside"),  # traversal
    ("link", "not inside"),  # a symlink out of the directory
    ("{root}/outside/evil", "not inside"),  # an absolute path elsewhere
    ("/etc", "not inside"),
    ("missing", "no adapter_config.json"),
    ("broken", "lora"),  # a damaged weights file / no LoRA weights
])
def test_a_path_outside_the_adapter_directories_or_a_bad_adapter_is_refused(server, adapters_dir, path, why):
    path = path.format(root=adapters_dir)
    for route, body in (("/v1/load_lora_adapter", {"lora_name": "x1", "lora_path": path}),
                        ("/admin/agents", {"name": "x1", "adapter": path})):
        r = post(server, route, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_adapter" and why in error["message"].lower(), error
    assert httpx.get(f"{server.url}/v1/models/x1", headers=ADMIN).status_code == 404  # nothing was created


def test_an_adapter_for_another_model_is_refused_by_its_shapes(server, runtime, adapters_dir):
    from core.config import ModelConfig
    from tiny_models import GEMMA4

    other = ModelConfig.from_hf_dict({**GEMMA4, "vocab_size": 512, "vocab_size_per_layer_input": 512})
    write_adapter(adapters_dir / "adapters" / "gemma4", runtime.engine.cfg, shape_of=other)
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "g4", "lora_path": "gemma4"})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "this model needs" in message or "does not have" in message, message


def test_loading_needs_the_admin_key_when_auth_is_on(server):
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = post(server, route, {"lora_name": "calm", "lora_path": "calm"}, headers={})
        assert r.status_code == 401, r.text
        r = post(server, route, {"lora_name": "calm", "lora_path": "calm"}, headers={"Authorization": "Bearer no"})
        assert r.status_code in (401, 403), r.text


def test_the_admin_api_creates_and_changes_agents_with_adapters(server, adapters_dir):
    r = post(server, "/admin/agents", {"name": "loud-agent", "adapter": "loud", "defaults": {"temperature": 0}})
    assert r.status_code == 201, r.text
    loud = chat(server, "loud-agent")
    r = httpx.patch(f"{server.url}/admin/agents/loud-agent", json={"adapter": "../outside/evil"}, headers=ADMIN)
    assert r.status_code == 400  # refused, and the agent keeps its adapter
    assert chat(server, "loud-agent") == loud
    r = httpx.patch(f"{server.url}/admin/agents/loud-agent", json={"adapter": "calm"}, headers=ADMIN)
    assert r.status_code == 200 and chat(server, "loud-agent") != loud
    assert httpx.delete(f"{server.url}/admin/agents/loud-agent", headers=ADMIN).status_code == 200


def test_loading_and_unloading_while_another_agent_streams_leaves_its_output_unchanged(server):
    """A base-agent stream runs while adapters are loaded into the slots and unloaded: its tokens are those of
    the same request alone."""
    body = {"model": "assistant", "messages": USER, "max_tokens": 24, "temperature": 0, "stream": True}
    alone = chat_stream(server, body)
    got: list[str] = []
    worker = threading.Thread(target=lambda: got.append(chat_stream(server, body)))
    worker.start()
    for i, path in enumerate(("calm", "loud", "calm")):
        assert post(server, "/v1/load_lora_adapter", {"lora_name": f"tmp{i}", "lora_path": path}).status_code == 200
        chat(server, f"tmp{i}")
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": f"tmp{i}"}).status_code == 200
    worker.join(120)
    assert got == [alone]


def chat_stream(server, body) -> str:
    text = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=ADMIN, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text.append(delta.get("content") or "")
    return "".join(text)


def test_runtime_loading_is_off_without_adapter_directories(runtime):
    config = server_config(auth__enabled=True, auth__admin_keys=["admin-key"])
    with LiveServer(create_app(config, runtime=runtime)) as srv:
        r = post(srv, "/v1/load_lora_adapter", {"lora_name": "calm", "lora_path": "/tmp"})
        assert r.status_code == 400 and "run time is off" in r.json()["error"]["message"]


def test_an_agent_file_names_its_adapter_relative_to_itself_and_is_trusted(tmp_path, runtime, adapters_dir):
    """A YAML agent's adapter path is taken from the file's directory and loads wherever it lies (the file is
    trusted like the config); the same path from HTTP is refused."""
    from agents.adapters import AdapterLibrary
    from agents.errors import InvalidRequestError
    from agents.registry import load_agent_file

    (tmp_path / "evil.yaml").write_text(f"adapter: {adapters_dir / 'outside' / 'evil'}\n")
    (tmp_path / "near.yaml").write_text("adapter: ../lora0/outside/evil\n")
    near = load_agent_file(tmp_path / "near.yaml")
    assert near.adapter == str(tmp_path / "../lora0/outside/evil")
    library = AdapterLibrary(runtime.adapter_reader(), [adapters_dir / "adapters"])
    spec = load_agent_file(tmp_path / "evil.yaml")
    assert library.load(spec.adapter, trusted=True).rank == 4
    with pytest.raises(InvalidRequestError, match="not inside"):
        library.load(spec.adapter, trusted=False)


def test_serve_adds_each_adapter_dir_flag_to_the_configs_directories(tmp_path):
    from server.cli import build_parser
    from server.run import serve_config

    config_file = tmp_path / "c.yaml"
    config_file.write_text("adapters:\n  dirs: [/srv/adapters]\n")
    args = build_parser().parse_args(["serve", "--config", str(config_file), "--adapter-dir", "/a",
                                      "--adapter-dir", "/b"])
    config = serve_config(args)
    assert config.adapters.dirs == ["/srv/adapters", "/a", "/b"]
    assert config.runtime_options().adapter_slots == 8  # adapters can be named: slots by default
    assert serve_config(build_parser().parse_args(["serve"])).runtime_options().adapter_slots == 0


def test_the_adapter_dtype_reaches_the_engine_config():
    """`adapters.dtype`: "compute" (the default) leaves the slots in the compute dtype, "bfloat16" halves them;
    anything else is a config error."""
    import pydantic

    from agents.runtime import engine_config
    from server.config import load_config

    assert load_config().runtime_options().adapter_dtype is None
    options = load_config(overrides={"adapters.dtype": "bfloat16", "adapters.slots": 2}).runtime_options()
    assert options.adapter_dtype == "bfloat16"
    assert engine_config(options, "int8", False).adapter_dtype == "bfloat16"
    with pytest.raises((pydantic.ValidationError, ValueError)):
        load_config(overrides={"adapters.dtype": "int8"})
