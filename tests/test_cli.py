"""The `slotserve` console script, run as a user would (a subprocess) on the real default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
SMALL_ENGINE = ["--slots", "2", "--max-len", "256"]


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """One CLI run covering --prompt, --prompt-ids and --prompts-file, with more prompts than slots."""
    prompts_file = tmp_path_factory.mktemp("cli") / "prompts.jsonl"
    prompts_file.write_text(
        json.dumps({"prompt": "The capital of France is", "max_tokens": 16}) + "\n"
        + json.dumps({"prompt_ids": [2, 818, 5279, 529, 7001, 563], "max_tokens": 16}) + "\n"
        + json.dumps({"prompt": "1, 2, 3, 4,", "max_tokens": 8, "temperature": 0.8, "seed": 5}) + "\n"
    )
    proc = run_cli("generate", "--model", "default", "--prompt", "The capital of France is",
                   "--prompt-ids", "2,818,5279", "--prompts-file", str(prompts_file),
                   "--max-tokens", "16", "--temperature", "0", "--json", *SMALL_ENGINE)
    assert proc.returncode == 0, proc.stderr
    # The server's composition root: its stages, its precision and KV dtype choices.
    assert "allocate the KV pool: 2 slots x 256 positions" in proc.stderr and "MiB per slot" in proc.stderr
    assert "compile the step programs" in proc.stderr and "precision w8a8" in proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def test_capital_of_france_names_paris_or_france(generated):
    first = generated[0]
    assert set(first) >= {"prompt_ids", "generated_ids", "text", "timings"}
    assert "Paris" in first["text"] or "France" in first["text"], first["text"]
    assert len(first["generated_ids"]) <= 16


def test_prompt_ids_are_fed_exactly_and_results_keep_input_order(generated):
    assert len(generated) == 5  # five prompts over two slots: three waited for a free slot
    assert generated[1]["prompt_ids"] == [2, 818, 5279]
    # The file's prompt_ids equal the text prompt's tokens with BOS: the same greedy continuation.
    assert generated[0]["prompt_ids"] == [2, 818, 5279, 529, 7001, 563] == generated[3]["prompt_ids"]
    assert generated[0]["generated_ids"] == generated[3]["generated_ids"]
    assert len(generated[4]["generated_ids"]) <= 8


def test_tokenize_prints_ids_without_special_tokens(real_model):
    proc = run_cli("tokenize", "--model", "default", "--text", "Hello world <end_of_turn>", "--json")
    assert proc.returncode == 0, proc.stderr
    ids = json.loads(proc.stdout)["ids"]
    assert ids == real_model.tokenizer.encode("Hello world <end_of_turn>")
    assert real_model.tokenizer.bos_id not in ids
    assert real_model.tokenizer.token_to_id("<end_of_turn>") not in ids


def test_bad_arguments_fail_cleanly():
    proc = run_cli("generate", "--model", "default", "--prompt-ids", "1,x")
    assert proc.returncode != 0 and "--prompt-ids" in proc.stderr
    proc = run_cli("generate", "--model", "/nonexistent/model")
    assert proc.returncode == 2 and "error" in proc.stderr


def test_address_and_store_defaults_are_stated_once():
    """The config file's schema, the cluster and the CLI's help take the server address from one place, and the
    config's store section its prefix and timeout from the Redis store."""
    from agents.store import redis_store
    from server import defaults
    from server.cli import build_parser
    from server.cluster import Cluster
    from server.config import ServerSection, StoreSection

    assert (ServerSection().host, ServerSection().port) == (defaults.HOST, defaults.PORT)
    assert (Cluster.host, Cluster.port) == (defaults.HOST, defaults.PORT)
    assert (StoreSection().prefix, StoreSection().timeout_s) == (redis_store.DEFAULT_PREFIX,
                                                                 redis_store.DEFAULT_TIMEOUT_S)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    serve_help = sub.choices["serve"].format_help()
    cluster_help = sub.choices["cluster"].format_help()
    assert defaults.HOST in serve_help and str(defaults.PORT) in serve_help
    assert f"default {defaults.PORT}" in cluster_help and f"default {defaults.CLUSTER_REPLICAS}" in cluster_help
