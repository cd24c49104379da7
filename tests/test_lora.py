"""LoRA adapters as PEFT saves them (`core.lora`): read and checked against the model, their effect proven
against peft's own merge of the same adapter into the weights, and every malformed adapter refused by name."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from core.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, TARGETS, AdapterError, read_adapter
from tests.tiny_models import build, model_config

pytestmark = pytest.mark.slow
MAX_RANK = 16


def save_adapter(family: str, directory, rank: int = 4, alpha: float = 8, targets=tuple(TARGETS), seed: int = 0,
                 **extra):
    """A random non-zero PEFT LoRA adapter (``seed``) on the tiny ``family`` model (that of `tiny_checkpoints`),
    saved to ``directory``; the peft model."""
    import torch
    from peft import LoraConfig, get_peft_model

    base = build(family)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **extra)
    torch.manual_seed(seed + 1)
    model = get_peft_model(base, config)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
@pytest.mark.parametrize("rslora", [False, True])
def test_an_adapter_adds_what_peft_merges_into_each_projection(tmp_path, family, rslora):
    """W + scale * B @ A, read from the saved adapter, equals every weight peft's merge_and_unload makes (its
    scaling: alpha / r, or alpha / sqrt(r) with rsLoRA). A KV-shared layer computes no keys or values (nor does
    transformers', which gives it no k/v projections to adapt): pairs an adapter carries there anyway are read,
    checked and listed as without effect."""
    model = save_adapter(family, tmp_path, rank=4, alpha=12, use_rslora=rslora)
    base = {k: v.detach().numpy().copy() for k, v in build(family).state_dict().items()}
    merged = {k: v.detach().numpy() for k, v in model.merge_and_unload().state_dict().items()}
    cfg = model_config(family)
    shared = [layer.index for layer in cfg.layers if not layer.owns_cache]
    extra = [f"base_model.model.model.layers.{i}.self_attn.k_proj.lora_{half}.weight" for i in shared for half in "AB"]
    def kv_out(name: str) -> int:
        layer = cfg.layers[int(name.split(".layers.")[1].split(".")[0])]
        return layer.num_kv_heads * layer.head_dim

    _rewrite_weights(tmp_path, lambda t: t.update({
        name: np.ones((4, cfg.hidden_size) if name.endswith("lora_A.weight") else (kv_out(name), 4), np.float32)
        for name in extra}))
    adapter = read_adapter(tmp_path, cfg, MAX_RANK)
    assert adapter.rank == 4 and math.isclose(adapter.scale, 12 / (2.0 if rslora else 4.0))
    assert sorted(adapter.ignored) == sorted(extra) and bool(shared) == (family == "gemma4")
    for (layer, target), (a, b) in adapter.pairs.items():
        name = f"model.layers.{layer}.{TARGETS[target]}.{target}.weight"
        np.testing.assert_allclose(base[name] + adapter.scale * (b @ a), merged[name], rtol=1e-5, atol=1e-6)
    owned = {(layer.index, t) for layer in cfg.layers for t in TARGETS
             if layer.owns_cache or t not in ("k_proj", "v_proj")}
    owned -= {(layer.index, "v_proj") for layer in cfg.layers if layer.k_eq_v}
    assert set(adapter.pairs) == owned


def _rewrite_config(directory, **changes) -> None:
    path = directory / ADAPTER_CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _rewrite_weights(directory, change) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(directory / ADAPTER_WEIGHTS)
    change(tensors)
    save_file(tensors, directory / ADAPTER_WEIGHTS)


@pytest.mark.parametrize(("damage", "named"), [
    (lambda d: _rewrite_config(d, modules_to_save=["lm_head"]), "modules_to_save"),
    (lambda d: _rewrite_config(d, use_dora=True), "DoRA"),
    (lambda d: _rewrite_config(d, peft_type="PREFIX_TUNING"), "peft_type"),
    (lambda d: _rewrite_config(d, r=32), "rank 32 is over"),
    (lambda d: _rewrite_config(d, rank_pattern={"q_proj": 8}), "per-module ranks"),
    (lambda d: _rewrite_config(d, target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
    (lambda d: _rewrite_config(d, r=2), "needs"),  # the tensors are rank 4
    (lambda d: (d / ADAPTER_CONFIG).write_text("{not json"), "not readable JSON"),
    (lambda d: (d / ADAPTER_CONFIG).unlink(), "no adapter_config.json"),
    (lambda d: _rewrite_weights(d, lambda t: t.pop(next(k for k in sorted(t) if "lora_B" in k))), "no lora_B"),
    (lambda d: _rewrite_weights(d, lambda t: t.update({k: np.full_like(v, np.nan) for k, v in list(t.items())[:1]})),
     "NaN"),
    (lambda d: (d / ADAPTER_WEIGHTS).write_bytes((d / ADAPTER_WEIGHTS).read_bytes()[:-100]), "adapter_model"),
])  # fmt: skip
def test_a_malformed_adapter_is_refused_naming_the_problem(tmp_path, damage, named):
    save_adapter("gemma3", tmp_path)
    damage(tmp_path)
    with pytest.raises(AdapterError, match=named):
        read_adapter(tmp_path, model_config("gemma3"), MAX_RANK)


def test_an_adapter_for_another_model_is_refused_by_its_shapes(tmp_path):
    save_adapter("gemma3", tmp_path)
    with pytest.raises(AdapterError, match="this model needs|does not have"):
        read_adapter(tmp_path, model_config("gemma4"), MAX_RANK)


def test_one_batched_product_gives_each_row_its_own_adapter(tmp_path):
    """Rows of three adapters of different ranks and a row with none, through the stacked slots of an input
    group (gate and up): each row gets scale * x @ A^T @ B^T of its own adapter on each projection (its slot's
    padding, the other slots and the group's other projection add nothing), the row with none exactly zero."""
    import jax.numpy as jnp

    from core.lora import pack_group
    from core.model import lora_delta

    cfg = model_config("gemma3")
    adapters = []
    for i, rank in enumerate((2, 4, 3)):
        save_adapter("gemma3", tmp_path / str(i), rank=rank, alpha=5 + i, seed=i)
        adapters.append(read_adapter(tmp_path / str(i), cfg, MAX_RANK))
    slots = [adapters[0], None, adapters[1], adapters[2]]  # slot 1 empty
    h = cfg.hidden_size
    out = cfg.layers[0].mlp_dim
    targets = ("gate_proj", "up_proj")
    down, ups = pack_group(slots, 0, targets, h, (out, out), max_rank=8)
    rows = np.array([2, -1, 0, 3, 2])  # slots of five rows; one with no adapter
    x = np.random.default_rng(0).standard_normal((len(rows), 3, h)).astype(np.float32)
    got = [np.asarray(y) for y in lora_delta(jnp.asarray(x), jnp.asarray(down), [jnp.asarray(ups[t]) for t in targets],
                                             jnp.asarray(rows, jnp.int32))]
    for target, terms in zip(targets, got, strict=True):
        for row, slot in enumerate(rows):
            if slot < 0:
                np.testing.assert_array_equal(terms[row], 0)
                continue
            adapter = slots[slot]
            a, b = adapter.pairs[0, target]
            np.testing.assert_allclose(terms[row], adapter.scale * x[row] @ a.T @ b.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_slot_batched_form_is_used_exactly_where_the_host_probe_says_it_rounds_as_the_pairs(monkeypatch, dtype):
    """`lora_delta` gives one-token rows of many adapters their terms in a slot-batched form only where this
    host rounds that as the per-slot terms: for each form, the probe's answer (`slot_form_exact`) for these
    shapes is what the form really does here; the engine's choice (`slot_batched_lora_form`) is the first form
    the probe accepts; and a form one ulp off is caught."""
    import jax
    import jax.numpy as jnp

    from core import model
    from core.model import SLOT_BATCHED_FORMS, lora_delta, slot_batched_lora_form, slot_form_exact

    rng = np.random.default_rng(3)
    rows, slots, rank, d_in, outs = 6, 6, 8, 96, (160, 48)
    down = jnp.asarray(rng.standard_normal((d_in, slots, len(outs), rank)), dtype)
    ups = [jnp.asarray(rng.standard_normal((slots, rank, d_out)), dtype) for d_out in outs]
    x = jnp.asarray(rng.standard_normal((rows, 1, d_in)), jnp.float32)
    owner = jnp.asarray([0, 1, 2, 3, 4, -1], jnp.int32)
    shapes = ((d_in, outs),)
    pairs = jax.jit(lora_delta)(x, down, ups, owner)
    for form in SLOT_BATCHED_FORMS:
        batched = jax.jit(lambda *a, form=form: lora_delta(*a, slot_batched=(form, 1)))(x, down, ups, owner)
        exact = slot_form_exact(form, shapes, rows, slots, rank, dtype)
        # the row with none: the caller's
        assert all(bool(jnp.array_equal(p[:5], b[:5])) for p, b in zip(pairs, batched, strict=True)) == exact, form
        one_slot = jnp.zeros(rows, jnp.int32)  # a step of one adapter stays on the pairs: not more slots than 1
        for p, b in zip(jax.jit(lambda *a, form=form: lora_delta(*a, slot_batched=(form, 1)))(x, down, ups, one_slot),
                        jax.jit(lora_delta)(x, down, ups, one_slot), strict=True):
            assert bool(jnp.array_equal(p, b))
    chosen = slot_batched_lora_form(shapes, rows, slots, rank, dtype)
    assert chosen == next((f for f in SLOT_BATCHED_FORMS if slot_form_exact(f, shapes, rows, slots, rank, dtype)),
                          None)

    def off_by_an_ulp(x: jax.Array, owner: jax.Array, down: jax.Array, ups: list[jax.Array]) -> list[jax.Array]:
        return [jnp.nextafter(y, jnp.inf) for y in model.per_slot_terms(x, owner, down, ups)]

    for form in SLOT_BATCHED_FORMS:
        monkeypatch.setitem(model.SLOT_BATCHED_FORMS, form, off_by_an_ulp)
    model.slot_form_exact.cache_clear()
    try:
        assert slot_batched_lora_form(shapes, rows, slots, rank, dtype) is None
    finally:
        model.slot_form_exact.cache_clear()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_slot_batched_form_the_probe_accepts_holds_for_many_inputs(dtype):
    """Where the probe accepts a form for the default model's input groups (eight rows under eight rank-16
    slots), 300 other random batches get the per-slot terms' bits from it too. bfloat16 slots round the down
    product before the up products, so a probe of the terms alone passed by luck on a host whose down product
    rounds by its width (Zen 4 over 2048 channels: 7 of 200 batches differed)."""
    import jax
    import jax.numpy as jnp

    from core.model import SLOT_BATCHED_FORMS, per_slot_terms, slot_form_exact

    rows = slots = 8
    rank = 16
    owner = jnp.arange(rows, dtype=jnp.int32)
    rng = np.random.default_rng(11)
    for d_in, outs in ((640, (1024, 256, 256)), (2048, (640,))):
        down = jnp.asarray(rng.standard_normal((d_in, slots, len(outs), rank)), dtype)
        ups = [jnp.asarray(rng.standard_normal((slots, rank, d_out)), dtype) for d_out in outs]
        for form, terms in SLOT_BATCHED_FORMS.items():
            if not slot_form_exact(form, ((d_in, outs),), rows, slots, rank, dtype):
                continue

            @jax.jit
            def differ(xs: jax.Array, terms=terms, down=down, ups=ups) -> jax.Array:
                def one(x: jax.Array) -> jax.Array:
                    return jnp.any(jnp.stack([jnp.any(a != b) for a, b in zip(
                        per_slot_terms(x, owner, down, ups), terms(x, owner, down, ups), strict=True)]))
                return jax.lax.map(one, xs)

            found = differ(jnp.asarray(rng.standard_normal((300, rows, d_in)), jnp.float32))
            assert not bool(jnp.any(found)), (form, d_in, outs, int(jnp.sum(found)))


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_the_model_with_adapters_matches_transformers_with_peft_row_by_row(tmp_path, tiny_checkpoints, family):
    """One batch, three rows: adapter 1, no adapter, adapter 2. Each adapted row's logits equal transformers +
    peft on that adapter (peft's float64 merge as the reference, the model-parity tolerance, and peft's own
    float32 forward agreeing with it); the row with none is bit-identical to
    the model without any adapter slots."""
    import copy

    import jax
    import jax.numpy as jnp
    import torch
    from test_model_parity import full_logits, load_ours

    from core.kv_cache import CacheSpec, init_cache
    from core.lora import attach_slots
    from core.model import sequence_logits

    directory, _ = tiny_checkpoints[family]
    cfg, params = load_ours(directory)
    peft_models, adapters = [], []
    for i, rank in enumerate((4, 2)):
        peft_models.append(save_adapter(family, tmp_path / str(i), rank=rank, alpha=6 + i, seed=10 * i))
        adapters.append(read_adapter(tmp_path / str(i), cfg, MAX_RANK))
    ids = np.random.default_rng(3).integers(3, cfg.vocab_size, size=(3, 21))
    rows = np.array([0, -1, 1])
    slotted = attach_slots(params, adapters, cfg, max_rank=8)
    cache = init_cache(cfg, CacheSpec(num_slots=3, max_len=ids.shape[1]))
    fn = jax.jit(lambda p, c, t, m: sequence_logits(p, c, t, jnp.zeros(3, jnp.int32), jnp.full(3, ids.shape[1],
                                                    jnp.int32), jnp.arange(3, dtype=jnp.int32), cfg=cfg,
                                                    adapters=m))
    got, _ = fn(slotted, cache, jnp.asarray(ids, jnp.int32), jnp.asarray(rows, jnp.int32))
    got = np.asarray(got)
    for row, slot in enumerate(rows):
        if slot < 0:
            np.testing.assert_array_equal(got[row], full_logits(cfg, params, ids)[row])
            continue
        with torch.no_grad():
            model = peft_models[slot]
            expected = model(torch.tensor(ids[row:row + 1])).logits.numpy()[0]
            # float64 through peft's own merge (a float64 copy of the unmerged peft model drops the adapters)
            exact = copy.deepcopy(model).merge_and_unload().double()(torch.tensor(ids[row:row + 1])).logits.numpy()[0]
        noise = float(np.abs(expected - exact).max())
        assert noise < 1e-3  # peft's float32 forward with the adapters unmerged is the same function
        np.testing.assert_allclose(got[row], exact, atol=max(1e-4, 8 * noise), rtol=0)


def test_the_default_model_under_a_rank16_adapter_decodes_as_transformers_with_peft(tmp_path, real_model,
                                                                                     hf_real_model):
    """The real Gemma 3 270M (float32 reference path) with a random rank-16 adapter on all seven projections:
    our engine's greedy continuation, decoded in one batch with a row under no adapter, is transformers + peft's
    greedy continuation (its argmax at every position of prompt + ours), and the adapter changes it."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    from core.engine import NO_ADAPTER, Engine, EngineConfig

    config = LoraConfig(r=16, lora_alpha=16, target_modules=list(TARGETS), init_lora_weights=False)
    torch.manual_seed(3)
    peft_model = get_peft_model(copy.deepcopy(hf_real_model), config)
    with torch.no_grad():  # peft's random init is far larger than a trained adapter's: keep the model coherent
        for name, weight in peft_model.named_parameters():
            if "lora_B" in name:
                weight.mul_(0.05)
    peft_model.save_pretrained(tmp_path)
    adapter = read_adapter(tmp_path, real_model.cfg, MAX_RANK)
    engine = Engine(real_model.cfg, real_model.params, EngineConfig(num_slots=2, max_len=128, chunk_sizes=(32,),
                                                                    adapter_slots=1, adapter_rank=MAX_RANK),
                    "float32")
    engine.load_adapter(0, adapter)
    prompt = real_model.tokenizer.encode("The capital of France is", add_bos=True)
    outs = {}
    for slot, index in ((0, 0), (1, NO_ADAPTER)):
        engine.use_adapter(slot, index)
        outs[slot] = [int(np.argmax(np.asarray(engine.prefill(slot, prompt, 0))))]
    for step in range(11):
        tokens = np.array([outs[0][-1], outs[1][-1]], np.int32)
        logits = np.asarray(engine.decode(tokens, np.full(2, len(prompt) + step, np.int32), np.ones(2, bool)))
        for slot in (0, 1):
            outs[slot].append(int(np.argmax(logits[slot])))
    assert outs[0] != outs[1]
    for slot, model in ((0, peft_model), (1, hf_real_model)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + outs[slot]])).logits[0].numpy()
        assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == outs[slot], slot
