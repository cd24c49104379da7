"""The profiling benchmark's trace arithmetic, and a smoke run of it on a one-layer model."""

from __future__ import annotations

import json
from pathlib import Path

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
    out = tmp_path / "profile.json"
    assert main(["--config", "configs/models/gemma3-270m.json", "--layers", "1", "--slots", "2",
                 "--max-len", "1024", "--steps", "2", "--trace-steps", "2", "--attention-buckets", "",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bucket"] == 1024 and report["wall_ms_p50"] > 0
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
