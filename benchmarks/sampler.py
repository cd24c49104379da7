"""The batched sampler step alone (8 rows x the 262k vocabulary, state donated as the engine runs it), per variant.

    python3 benchmarks/sampler.py [--rows 8 --vocab 262144 --history 2048 --rounds 5 --iters 10]

Variants: the cheap program (greedy, temperature, a grammar mask, logprobs; greedy and temperature also with
rows that report no logprobs, as the server installs requests that do not ask), the full program (penalties,
truncation) and the full program with DRY on in every row (llama.cpp's parameters 0.8 / 1.75 / 2, its default
breakers; a window of 64 tokens and the whole slot), each row holding `--history` * 3/4 tokens of a random
prompt that repeats. Rounds alternate the variants so drift on a noisy host hits all alike; the report gives
each variant's median ms over all rounds and its ratio to "full, greedy" (the same program with DRY off).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import host, save_report  # noqa: E402

BASELINE = "full, greedy"


def variants() -> dict[str, tuple[dict, bool, dict]]:
    """name -> (SamplingParams fields, masked, sample() static arguments)."""
    dry_on = {"dry_multiplier": 0.8}
    return {
        "cheap, greedy": ({"temperature": 0.0}, False, {"needs_full": False}),
        "cheap, greedy + mask": ({"temperature": 0.0}, True, {"needs_full": False}),
        "cheap, temperature 0.7": ({"temperature": 0.7}, False, {"needs_full": False}),
        "cheap, greedy, no logprobs": ({"temperature": 0.0}, False, {"needs_full": False}),
        "cheap, temperature 0.7, no logprobs": ({"temperature": 0.7}, False, {"needs_full": False}),
        BASELINE: ({"temperature": 0.0}, False, {}),
        "full, greedy + penalties": ({"temperature": 0.0, "repetition_penalty": 1.1, "frequency_penalty": 0.5,
                                      "presence_penalty": 0.5}, False, {}),
        "full, top_k 40 top_p 0.9": ({"temperature": 0.8, "top_k": 40, "top_p": 0.9}, False, {}),
        "full, greedy + DRY (last 64)": ({"temperature": 0.0, **dry_on}, False, {}),
        "full, greedy + DRY (whole slot)": ({"temperature": 0.0, **dry_on, "dry_penalty_last_n": -1}, False, {}),
        "full, greedy + DRY (whole slot) + mask": ({"temperature": 0.0, **dry_on, "dry_penalty_last_n": -1}, True,
                                                   {}),
    }


@dataclass
class Inputs:
    """What every variant's step is given: the same logits, mask, DRY limit and prompt, so that only the
    program and the sampling parameters differ."""

    logits: Any
    packed: Any  # the grammar mask, bit-packed
    active: Any
    limit: Any  # dry.RepeatLimit's limit of the prompt, per row
    breakers: Any
    prompt: list[int]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--history", type=int, default=2048, help="the slot length (the DRY history's size)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10, help="timed calls per variant per round")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/sampler-cpu.json"))
    return p.parse_args(argv)


def make_inputs(args: argparse.Namespace) -> Inputs:
    """Random inputs from a fixed seed (the draws stay in this order so every run sees the same ones): a
    quarter of the vocabulary masked out, a prompt repeating a 40-token phrase, as many breakers as Gemma's."""
    import jax.numpy as jnp
    import numpy as np

    from core import dry, sampling

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(args.rows, args.vocab)).astype(np.float32) * 3)
    allowed = np.ones((args.rows, args.vocab), np.bool_)
    allowed[:, rng.integers(0, args.vocab, args.vocab // 4)] = False
    packed = jnp.asarray(sampling.pack_mask(allowed))
    phrase = rng.integers(0, args.vocab, 40).tolist()
    prompt = (phrase * (args.history // 40 + 1))[: args.history * 3 // 4]
    breakers = np.array(sorted(rng.choice(args.vocab, 1300, replace=False)), np.int32)  # as many as Gemma's
    limit = jnp.full((args.rows,), dry.RepeatLimit(dry.BreakerTable(breakers, {}), -1, prompt).limit, jnp.int32)
    return Inputs(logits=logits, packed=packed, active=jnp.ones((args.rows,), jnp.bool_), limit=limit,
                  breakers=breakers, prompt=prompt)


def sample_step(fn: Any, inputs: Inputs, state: Any, masked: bool, static: dict, rows: int) -> Any:
    """One call of the jitted sampler, waited for; its last output is the next state (the old one is donated)."""
    import jax
    import jax.numpy as jnp

    out = fn(inputs.logits, state, inputs.packed if masked else None, jnp.zeros((rows,), jnp.int32),
             inputs.active, inputs.limit, num_top=20, **static)
    jax.block_until_ready(out)
    return out


def first_states(fn: Any, inputs: Inputs, args: argparse.Namespace) -> dict[str, Any]:
    """Each variant's state after one untimed step (which compiles its program), every row holding the prompt."""
    from core import sampling
    from core.sampling import SamplingParams

    states = {}
    for name, (fields, masked, static) in variants().items():
        state = sampling.init_state(args.rows, args.vocab, history=args.history)
        for row in range(args.rows):
            state = sampling.set_slot(state, row, SamplingParams(**fields), inputs.prompt, row,
                                      dry_breakers=inputs.breakers, logprobs=not name.endswith("no logprobs"))
        states[name] = sample_step(fn, inputs, state, masked, static, args.rows)[-1]
    return states


def time_variants(fn: Any, inputs: Inputs, states: dict[str, Any], args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per call, rounds alternating the variants so that drift on a noisy host hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in states}
    for _ in range(args.rounds):
        for name, (_, masked, static) in variants().items():
            for _ in range(args.iters):
                begin = time.perf_counter()
                # Each call appends a token to every DRY history (rounds x iters more than the prompt's).
                out = sample_step(fn, inputs, states[name], masked, static, args.rows)
                times[name].append(time.perf_counter() - begin)
                states[name] = out[-1]
    return times


def build_report(args: argparse.Namespace, argv: list[str] | None, prompt_tokens: int,
                 times: dict[str, list[float]]) -> dict[str, Any]:
    """Per variant: median and p90 ms over every round, and the median's ratio to BASELINE's."""
    import jax
    import numpy as np

    base = statistics.median(times[BASELINE])
    return {
        "benchmark": "sampler",
        "command": "python3 benchmarks/sampler.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": host(), "platform": jax.devices()[0].platform,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": args.rows, "vocab": args.vocab, "history": args.history, "prompt_tokens": prompt_tokens,
        "rounds": args.rounds, "iters": args.iters, "baseline": BASELINE,
        "variants": {name: {"median_ms": round(statistics.median(t) * 1e3, 3),
                            "p90_ms": round(float(np.percentile(t, 90)) * 1e3, 3),
                            "ratio_to_baseline": round(statistics.median(t) / base, 3)}
                     for name, t in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    from core import sampling

    inputs = make_inputs(args)
    fn = jax.jit(sampling.sample, static_argnames=("num_top", "needs_full", "k_max"), donate_argnames=("state",))
    states = first_states(fn, inputs, args)
    times = time_variants(fn, inputs, states, args)
    save_report(args.out, build_report(args, argv, len(inputs.prompt), times))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
