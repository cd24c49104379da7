"""LoRA adapters through the engine's compiled steps (`core.engine`, docs/lora.md): rows of different adapters
and rows with none share every decode step, prefill and verify; a row's bits do not depend on its neighbours'
adapters, on how its prompt was split, or on whether a decode step or a prefill computed it; loading an
adapter changes no program."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from core.config import ModelConfig
from core.engine import NO_ADAPTER, Engine, EngineConfig
from core.lora import LoraAdapter, adapted_projections
from core.sampling import SamplingParams
from core.weights import random_params, to_w8a8
from scheduler.request import GenerationRequest
from scheduler.scheduler import Scheduler, SchedulerConfig
from tiny_models import CONFIGS

VOCAB = 512
SLOTS = 4
RANK = 8


def random_adapter(cfg: ModelConfig, rank: int, seed: int, scale: float = 0.5) -> LoraAdapter:
    """A non-zero adapter on every projection an adapter slot may change."""
    rng = np.random.default_rng(seed)
    pairs = {key: (rng.standard_normal((rank, i)).astype(np.float32) * 0.2,
                   rng.standard_normal((o, rank)).astype(np.float32) * 0.2)
             for key, (i, o) in adapted_projections(cfg).items()}
    return LoraAdapter(Path(f"random-{seed}"), rank, scale, pairs)


def mix_adapters(engine, cfg: ModelConfig) -> None:
    """Two random adapters (ranks 8 and 5) in adapter slots 0 and 1; KV slots 0, 1, 2 use adapter 1, none, 0."""
    engine.load_adapter(0, random_adapter(cfg, 8, seed=1))
    engine.load_adapter(1, random_adapter(cfg, 5, seed=2))
    for slot, index in enumerate((1, -1, 0)):
        engine.use_adapter(slot, index)


def tiny(family: str) -> ModelConfig:
    return ModelConfig.from_hf_dict({**CONFIGS[family], "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB})


@pytest.fixture(scope="module", params=["gemma3", "gemma4", "gemma3-w8a8-int8kv", "gemma4-w8a8-int8kv-bf16slots"])
def setup(request, compile_cache):
    family, _, variant = request.param.partition("-")
    cfg = tiny(family)
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=5)
    kv_dtype = None
    if variant:
        params, kv_dtype = to_w8a8(params), "int8"
    config = dict(num_slots=SLOTS, max_len=64, chunk_sizes=(4, 16), kv_dtype=kv_dtype, attention_buckets=())
    # A decode step of rows under both adapters computes their terms batched over the slots where the host
    # rounds that as the per-slot pairs (`core.model.lora_delta`); a row alone keeps the pairs.
    adapted = Engine(cfg, params, EngineConfig(**config, adapter_slots=2, adapter_rank=RANK, slot_batched_lora_over=1,
                                               adapter_dtype="bfloat16" if "bf16slots" in variant else None),
                     "float32")
    plain = Engine(cfg, params, EngineConfig(**config), "float32")
    adapted.load_adapter(0, random_adapter(cfg, RANK, seed=1))
    adapted.load_adapter(1, random_adapter(cfg, 3, seed=2))
    return cfg, adapted, plain


PROMPTS = [np.random.default_rng(s).integers(3, VOCAB, 11) for s in range(SLOTS)]
ADAPTERS = [0, NO_ADAPTER, 1, 0]  # per KV slot


def run(engine: Engine, slots: list[int], adapters: list[int], steps: int = 5) -> dict[int, list[np.ndarray]]:
    """Prefill ``slots`` (each its PROMPT, under its adapter), then greedy decode steps with only those slots
    active: each slot's logits after its prompt and after each step."""
    out: dict[int, list[np.ndarray]] = {}
    tokens = np.zeros(SLOTS, np.int32)
    for slot in slots:
        engine.use_adapter(slot, adapters[slot])
        logits = np.asarray(engine.prefill(slot, PROMPTS[slot], 0))
        out[slot] = [logits]
        tokens[slot] = int(np.argmax(logits))
    active = np.isin(np.arange(SLOTS), slots)
    for step in range(steps):
        positions = np.full(SLOTS, len(PROMPTS[0]) + step, np.int32)
        logits = np.asarray(engine.decode(tokens, positions, active))
        for slot in slots:
            out[slot].append(logits[slot])
            tokens[slot] = int(np.argmax(logits[slot]))
    for slot in range(SLOTS):
        engine.use_adapter(slot, NO_ADAPTER)
    return out


