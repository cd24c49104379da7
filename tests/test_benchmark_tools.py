"""The profiling benchmark's trace arithmetic, and a smoke run of it on a one-layer model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks.decode_profile import busy_time, main, summarise


def test_busy_time_counts_overlapping_intervals_once():
    assert busy_time([]) == 0
    assert busy_time([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert busy_time([(5, 6), (0, 10)]) == 10


def test_summary_keeps_to_gpu_streams_and_ranks_ops_by_time():
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "name": "python", "ts": 0, "dur": 1000},
        {"ph": "X", "pid": 2, "tid": 1, "name": "gemm", "ts": 0, "dur": 300},
        {"ph": "X", "pid": 2, "tid": 2, "name": "fusion", "ts": 100, "dur": 100},
        {"ph": "X", "pid": 2, "tid": 1, "name": "gemm", "ts": 500, "dur": 300},
    ]
    summary = summarise({"traceEvents": events}, steps=2, top=5)
    assert summary["processes"] == ["/device:GPU:0"]
    assert summary["ops_per_step"] == 1.5
    assert summary["op_time_per_step_ms"] == pytest.approx(0.35)
    assert summary["busy_per_step_ms"] == pytest.approx(0.3)  # the fusion overlaps the first gemm
    assert [op["name"] for op in summary["top_ops"]] == ["gemm", "fusion"]
    assert summary["top_ops"][0]["calls_per_step"] == 1.0


def test_profile_run_writes_its_report(tmp_path):
    """Run without --steps: the platform's default step count applies (16 on CPU), as in engine.py."""
    out = tmp_path / "profile.json"
    assert main(["--config", "configs/models/gemma3-270m.json", "--layers", "1", "--slots", "2",
                 "--max-len", "1024", "--trace-steps", "2", "--attention-buckets", "",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bucket"] == 1024 and report["wall_ms_p50"] > 0
    assert report["meta"]["steps"] == 16
    assert report["trace"]["ops_per_step"] > 0 and report["trace"]["top_ops"]


def test_llama_batched_bench_table_is_parsed():
    from benchmarks.llama_prefill import parse_table

    text = """main: n_kv_max = 4096
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |
|-------|--------|------|--------|----------|----------|
|    32 |      1 |    1 |     33 |    0.118 |   271.70 |
|   512 |      1 |    1 |    513 |    1.717 |   298.27 |
llama_perf_context_print: total time"""
    rows = parse_table(text)
    assert [(r["PP"], r["S_PP t/s"]) for r in rows] == [(32.0, 271.7), (512.0, 298.27)]


def test_unique_prefix_tokens_counts_distinct_prefixes():
    from benchmarks.agents_http import unique_prefix_tokens

    assert unique_prefix_tokens([]) == 0
    assert unique_prefix_tokens([[1, 2, 3], [1, 2, 4], [5]]) == 5
    assert unique_prefix_tokens([[1, 2], [1, 2], [1]]) == 2


def test_kv_layout_memory_table_matches_the_cache_the_engine_allocates():
    """The layout benchmark's bytes for the full layout are what core.kv_cache allocates per slot; the ring
    layout keeps window + 7 positions of each sliding layer."""
    from benchmarks.kv_layout import memory_table
    from core.config import ModelConfig
    from core.kv_cache import CacheSpec, cache_bytes_per_slot

    table = memory_table(8192)
    for name in ("gemma3-270m", "gemma4-e2b"):
        cfg = ModelConfig.from_hf_dict(json.loads(Path(f"configs/models/{name}.json").read_text()))
        for dtype in ("int8", "bfloat16"):
            row = table[name][dtype]
            assert row["full_bytes_per_slot"] == cache_bytes_per_slot(cfg, CacheSpec(1, 8192, dtype))
            sliding = row["full_bytes_per_position"] - row["ring_global_bytes_per_position"]
            assert row["ring_bytes_per_slot"] == 8192 * row["ring_global_bytes_per_position"] + 519 * sliding
    assert table["gemma3-270m"]["int8"]["ring_checkpoint_bytes"] == 15 * 519 * (2 * 256 + 8)


def test_a_live_server_on_a_unix_socket_serves_a_client_wave(tmp_path):
    """http_load.py --uds: machines that open no TCP socket (a TPU host) serve and load over a unix socket."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from benchmarks.common import LiveServer, split_address
    from benchmarks.http_load import run_wave

    app = FastAPI()

    @app.get("/ready")
    def ready() -> dict:
        return {"ok": True}

    @app.post("/v1/chat/completions")
    def chat() -> StreamingResponse:
        chunks = [{"choices": [{"delta": {"content": f"t{i}"}}]} for i in range(3)]
        chunks.append({"choices": [], "usage": {"completion_tokens": 3}})
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return StreamingResponse(iter([body]), media_type="text/event-stream")

    socket = tmp_path / "s.sock"
    server = LiveServer(app, uds=str(socket)).start(timeout=30)
    try:
        assert server.url == f"unix:{socket}" and server.port is None
        assert split_address(server.url) == ("http://localhost", str(socket))
        assert split_address("http://127.0.0.1:8000") == ("http://127.0.0.1:8000", None)
        wave = asyncio.run(run_wave(server.url, "m", 2, 3, timeout=30))
    finally:
        server.stop()
    assert [s["error"] for s in wave["sessions"]] == [None, None]
    assert [len(s["arrivals"]) for s in wave["sessions"]] == [3, 3]
    assert all(s["usage"] == {"completion_tokens": 3} for s in wave["sessions"])


def test_a_random_checkpoint_loads_as_a_model_with_the_real_tokenizer(tmp_path):
    """random_checkpoint.py: what an accelerator machine serves when the real weights cannot travel."""
    from benchmarks.common import default_gguf
    from benchmarks.random_checkpoint import main as write_checkpoint
    from core.runtime import load_model

    config = json.loads(Path("configs/models/gemma3-270m.json").read_text())
    config.update(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=8,
                  query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "ckpt"
    assert write_checkpoint(["--config", str(tmp_path / "config.json"), "--tokenizer", default_gguf(),
                             "--out", str(out)]) == 0
    model = load_model(str(out), dtype="float32", precision="float")
    assert model.cfg.num_layers == 2 and model.cfg.vocab_size == 262144
    assert model.tokenizer.decode(model.tokenizer.encode("a lighthouse keeper")) == "a lighthouse keeper"
    embed = np.asarray(model.params["embed"])
    assert embed.shape == (262144, 16) and 0.01 < float(embed.std()) < 0.03


def test_programs_timed_in_turn_report_each_ones_median():
    from benchmarks.common import medians_in_turn

    order = []
    slow = {"a": 0.0, "b": 0.02}

    def call(name: str) -> None:
        order.append(name)
        time.sleep(slow[name])

    medians = medians_in_turn(call, ["a", "b"], 3)
    assert order == ["a", "b"] * 3
    assert set(medians) == {"a", "b"} and 0 <= medians["a"] < 20 <= medians["b"]


def test_llama_baseline_renders_chats_as_slotserve_does():
    """The llama.cpp baseline's chat template (benchmarks/templates/transcript.jinja) gives the text of
    slotserve's default layout for the messages the benchmarks send, the leading BOS aside (llama.cpp adds
    it), so both servers are timed on the same prompts."""
    import jinja2

    from agents.chat_template import ChatTemplate
    from benchmarks.agents_http import SAMPLING
    from benchmarks.common import LLAMA_CHAT_TEMPLATE, default_gguf, llama_command
    from core.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(default_gguf())
    source = LLAMA_CHAT_TEMPLATE.read_text()
    chats = [
        [{"role": "user", "content": "Count to three."}],
        [{"role": "system", "content": "You review reports.\nBe brief. "},
         {"role": "user", "content": "Task 1 of session 0: check the data"},
         {"role": "assistant", "content": " Check the data.\n"},
         {"role": "user", "content": "Task 2: and now?"}],
        [{"role": "system", "content": "First."}, {"role": "system", "content": "Second."},
         {"role": "user", "content": "Go"}, {"role": "system", "content": "Answer in one word."}],
    ]
    for messages in chats:
        theirs = jinja2.Environment().from_string(source).render(messages=messages, add_generation_prompt=True)
        ours = tokenizer.decode(ChatTemplate(tokenizer).render("", messages).ids)
        assert ours == "<bos>" + theirs
    command = llama_command("llama-server", "model.gguf", 8080)
    assert command[command.index("--chat-template-file") + 1] == str(LLAMA_CHAT_TEMPLATE)
    assert "--jinja" in command
    assert "--chat-template-file" not in llama_command("llama-server", "model.gguf", 8080, chat_template=None)
    assert sorted(SAMPLING["stop"]) == sorted(ChatTemplate(tokenizer).render("", chats[0]).stop)
