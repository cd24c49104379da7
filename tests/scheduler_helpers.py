"""Helpers for scheduler tests on tiny random models with the real 262k vocabulary: schedulers without stop
ids, deterministic prompts, greedy requests, and the cold run (the request alone, caching off) that every
cache path must reproduce."""

from __future__ import annotations

import numpy as np

from core.sampling import SamplingParams
from scheduler.request import GenerationRequest
from scheduler.scheduler import Scheduler, SchedulerConfig

VOCAB = 262_144
GREEDY = SamplingParams(temperature=0)


def cache_path_engine(variant: str, slots: int):
    """The engine the prefix-cache tests share (test_prefix_reuse.py, test_disk_tier.py: the same programs,
    compiled once per run): "gemma3", "gemma4", or "gemma3-w8a8-int8kv" (the CPU serving default), warm."""
    from core.config import ModelConfig
    from core.engine import Engine, EngineConfig
    from core.weights import random_params, to_w8a8
    from tiny_models import CONFIGS

    family, _, quantized = variant.partition("-")
    cfg = ModelConfig.from_hf_dict({**CONFIGS[family], "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB})
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=11)
    kv_dtype = None
    if quantized:
        params, kv_dtype = to_w8a8(params), "int8"
    engine = Engine(cfg, params, EngineConfig(num_slots=slots, max_len=160, chunk_sizes=(4, 16), kv_dtype=kv_dtype),
                    "float32")
    engine.warmup()
    return engine


def make(engine, tokenizer, **config) -> Scheduler:
    # No stop ids: random weights would end streams at random; tests set lengths explicitly.
    return Scheduler(engine, tokenizer, SchedulerConfig(**config), stop_ids=frozenset())


def ids(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(x) for x in np.random.default_rng(seed).integers(1000, VOCAB - 1000, size=n))


def request(prompt, max_tokens=6, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(prompt), sampling=kw.pop("sampling", GREEDY), max_tokens=max_tokens, **kw)


def cold(engine, tokenizer, req: GenerationRequest) -> list[int]:
    return [token for token, _ in cold_logprobs(engine, tokenizer, req)]


def run_all(sched: Scheduler, reqs: list[GenerationRequest]):
    handles = [sched.submit(r) for r in reqs]
    sched.run_until_idle()
    return [h.result(timeout=0) for h in handles]


def token_logprobs(handle):
    """A finished request's (token id, logprob) pairs and its finish event, from its event stream."""
    from scheduler.request import TokenEvent

    events = list(handle.events(timeout=0))
    return [(e.token_id, e.logprob) for e in events if isinstance(e, TokenEvent)], events[-1]


def cold_logprobs(engine, tokenizer, req: GenerationRequest) -> list[tuple[int, float | None]]:
    """The cold run's (token id, logprob) pairs."""
    sched = make(engine, tokenizer, prefix_caching=False)
    handle = sched.submit(req)
    sched.run_until_idle()
    return token_logprobs(handle)[0]