def test_a_row_gets_the_same_bits_whatever_adapters_share_its_batch(setup):
    """Four slots decode together under adapters [0, none, 1, 0]; each slot run alone gives the same logits bit
    for bit, the slot with none those of an engine without adapter slots, and the adapters do change rows."""
    _, adapted, plain = setup
    together = run(adapted, list(range(SLOTS)), ADAPTERS)
    for slot in range(SLOTS):
        alone = run(adapted, [slot], ADAPTERS)
        for step, (a, b) in enumerate(zip(together[slot], alone[slot], strict=True)):
            assert np.array_equal(a, b), f"slot {slot}, step {step}: max |diff| {np.abs(a - b).max()}"
    bare = run(plain, [1], ADAPTERS)
    assert all(np.array_equal(a, b) for a, b in zip(together[1], bare[1], strict=True))
    assert not np.allclose(together[0][0], run(plain, [0], [NO_ADAPTER] * SLOTS)[0][0])
    assert not np.array_equal(together[0][0], run(adapted, [0], [1, 0, 0, 0])[0][0])  # adapter 1 differs


def test_an_adapters_prompt_gives_the_same_bits_however_it_is_split_or_decoded(setup):
    """Under an adapter: a prompt prefilled at once, in pieces of other chunk shapes, or as a prefix followed by
    decode steps of its own tokens ends on the same logits bit for bit (what prefix reuse rests on)."""
    _, adapted, _ = setup
    prompt = np.random.default_rng(9).integers(3, VOCAB, 23)
    adapted.use_adapter(2, 1)
    whole = np.asarray(adapted.prefill(2, prompt, 0))
    for cut in (1, 5, 16):
        adapted.prefill(2, prompt[:cut], 0)
        split = np.asarray(adapted.prefill(2, prompt[cut:], cut))
        assert np.array_equal(split, whole), f"cut at {cut}: max |diff| {np.abs(split - whole).max()}"
    adapted.prefill(2, prompt[:-3], 0)
    tokens, active = np.zeros(SLOTS, np.int32), np.zeros(SLOTS, bool)
    active[2] = True
    for position in range(len(prompt) - 3, len(prompt)):
        tokens[2] = prompt[position]
        logits = np.asarray(adapted.decode(tokens, np.full(SLOTS, position, np.int32), active))[2]
    assert np.array_equal(logits, whole)
    adapted.use_adapter(2, NO_ADAPTER)


def test_decode_batches_adapter_products_over_slots_only_where_the_host_probe_allows(monkeypatch):
    """The engine asks `slot_batched_lora_form` at start-up: where no form is exact, no decode program takes
    one (the per-slot pairs serve every step); where one is, the decode programs are built for it, under a
    program identity of their own for each form (so a stored program of another form is never read back)."""
    from core import engine as engine_module

    cfg = tiny("gemma3")
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=5)
    config = EngineConfig(num_slots=SLOTS, max_len=64, chunk_sizes=(4,), attention_buckets=(), adapter_slots=2,
                          slot_batched_lora_over=3)
    identities = {}
    for answer, expected in ((None, None), ("wide", ("wide", 3))):
        monkeypatch.setattr(engine_module, "slot_batched_lora_form", lambda *_, answer=answer: answer)
        engine = Engine(cfg, params, config, "float32")
        assert engine.slot_batched_lora == expected
        identities[answer] = engine.programs["decode", 64].identity
    assert len(set(identities.values())) == 2
    assert Engine(cfg, params, EngineConfig(num_slots=SLOTS, max_len=64, chunk_sizes=(4,), attention_buckets=()),
                  "float32").slot_batched_lora is None  # no adapter slots: no probe, no form


