"""Offline batch generation on the slot engine: prompts share the slots, extra prompts wait for one.

This is the CLI's driver (no HTTP, no sessions); the scheduler package builds the online server's
loop with prefix caching and fairness on the same engine verbs.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from core.engine import Engine
from core.sampling import SamplingParams


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int = 32
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    generated_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class _Running:
    index: int
    request: GenerationRequest
    result: GenerationResult
    position: int  # position of the next token to feed
    started: float


def generate(engine: Engine, requests: list[GenerationRequest], stop_ids: frozenset[int]) -> list[GenerationResult]:
    """Run all requests to completion, at most engine.num_slots at a time; results in input order."""
    for req in requests:
        if not req.prompt_ids:
            raise ValueError("empty prompt")
        if len(req.prompt_ids) >= engine.max_len:
            raise ValueError(f"prompt of {len(req.prompt_ids)} tokens does not fit a {engine.max_len}-position slot")
        if req.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
    results: list[GenerationResult | None] = [None] * len(requests)
    waiting = deque(enumerate(requests))
    running: dict[int, _Running] = {}
    seeds = np.random.default_rng().integers(0, 2**31 - 1, size=len(requests))

    def finish(slot: int, reason: str) -> None:
        run = running.pop(slot)
        run.result.finish_reason = reason
        elapsed = time.perf_counter() - run.started
        n = len(run.result.generated_ids)
        run.result.timings["total_s"] = elapsed
        decode_s = elapsed - run.result.timings["ttft_s"]
        run.result.timings["decode_tokens_per_s"] = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
        results[run.index] = run.result

    def accept(slot: int, token: int) -> None:
        run = running[slot]
        run.result.generated_ids.append(token)
        if token in stop_ids and not run.request.ignore_eos:
            run.result.generated_ids.pop()
            finish(slot, "stop")
        elif len(run.result.generated_ids) >= run.request.max_tokens or run.position >= engine.max_len:
            finish(slot, "length")

    while waiting or running:
        for slot in range(engine.num_slots):
            if slot in running or not waiting:
                continue
            index, req = waiting.popleft()
            begin = time.perf_counter()
            seed = req.sampling.seed if req.sampling.seed is not None else int(seeds[index])
            engine.begin_request(slot, req.sampling, req.prompt_ids, seed)
            logits = engine.prefill(slot, req.prompt_ids, 0)
            token = int(engine.sample_slot(slot, logits, step=0).tokens[0])
            result = GenerationResult(prompt_ids=list(req.prompt_ids))
            result.timings["ttft_s"] = time.perf_counter() - begin
            result.timings["prefill_tokens_per_s"] = len(req.prompt_ids) / result.timings["ttft_s"]
            running[slot] = _Running(index, req, result, len(req.prompt_ids), begin)
            accept(slot, token)
        if not running:
            continue
        tokens = np.zeros(engine.num_slots, np.int32)
        positions = np.zeros(engine.num_slots, np.int32)
        active = np.zeros(engine.num_slots, bool)
        steps = np.zeros(engine.num_slots, np.int32)
        for slot, run in running.items():
            tokens[slot] = run.result.generated_ids[-1]
            positions[slot] = run.position
            active[slot] = True
            steps[slot] = len(run.result.generated_ids)
        logits = engine.decode(tokens, positions, active)
        sampled = engine.sample(logits, active, steps)
        for slot in list(running):
            running[slot].position += 1
            accept(slot, int(sampled.tokens[slot]))
    return [r for r in results if r is not None]