def test_loading_an_adapter_changes_no_program_and_unloading_restores_the_base(setup):
    """Writing another adapter into a slot runs on the programs compiled at start-up (a compiled program refuses
    arguments of other shapes); emptying the slot gives the adapter-free bits back."""
    cfg, adapted, plain = setup
    compiled = {key: program.ready for key, program in adapted.programs.items()}
    adapted.load_adapter(1, random_adapter(cfg, RANK, seed=7))
    changed = run(adapted, [2], ADAPTERS)[2]
    adapted.load_adapter(1, None)
    emptied = run(adapted, [2], ADAPTERS)[2]
    assert all(np.array_equal(a, b) for a, b in zip(emptied, run(plain, [2], [NO_ADAPTER] * SLOTS)[2], strict=True))
    assert not np.array_equal(changed[0], emptied[0])
    assert {key: program.ready for key, program in adapted.programs.items()} == compiled
    adapted.load_adapter(1, random_adapter(cfg, 3, seed=2))  # as the fixture had it
    with pytest.raises(ValueError, match="rank"):
        adapted.load_adapter(0, random_adapter(cfg, RANK + 1, seed=3))
    with pytest.raises(ValueError, match="out of range"):
        adapted.use_adapter(0, 2)


# ---- through the scheduler ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(compile_cache):
    """A W8A8 + int8-KV engine (the CPU serving default) with two adapter slots, and three adapters."""
    cfg = tiny("gemma3")
    config = EngineConfig(num_slots=SLOTS, max_len=96, chunk_sizes=(4, 16), kv_dtype="int8", adapter_slots=2,
                          adapter_rank=RANK)
    engine = Engine(cfg, to_w8a8(random_params(cfg, std=0.1, norm_std=0.1, seed=6)), config, "float32")
    engine.warmup()
    return engine, [random_adapter(cfg, RANK, seed=20 + i) for i in range(3)]


def greedy(prompt, adapter=None, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(int(t) for t in prompt), sampling=SamplingParams(temperature=0),
                             max_tokens=kw.pop("max_tokens", 6), adapter=adapter, **kw)


def alone(engine, tokenizer, req: GenerationRequest) -> list[int]:
    sched = Scheduler(engine, tokenizer, SchedulerConfig(prefix_caching=False), stop_ids=frozenset())
    handle = sched.submit(req)
    sched.run_until_idle()
    return handle.result(timeout=0)[0]


def test_requests_of_more_adapters_than_slots_each_get_their_own_output(served, tokenizer):
    """Three adapters and a base request at once on two adapter slots: the third adapter's request waits for a
    slot (never evicting a running one), and each output is what the request gives alone."""
    engine, adapters = served
    sched = Scheduler(engine, tokenizer, SchedulerConfig(), stop_ids=frozenset())
    prompt = np.random.default_rng(4).integers(3, VOCAB, 9)
    reqs = [greedy(prompt, adapter) for adapter in (*adapters, None)]
    handles = [sched.submit(r) for r in reqs]
    sched.run_until_idle()
    outputs = [h.result(timeout=0)[0] for h in handles]
    assert sched.adapters.loads == 3
    assert len({tuple(o) for o in outputs}) == 4  # the adapters change the output
    for req, out in zip(reqs, outputs, strict=True):
        assert out == alone(engine, tokenizer, req)


def test_kv_is_reused_only_under_the_adapter_it_was_computed_with(served, tokenizer):
    """A conversation's second turn under its adapter resumes from the cached KV (and equals a cold run); the
    same prompt under another adapter or none computes everything again."""
    engine, adapters = served
    sched = Scheduler(engine, tokenizer, SchedulerConfig(), stop_ids=frozenset())
    first = greedy(np.random.default_rng(5).integers(3, VOCAB, 20), adapters[0], affinity="a")
    out1 = sched.submit(first)
    sched.run_until_idle()
    tokens = out1.result(timeout=0)[0]
    follow = first.prompt_ids + tuple(tokens) + (7, 8, 9)
    runs = []
    for adapter, reused in ((adapters[1], False), (None, False), (adapters[0], True)):
        req = greedy(follow, adapter, affinity="a")
        handle = sched.submit(req)
        sched.run_until_idle()
        out, _, fin = handle.result(timeout=0)
        assert (fin.usage.cached_tokens > 0) is reused, adapter
        runs.append((req, out))
    for req, out in runs:  # cold runs last: another scheduler on this engine overwrites its KV slots
        assert out == alone(engine, tokenizer, req)


def test_a_request_naming_an_adapter_is_refused_where_the_engine_has_no_slots(tokenizer, served):
    _, adapters = served
    cfg = tiny("gemma3")
    plain = Engine(cfg, random_params(cfg, seed=1), EngineConfig(num_slots=1, max_len=32, chunk_sizes=(4,)),
                   "float32")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        Scheduler(plain, tokenizer, stop_ids=frozenset()).submit(greedy([5, 6], adapters[0]))


def test_adapter_slots_are_paged_least_recently_used_and_never_evicted_while_held():
    """Three adapters on two slots: a held slot is never given away (`fits` says wait); an idle one is
    reused for another adapter, the least recently used first; the host tier's bytes are told by adapter."""
    from types import SimpleNamespace

    from scheduler.adapters import AdapterSlots

    loaded: list = [None, None]
    engine = SimpleNamespace(config=SimpleNamespace(adapter_slots=2), loaded_adapters=loaded)
    engine.load_adapter = lambda index, adapter: loaded.__setitem__(
        index, None if adapter is None else adapter.fingerprint)
    cfg = tiny("gemma3")
    a, b, c = (random_adapter(cfg, 2, seed=s) for s in (31, 32, 33))
    slots = AdapterSlots(engine)
    assert not slots.seen
    ia, ib = slots.acquire(a), slots.acquire(b)
    assert slots.seen
    assert {ia, ib} == {0, 1} and slots.fits(a) and not slots.fits(c)
    slots.release(ia)
    assert slots.fits(c) and slots.acquire(c) == ia and slots.loads == 3  # a's idle slot goes to c
    assert slots.acquire(b) == ib and slots.loads == 3  # b is still loaded: shared, no load
    slots.release(ib)
    slots.release(ib)
    slots.release(ia)
    assert slots.acquire(a) == ia  # c was acquired before b's second use: its slot goes first
    assert slots.acquire(None) == NO_ADAPTER
    scope = (("agent", None), a.fingerprint)
    assert slots.host_bytes({scope: 10, ("agent", None): 5, (("x", None), c.fingerprint): 1}) == \
        {a.path.name: 10, "": 5, c.path.name: 1}


def test_an_idle_slot_brings_no_adapter_into_a_step():
    """A slot whose last request ran under an adapter keeps that adapter slot, but an idle row of a decode step
    names none: a step of unadapted active rows then skips the adapter products."""
    from core.engine import _decode_inputs

    packed = _decode_inputs(np.zeros(3), np.zeros(3), np.array([True, False, True]), np.array([1, 0, NO_ADAPTER]))
    assert packed[3].tolist() == [1, NO_ADAPTER, NO_ADAPTER]


def test_bfloat16_slots_hold_half_the_bytes_and_stay_close_to_the_compute_dtype(compile_cache):
    """`EngineConfig.adapter_dtype="bfloat16"`: every slot array is bfloat16 (half the bytes of float32 slots, and
    a new KV identity, so KV kept under the other kind is not reused), and an adapted row's logits stay within
    bfloat16 rounding of the float32 slots' (the adapter terms are a small part of each projection)."""
    cfg = tiny("gemma3")
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=5)
    config = dict(num_slots=SLOTS, max_len=64, chunk_sizes=(4, 16), attention_buckets=(), adapter_slots=2,
                  adapter_rank=RANK)
    full, half = (Engine(cfg, params, EngineConfig(**config, adapter_dtype=dtype), "float32")
                  for dtype in (None, "bfloat16"))
    assert {str(a.dtype) for a in jax.tree_util.tree_leaves([lp["lora"] for lp in half.params["layers"]])} == {
        "bfloat16"}
    assert 2 * half.adapter_bytes_per_slot == full.adapter_bytes_per_slot
    assert half.kv_identity() != full.kv_identity()
    adapter = random_adapter(cfg, RANK, seed=1)
    for engine in (full, half):
        engine.load_adapter(0, adapter)
        engine.use_adapter(0, 0)
    prompt = PROMPTS[0]
    a, b = (np.asarray(engine.prefill(0, prompt, 0)) for engine in (full, half))
    base = np.asarray(Engine(cfg, params, EngineConfig(**{k: v for k, v in config.items() if "adapter" not in k}),
                             "float32").prefill(0, prompt, 0))
    assert not np.array_equal(a, b)  # bfloat16 rounding shows
    assert np.abs(a - b).max() < 0.05 * np.abs(a - base).max()  # ... small against what the adapter changes
    with pytest.raises(ValueError, match="adapter_dtype"):
        EngineConfig(adapter_dtype="int8")
