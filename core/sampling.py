"""On-device token sampler for the batched decode step: one row per KV slot, everything per row.

`sample` is a pure, jittable function of the [S, V] logits, a `SamplerState` (per-slot parameters and
token counts as device arrays), an optional packed allowed-token mask and the per-slot step counter.

Order of operations, per row:
  1. penalties on the raw logits: repetition (tokens seen in prompt or output; divide a positive logit,
     multiply a negative one, HF/vLLM), then frequency and presence (output tokens only, OpenAI), then
     DRY (llama.cpp's, over the last dry_penalty_last_n tokens of prompt + output; core/dry.py);
  2. logit_bias (added after the penalties, so a +/-100 bias is not rescaled by the repetition penalty);
  3. the allowed-token mask: disallowed -> -inf;
  4. reported logprobs = log_softmax of these processed logits, i.e. before temperature and truncation
     (vLLM's default "processed but untruncated" distribution; independent of the sampling knobs), for
     rows whose request reports them (`set_slot(..., logprobs=True)`): the normaliser is a pass over V
     that a step skips when no row reports (other rows get logprob 0 and no top tokens);
  5. temperature == 0 -> greedy argmax of the processed logits (first index on ties);
     otherwise temperature -> top-k -> top-p -> min-p -> one categorical draw.

Truncation is exact set semantics, not a candidate-cap approximation. Every filter keeps a set of the form
{logit >= threshold} (ties at the cut are kept, as in HF and vLLM), so the three compose by taking the
largest threshold:
  top-k   threshold = k-th largest logit;
  top-p   keep a token iff the probability mass (renormalised over the top-k set) of tokens strictly more
          likely than it is < top_p, i.e. the smallest head of the sorted distribution with mass >= top_p;
  min-p   keep p >= min_p * p_max, i.e. logit >= max + T * log(min_p) (renormalising does not change it).
The cuts come from the K_MAX + 1 largest logits (a blocked top-k, no sort: on CPU, sorting 262k-token rows
costs far more than the whole rest of the sampler). When a row's top-k or top-p cut lies beyond those
candidates (top_k > K_MAX, or a nucleus wider than K_MAX tokens), a `lax.cond` taken only when some row needs
it finds the cut by bisection over the float32 bit patterns (25-32 passes over V: too dear to run every step,
cheap enough for the rare row that needs it), so the set is exact either way; the only inexactness left is
float32 rounding in the probability sums (a token whose cumulative mass is within summation error, ~1e-5
relative, of top_p may fall on either side). min-p needs no candidates.

The draw is inverse-CDF with one uniform per row from fold_in(PRNGKey(seed), step): over the candidates
when the kept set lies inside them, else block sums over the row pick a block and a cumulative sum inside
it picks the token. A row's token depends only on its own logits, parameters, seed and step, never on its
slot, its neighbours, or which branches the batch took. (Gumbel-max would need V random numbers per row,
tens of times dearer on CPU than one uniform and a block-sum walk.)

A row whose mask allows no token returns token -1 (and logprob -inf); the caller treats it as an error.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from core import dry

# Static cap on the candidates used to find top-k / top-p cuts without bisection. The blocked top-k's
# cost grows with K_MAX (slowly up to a few hundred, steeply beyond); 128 is still cheap and covers the
# nucleus of a peaked LM distribution at top_p <= 0.95 in most steps. Wider top-k / top-p sets take the
# exact bisection fallback instead. `sample(..., k_max=)` overrides it (static).
K_MAX = 128
# Logit bias is stored sparse: [S, MAX_LOGIT_BIAS] ids + values, scattered into the logits each step.
# On CPU with V = 262144 the scatter is cheaper than adding a dense [S, V] f32 array, which would be read
# in full every step and held as state. MAX_LOGIT_BIAS is this server's per-request limit.
MAX_LOGIT_BIAS = 300
MAX_LOGPROBS = 20
# Block sizes: [S, V] is viewed as [S, V/B, B] for the argmax and the inverse-CDF draw (256) and for
# the candidate top-k (64, measured fastest for k = 65..257 at V = 262144).
_BLOCK = 256
_TOPK_BLOCK = 64
_NEG_INF = float("-inf")


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling knobs (host side). Validated on construction; raises ValueError."""

    temperature: float = 1.0  # 0 -> greedy
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0  # 1 -> off
    min_p: float = 0.0  # 0 -> off
    seed: int | None = None  # None -> the caller draws one and passes it to set_slot
    repetition_penalty: float = 1.0  # prompt + output tokens: logit / rp if > 0 else logit * rp
    frequency_penalty: float = 0.0  # output tokens: logit -= freq * count
    presence_penalty: float = 0.0  # output tokens: logit -= presence * (count > 0)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a dict is accepted
    logprobs: int = 0  # top logprobs to report, 0..MAX_LOGPROBS (the engine's static num_top >= this)
    dry_multiplier: float = 0.0  # 0 -> DRY off; the rest as llama.cpp's server (core/dry.py)
    dry_base: float = dry.DEFAULT_BASE
    dry_allowed_length: int = dry.DEFAULT_ALLOWED_LENGTH
    dry_penalty_last_n: int = dry.DEFAULT_PENALTY_LAST_N  # -1 -> the whole context, 0 -> off
    dry_sequence_breakers: tuple[str, ...] = dry.DEFAULT_BREAKERS

    def __post_init__(self) -> None:
        def real(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            if v > hi or v < lo or (lo_open and v == lo):
                raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}")

        real("temperature", 0.0, math.inf)
        real("top_p", 0.0, 1.0, lo_open=True)
        real("min_p", 0.0, 1.0)
        real("repetition_penalty", 0.0, math.inf, lo_open=True)
        real("frequency_penalty", -2.0, 2.0)
        real("presence_penalty", -2.0, 2.0)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        object.__setattr__(self, "logit_bias", _normalise_bias(self.logit_bias))
        real("dry_multiplier", 0.0, math.inf)
        real("dry_base", 1.0, math.inf)
        for name in ("dry_allowed_length", "dry_penalty_last_n"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        breakers = dry.check_counts(self.dry_allowed_length, self.dry_penalty_last_n, self.dry_sequence_breakers)
        object.__setattr__(self, "dry_sequence_breakers", breakers)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def dry(self) -> bool:
        """Whether the DRY penalty is on."""
        return self.dry_multiplier != 0 and self.dry_penalty_last_n != 0

    @property
    def penalised(self) -> bool:
        """Whether a penalty (repetition, frequency, presence or DRY) applies: the request's logits then depend
        on the tokens it generated, so its next draw depends on the sampler state, not on its seed alone."""
        return (self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
                or self.dry)

    @property
    def needs_full(self) -> bool:
        """True when this request needs `sample(..., needs_full=True)` (penalties or truncation)."""
        truncated = not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)
        return self.penalised or truncated


def _normalise_bias(bias: object) -> tuple[tuple[int, float], ...]:
    pairs = list(bias.items()) if isinstance(bias, Mapping) else bias
    if not isinstance(pairs, Iterable) or isinstance(pairs, (str, bytes)):
        raise ValueError(f"logit_bias must be (token id, bias) pairs or a mapping, got {bias!r}")
    out: list[tuple[int, float]] = []
    for pair in pairs:
        if not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
        tok, val = pair
        if not _is_int(tok) or tok < 0:
            raise ValueError(f"logit_bias token id must be an integer >= 0, got {tok!r}")
        if not _is_real(val) or not math.isfinite(val) or not -100 <= val <= 100:
            raise ValueError(f"logit_bias value for token {tok} must be in [-100, 100], got {val!r}")
        out.append((int(tok), float(val)))
    if len(out) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(out)} entries, at most {MAX_LOGIT_BIAS} are allowed")
    if len({t for t, _ in out}) != len(out):
        raise ValueError("logit_bias lists a token id more than once")
    return tuple(out)


def batch_needs_full(params: Iterable[SamplingParams | None]) -> bool:
    """Whether the active requests need the full sampler variant (None = idle slot)."""
    return any(p is not None and p.needs_full for p in params)


class DryState(NamedTuple):
    """Per-slot DRY parameters and history: [S] and [S, H] device arrays, H = the slot length.

    `match[s, j]` is how many tokens ending at position j equal the last ones of the slot's history (0 for
    the last position itself and beyond the history), kept up to date as each token is appended.
    """

    multiplier: jax.Array  # [S] f32
    base: jax.Array  # [S] f32
    allowed: jax.Array  # [S] i32 allowed_length
    window: jax.Array  # [S] i32 tokens scanned (penalty_last_n, -1 -> H); 0 = DRY off for the slot
    max_exp: jax.Array  # [S] i32 cap on the exponent, 0 = none
    history: jax.Array  # [S, H] i32 prompt + output token ids by position
    match: jax.Array  # [S, H] i32
    length: jax.Array  # [S] i32 tokens in the history
    breaker: jax.Array  # [S, V] bool single-token sequence breakers (never penalised)


class SamplerState(NamedTuple):
    """Per-slot sampler parameters and token statistics, all device arrays with a leading slot axis."""

    temperature: jax.Array  # [S] f32, 0 = greedy
    top_k: jax.Array  # [S] i32, 0 = off
    top_p: jax.Array  # [S] f32, 1 = off
    min_p: jax.Array  # [S] f32, 0 = off
    repetition_penalty: jax.Array  # [S] f32
    frequency_penalty: jax.Array  # [S] f32
    presence_penalty: jax.Array  # [S] f32
    key: jax.Array  # [S, 2] uint32 raw threefry key data of PRNGKey(seed)
    counts: jax.Array  # [S, V] i32 output-token counts (frequency / presence penalties)
    seen: jax.Array  # [S, V] bool token occurred in the prompt or the output (repetition penalty)
    bias_ids: jax.Array  # [S, MAX_LOGIT_BIAS] i32, unused entries = V (dropped by the scatter)
    bias_vals: jax.Array  # [S, MAX_LOGIT_BIAS] f32
    dry: DryState
    logprobs: jax.Array  # [S] bool the slot's request reports logprobs (`sample` computes them only then)


# History kept for DRY when the caller does not give the slot length.
DEFAULT_HISTORY = 512


def init_state(num_slots: int, vocab_size: int, history: int = DEFAULT_HISTORY) -> SamplerState:
    """All slots neutral and greedy, counts zero, no bias, DRY off with room for `history` tokens (the
    slot length); made by one program (`core.kv_cache.init_cache` says why)."""
    return jax.jit(partial(_neutral_state, num_slots, vocab_size, history))()


def _neutral_state(num_slots: int, vocab_size: int, history: int) -> SamplerState:
    s, v, h = num_slots, vocab_size, history
    zeros_i32 = jnp.zeros((s,), jnp.int32)
    dry_state = DryState(multiplier=jnp.zeros((s,), jnp.float32), base=jnp.ones((s,), jnp.float32),
                         allowed=zeros_i32, window=zeros_i32, max_exp=zeros_i32,
                         history=jnp.zeros((s, h), jnp.int32), match=jnp.zeros((s, h), jnp.int32),
                         length=zeros_i32, breaker=jnp.zeros((s, v), jnp.bool_))
    return SamplerState(
        temperature=jnp.zeros((s,), jnp.float32),
        top_k=jnp.zeros((s,), jnp.int32),
        top_p=jnp.ones((s,), jnp.float32),
        min_p=jnp.zeros((s,), jnp.float32),
        repetition_penalty=jnp.ones((s,), jnp.float32),
        frequency_penalty=jnp.zeros((s,), jnp.float32),
        presence_penalty=jnp.zeros((s,), jnp.float32),
        key=jnp.zeros((s, 2), jnp.uint32),
        counts=jnp.zeros((s, v), jnp.int32),
        seen=jnp.zeros((s, v), jnp.bool_),
        bias_ids=jnp.full((s, MAX_LOGIT_BIAS), v, jnp.int32),
        bias_vals=jnp.zeros((s, MAX_LOGIT_BIAS), jnp.float32),
        dry=dry_state,
        logprobs=jnp.zeros((s,), jnp.bool_),
    )


class SlotRequest(NamedTuple):
    """What `set_slots` installs in one slot (the arguments of `set_slot`)."""

    slot: int
    params: SamplingParams
    prompt_ids: Sequence[int]
    seed: int
    dry_breakers: np.ndarray | None = None
    logprobs: bool = True


class _SlotRows(NamedTuple):
    """Host arrays of the call's new rows, [N, ...] each (N: 1, or the slot count S; rows that name slot S are
    dropped by the scatter); the vocabulary-wide flags go bit-packed (32 tokens a word), a twentieth of their
    bytes as bool."""

    slots: np.ndarray  # [N] int32 the slot each row goes to
    floats: np.ndarray  # [N, 8] f32 temperature, top_p, min_p, penalties x3, DRY multiplier and base
    ints: np.ndarray  # [N, 6] i32 top_k, DRY allowed, window, max_exp, length, logprobs
    key: np.ndarray  # [N, 2] uint32
    bias_ids: np.ndarray  # [N, MAX_LOGIT_BIAS] i32
    bias_vals: np.ndarray  # [N, MAX_LOGIT_BIAS] f32
    flags: np.ndarray  # [N, 2, ceil(V/32)] uint32 seen (prompt tokens), DRY breakers
    history: np.ndarray  # [N, 2, H] i32 DRY history, DRY match


@jax.jit
def _write_slots(state: SamplerState, rows: _SlotRows) -> SamplerState:
    """One compiled update of every field of the slots ``rows.slots`` names (traced: no recompile per slot
    or per number of rows)."""
    vocab = state.seen.shape[1]
    at = rows.slots

    def put(full: jax.Array, new: jax.Array) -> jax.Array:
        return full.at[at].set(new.astype(full.dtype), mode="drop")

    f, i = rows.floats, rows.ints
    dry_state = DryState(multiplier=put(state.dry.multiplier, f[:, 6]), base=put(state.dry.base, f[:, 7]),
                         allowed=put(state.dry.allowed, i[:, 1]), window=put(state.dry.window, i[:, 2]),
                         max_exp=put(state.dry.max_exp, i[:, 3]), history=put(state.dry.history, rows.history[:, 0]),
                         match=put(state.dry.match, rows.history[:, 1]), length=put(state.dry.length, i[:, 4]),
                         breaker=put(state.dry.breaker, unpack_mask(rows.flags[:, 1], vocab)))
    return state._replace(
        temperature=put(state.temperature, f[:, 0]),
        top_p=put(state.top_p, f[:, 1]),
        min_p=put(state.min_p, f[:, 2]),
        repetition_penalty=put(state.repetition_penalty, f[:, 3]),
        frequency_penalty=put(state.frequency_penalty, f[:, 4]),
        presence_penalty=put(state.presence_penalty, f[:, 5]),
        top_k=put(state.top_k, i[:, 0]),
        key=put(state.key, rows.key),
        counts=put(state.counts, jnp.zeros((at.shape[0], vocab), jnp.int32)),
        seen=put(state.seen, unpack_mask(rows.flags[:, 0], vocab)),
        bias_ids=put(state.bias_ids, rows.bias_ids),
        bias_vals=put(state.bias_vals, rows.bias_vals),
        dry=dry_state,
        logprobs=put(state.logprobs, i[:, 5] != 0),
    )


def seed_key_data(seed: int) -> np.ndarray:
    """uint32 [2] threefry key data of a 64-bit seed; equals key_data(PRNGKey(seed)) for seed < 2**31."""
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)


def set_slot(state: SamplerState, slot: int, params: SamplingParams, prompt_ids: Sequence[int],
             seed: int, dry_breakers: np.ndarray | None = None, logprobs: bool = True) -> SamplerState:
    """Install a request in `slot` (once per admission): parameters, seed, bias; output counts reset, the
    prompt tokens marked as seen for the repetition penalty and, with DRY on, kept as its history.
    dry_breakers: the ids of single-token sequence breakers (`core.dry.BreakerTable.single`), needed when
    params.dry is on; logprobs: whether `sample` reports the slot's logprobs (a server that will not show
    them passes False, so steps without such a row skip their normaliser). Returns the new state."""
    return set_slots(state, [SlotRequest(slot, params, prompt_ids, seed, dry_breakers, logprobs)])


def set_slots(state: SamplerState, requests: Sequence[SlotRequest]) -> SamplerState:
    """`set_slot` for several slots in one program call (an iteration's admissions: each call moves its
    arguments to the device one by one, ~8 ms a call on a TPU v5e's host). The slots must differ. Two shapes
    of the program: one row (most iterations admit one request; the all-slots shape costs it ~3x on a 2-core
    CPU, 3.3 vs 1.3 ms) or a row per slot."""
    num_slots, vocab = state.counts.shape
    if not 0 < len(requests) <= num_slots:
        raise ValueError(f"{len(requests)} requests for {num_slots} slots")
    n = 1 if len(requests) == 1 else num_slots
    history = state.dry.history.shape[1]
    rows = _SlotRows(slots=np.full(n, num_slots, np.int32), floats=np.zeros((n, 8), np.float32),
                     ints=np.zeros((n, 6), np.int32), key=np.zeros((n, 2), np.uint32),
                     bias_ids=np.full((n, MAX_LOGIT_BIAS), vocab, np.int32),
                     bias_vals=np.zeros((n, MAX_LOGIT_BIAS), np.float32),
                     flags=np.zeros((n, 2, -(-vocab // 32)), np.uint32), history=np.zeros((n, 2, history), np.int32))
    for row, request in enumerate(requests):
        slot = request.slot
        if not _is_int(slot) or not 0 <= slot < num_slots:
            raise ValueError(f"slot must be in [0, {num_slots}), got {slot!r}")
        if slot in rows.slots[:row]:
            raise ValueError(f"slot {slot} is given twice")
        rows.slots[row] = slot
        _fill_row(rows, row, request, vocab, history)
    return _write_slots(state, rows)


def _fill_row(rows: _SlotRows, row: int, request: SlotRequest, vocab: int, history: int) -> None:
    """Validate one request and write its values into row ``row`` of ``rows``."""
    params, seed = request.params, request.seed
    if not _is_int(seed) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    ids = np.asarray(list(request.prompt_ids), dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    for i, (tok, val) in enumerate(params.logit_bias):
        if tok >= vocab:
            raise ValueError(f"logit_bias token id {tok} is outside the vocabulary [0, {vocab})")
        rows.bias_ids[row, i], rows.bias_vals[row, i] = tok, val
    d = _dry_row(history, params, ids, request.dry_breakers)
    rows.floats[row] = [params.temperature, params.top_p, params.min_p, params.repetition_penalty,
                        params.frequency_penalty, params.presence_penalty, d.multiplier, d.base]
    top_k = params.top_k if params.top_k < vocab else 0  # k >= V keeps everything
    rows.ints[row] = [top_k, d.allowed, d.window, d.max_exp, d.length, bool(request.logprobs)]
    rows.key[row] = seed_key_data(seed)
    rows.flags[row, 0] = _pack_flags(ids, rows.flags.shape[2])
    if params.dry:
        rows.flags[row, 1] = _pack_flags(np.asarray(request.dry_breakers, np.int64), rows.flags.shape[2])
    rows.history[row, 0], rows.history[row, 1] = d.history, d.match


def _pack_flags(ids: np.ndarray, words: int) -> np.ndarray:
    """uint32 [words]: bit j of word w set where token 32 * w + j is in ``ids`` (`unpack_mask`'s layout)."""
    flags = np.zeros(words * 32, np.bool_)
    flags[ids] = True
    return np.packbits(flags.reshape(words, 32), axis=1, bitorder="little").view("<u4").reshape(words)


def _dry_row(history: int, params: SamplingParams, ids: np.ndarray, breakers: np.ndarray | None) -> DryState:
    """One slot's DryState row (host arrays) for a request with this prompt; its breakers are left to the
    caller (``breaker`` None), which packs them."""
    tokens = np.zeros(history, np.int32)
    on = params.dry
    if on:
        if breakers is None:
            raise ValueError("DRY is on: the single-token sequence breakers must be given")
        if ids.size > history:
            raise ValueError(f"the prompt ({ids.size} tokens) is longer than the DRY history ({history})")
        tokens[:ids.size] = ids
    window = (history if params.dry_penalty_last_n < 0 else min(params.dry_penalty_last_n, history)) if on else 0
    match = dry.prompt_matches(ids.tolist(), window, history) if on else np.zeros(history, np.int32)
    return DryState(multiplier=np.float32(params.dry_multiplier), base=np.float32(params.dry_base),
                    allowed=np.int32(params.dry_allowed_length), window=np.int32(window),
                    max_exp=np.int32(dry.max_exponent(params.dry_base)), history=tokens, match=match,
                    length=np.int32(ids.size if on else 0), breaker=None)


def unpack_mask(bits: jax.Array, vocab_size: int) -> jax.Array:
    """uint32 [S, ceil(V/32)] -> bool [S, V]; bit j (LSB first) of word w is token 32 * w + j."""
    s, w = bits.shape
    if w != -(-vocab_size // 32):
        raise ValueError(f"allowed mask has {w} words per row, expected ceil({vocab_size} / 32)")
    shifts = jnp.arange(32, dtype=jnp.uint32)
    unpacked = (bits.astype(jnp.uint32)[:, :, None] >> shifts) & jnp.uint32(1)
    return unpacked.reshape(s, w * 32)[:, :vocab_size].astype(jnp.bool_)


def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """Host helper, the inverse of unpack_mask: bool [S, V] -> uint32 [S, ceil(V/32)]."""
    allowed = np.asarray(allowed, np.bool_)
    s, v = allowed.shape
    w = -(-v // 32)
    padded = np.zeros((s, w * 32), np.bool_)
    padded[:, :v] = allowed
    weights = np.left_shift(np.uint32(1), np.arange(32, dtype=np.uint32))
    return (padded.reshape(s, w, 32) * weights).sum(-1, dtype=np.uint32)


# ---------------------------------------------------------------------------------------------------
# Blocked helpers over a row viewed as [S, NB, B] (padded with -inf). XLA's CPU argmax and top_k over a
# 262k row are slow; reducing per block first is several times cheaper.


def _to_blocks(x: jax.Array, block: int) -> jax.Array:
    s, v = x.shape
    nb = -(-v // block)
    if nb * block != v:
        x = jnp.pad(x, ((0, 0), (0, nb * block - v)), constant_values=_NEG_INF)
    return x.reshape(s, nb, block)


def _block_argmax(lb: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Row max and the first index attaining it."""
    block_max = lb.max(-1)
    b = jnp.argmax(block_max, -1)
    blk = jnp.take_along_axis(lb, b[:, None, None], 1)[:, 0]
    return block_max.max(-1), (b * lb.shape[-1] + jnp.argmax(blk, -1)).astype(jnp.int32)


def _block_top_k(lb: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Same result as lax.top_k over the flat row (descending, lower index first on ties).

    The top k elements lie in the k blocks with the largest maxima (ties: lower block first), so a
    top-k of the block maxima, a gather of those blocks in index order and a top-k over k * B elements
    give the exact answer. The results pass through an optimization barrier: otherwise XLA folds later
    slices (e.g. vals[:, -1]) into the sort, which then is no longer rewritten to its fast TopK (a top-65
    several times slower on CPU, a flat top-k over V as slow as a full sort).
    """
    s, nb, b = lb.shape
    if k >= nb:
        vals, ids = lax.top_k(lb.reshape(s, nb * b), k)
        return lax.optimization_barrier((vals, ids.astype(jnp.int32)))
    _, blocks = lax.top_k(lb.max(-1), k)
    blocks = jnp.sort(blocks, -1)  # index order keeps lax.top_k's tie-breaking on the gathered row
    cand = jnp.take_along_axis(lb, blocks[:, :, None], 1).reshape(s, k * b)
    vals, j = lax.top_k(cand, k)
    ids = jnp.take_along_axis(blocks, j // b, 1) * b + j % b
    return lax.optimization_barrier((vals, ids.astype(jnp.int32)))


def _order_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order, so bisection can walk every representable float."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_order_key(k: jax.Array) -> jax.Array:
    bits = jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _bisect_threshold(x: jax.Array, w: jax.Array, target: jax.Array, lo: jax.Array, hi: jax.Array,
                      rows: jax.Array) -> jax.Array:
    """Largest float c with f(c) = sum(w[x >= c]) >= target, for the rows flagged in `rows`; exact.

    Needs f(lo) >= target and f(c) < target for every c > hi; if rounding breaks the first, the result
    is lo (keeps everything >= lo). Bisection over the float32 order keys between lo and hi, one pass
    over V per step: log2(number of floats in [lo, hi]) steps, at most 32 (~25 for logits in [1.5, 10]).
    (Halving by value and stopping once no token lies strictly inside would need a second reduction per
    pass, which XLA:CPU does not fuse: each pass would cost over twice as much, to save about one pass.)
    """
    def cond(carry: tuple[jax.Array, jax.Array]) -> jax.Array:
        lo_k, hi_k = carry
        return jnp.any(hi_k - lo_k > 1)

    def body(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo_k, hi_k = carry  # invariant: f(lo_k) >= target > f(hi_k)
        mid = lo_k + (hi_k - lo_k) // 2
        f = jnp.sum(jnp.where(x >= _from_order_key(mid)[:, None], w, 0.0), axis=-1)
        ok = f >= target
        return jnp.where(ok, mid, lo_k), jnp.where(ok, hi_k, mid)

    lo_k = _order_key(jnp.minimum(lo, hi))
    hi_k = jnp.where(rows, _order_key(hi) + jnp.uint32(1), lo_k + 1)  # rows not searched: already done
    lo_k, _ = lax.while_loop(cond, body, (lo_k, hi_k))
    return _from_order_key(lo_k)


def _first_above(cum: jax.Array, w: jax.Array, target: jax.Array) -> jax.Array:
    """First index with cum > target and w > 0; the last w > 0 index if rounding leaves none."""
    n = cum.shape[-1]
    hit = (cum > target[:, None]) & (w > 0)
    last_pos = n - 1 - jnp.argmax((w > 0)[:, ::-1], -1)
    return jnp.where(hit.any(-1), jnp.argmax(hit, -1), last_pos).astype(jnp.int32)


def _block_sums(lb: jax.Array, m: jax.Array, t: jax.Array, thr: jax.Array) -> jax.Array:
    """[S, NB] sums of exp((x - m) / t) over x >= thr: one exp pass over V."""
    e = jnp.exp((lb - m[:, None, None]) / t[:, None, None])
    return jnp.where(lb >= thr[:, None, None], e, 0.0).sum(-1)


def _draw_blocks(lb: jax.Array, block_sum: jax.Array, m: jax.Array, t: jax.Array, thr: jax.Array,
                 u: jax.Array) -> jax.Array:
    """Inverse CDF over the whole row: the block sums pick a block, a cumulative sum inside it the token."""
    block_cum = jnp.cumsum(block_sum, -1)
    target = u * block_cum[:, -1]
    b = _first_above(block_cum, block_sum, target)
    before = jnp.where(b > 0, jnp.take_along_axis(block_cum, jnp.maximum(b - 1, 0)[:, None], 1)[:, 0], 0.0)
    blk = jnp.take_along_axis(lb, b[:, None, None], 1)[:, 0]
    e = jnp.where(blk >= thr[:, None], jnp.exp((blk - m[:, None]) / t[:, None]), 0.0)
    return b * lb.shape[-1] + _first_above(jnp.cumsum(e, -1), e, target - before)


def _truncate(x: jax.Array, m: jax.Array, t: jax.Array, u: jax.Array, z_full: jax.Array,
              state: SamplerState, k_max: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k -> top-p -> min-p as one logit threshold per row (see the module docstring).

    The K = k_max + 1 largest logits are the candidates; `last` = the K-th, so every other token has
    x <= last, and a threshold > last keeps a set that lies wholly inside the candidates: then the
    token is drawn right here. Returns (threshold, drawn from the candidates?, that token).
    """
    s, v = x.shape
    kk = min(k_max + 1, v)
    every = kk == v  # static: the candidates are the whole vocabulary
    vals, ids = _block_top_k(_to_blocks(x, _TOPK_BLOCK), kk)  # [S, K] descending, vals[:, 0] == m
    last = jnp.full((s,), _NEG_INF) if every else vals[:, -1]
    cand_e = jnp.exp((vals - m[:, None]) / t[:, None])

    # top-k: the k-th largest logit (ties kept). Its mass z_k comes from the candidates unless the set
    # reaches past them (k > k_max, or ties with `last`): then a count bisection and a pass over V.
    k = state.top_k
    thr_k = jnp.where(k == 0, _NEG_INF, jnp.take_along_axis(vals, jnp.clip(k - 1, 0, kk - 1)[:, None], 1)[:, 0])
    z_k = jnp.where(k == 0, z_full, jnp.sum(jnp.where(vals >= thr_k[:, None], cand_e, 0.0), -1))
    k_inside = (k > 0) & (thr_k > last)
    if not every:
        need_k = (k > 0) & ~k_inside

        def k_wide() -> tuple[jax.Array, jax.Array]:
            finite = (x > _NEG_INF).astype(jnp.float32)
            row_min = jnp.min(jnp.where(x > _NEG_INF, x, jnp.inf), -1)
            thr = jnp.where(k > kk, _bisect_threshold(x, finite, k.astype(jnp.float32), row_min, m, k > kk), thr_k)
            z = jnp.sum(jnp.where(x >= thr[:, None], jnp.exp((x - m[:, None]) / t[:, None]), 0.0), -1)
            return jnp.where(need_k, thr, thr_k), jnp.where(need_k, z, z_k)

        thr_k, z_k = lax.cond(need_k.any(), k_wide, lambda: (thr_k, z_k))

    # top-p: the first candidate at which the cumulative mass of the top-k set reaches top_p * z_k.
    top_p = state.top_p
    p_on = top_p < 1
    hit = jnp.cumsum(jnp.where(vals >= thr_k[:, None], cand_e, 0.0), -1) >= (top_p * z_k)[:, None]
    found = hit.any(-1)
    thr_p = jnp.take_along_axis(vals, jnp.argmax(hit, -1)[:, None], 1)[:, 0]
    # Not found with the whole top-k set among the candidates can only be rounding: keep the top-k set.
    thr_p = jnp.where(p_on, jnp.where(found, thr_p, thr_k), _NEG_INF)
    if not every:
        need_p = p_on & ~found & ~k_inside

        def p_wide() -> jax.Array:
            w = jnp.where(x >= thr_k[:, None], jnp.exp((x - m[:, None]) / t[:, None]), 0.0)
            # Tokens with w < eps hold < V * eps = (1 - top_p) * z_k / 2 in all, so the cut is >= the
            # logit of w = eps: a tighter start than the row minimum, and no extra pass to find it.
            eps = 0.5 * (1.0 - top_p) * z_k / v
            lo = jnp.maximum(m + t * jnp.log(eps), thr_k)
            return jnp.where(need_p, _bisect_threshold(x, w, top_p * z_k, lo, last, need_p), thr_p)

        thr_p = lax.cond(need_p.any(), p_wide, lambda: thr_p)

    # min-p: p >= min_p * p_max  <=>  x >= m + t * log(min_p); log(0) = -inf turns it off.
    thr = jnp.maximum(jnp.maximum(thr_k, thr_p), m + t * jnp.log(state.min_p))

    p_cand = jnp.where(vals >= thr[:, None], cand_e, 0.0)
    j = _first_above(jnp.cumsum(p_cand, -1), p_cand, u * p_cand.sum(-1))
    return thr, thr > last, jnp.take_along_axis(ids, j[:, None], 1)[:, 0]


def _draw_full(lb: jax.Array, x: jax.Array, m: jax.Array, t: jax.Array, u: jax.Array, state: SamplerState,
               k_max: int) -> jax.Array:
    """Temperature -> top-k -> top-p -> min-p -> draw.

    Untruncated rows (thr = -inf) draw over the whole row from the untruncated block sums, exactly as
    needs_full=False does; rows whose kept set lies inside the candidates draw there; the rest (e.g. a
    small min_p) need a second pass for truncated block sums. Each stage beyond the first exp pass runs
    under a lax.cond, only when some row needs it.
    """
    s = x.shape[0]
    block_full = _block_sums(lb, m, t, jnp.full((s,), _NEG_INF))
    trunc = (state.temperature > 0) & ((state.top_k > 0) | (state.top_p < 1) | (state.min_p > 0))
    thr, in_cand, tok_cand = lax.cond(
        trunc.any(),
        lambda: _truncate(x, m, t, u, block_full.sum(-1), state, k_max),
        lambda: (jnp.full((s,), _NEG_INF), jnp.zeros((s,), jnp.bool_), jnp.zeros((s,), jnp.int32)),
    )
    need_pass = ~in_cand & (thr > _NEG_INF)
    block_sum = lax.cond(need_pass.any(),
                         lambda: jnp.where(need_pass[:, None], _block_sums(lb, m, t, thr), block_full),
                         lambda: block_full)
    return jnp.where(in_cand, tok_cand, _draw_blocks(lb, block_sum, m, t, thr, u))


def _dry_penalise(x: jax.Array, d: DryState, limit: jax.Array, rows_on: jax.Array) -> jax.Array:
    """Lower the logits x [S, V] of the rows in rows_on [S] bool by their DRY penalties (core/dry.py);
    limit [S] i32 is llama.cpp's rep_limit.

    Position j of the window whose run of `rep` tokens equals the history's last ones (rep capped by the
    breaker limit and by the window's start) makes the token at j + 1 cost multiplier * base ** (rep -
    allowed). Each such token takes its largest penalty: a scatter-min of the penalised logits (x - p is
    monotone in p), with no [S, V] pass besides the scatter.
    """
    s, h = d.history.shape
    v = x.shape[1]
    n = d.length
    span = jnp.minimum(n, d.window)  # llama.cpp's last_n_repeat
    start = n - span
    j = jnp.arange(h)[None, :]
    rep = jnp.minimum(jnp.minimum(d.match, limit[:, None]), j - start[:, None] + 1)
    following = jnp.concatenate([d.history[:, 1:], jnp.zeros((s, 1), jnp.int32)], axis=1)  # token at j + 1
    row_on = rows_on & (span > d.allowed) & (limit >= d.allowed)
    hit = (row_on[:, None] & (j >= start[:, None]) & (j <= n[:, None] - 2) & (rep >= d.allowed[:, None])
           & ~jnp.take_along_axis(d.breaker, following, 1))
    exponent = rep - d.allowed[:, None]
    exponent = jnp.where(d.max_exp[:, None] > 0, jnp.minimum(exponent, d.max_exp[:, None]), exponent)
    penalty = d.multiplier[:, None] * jnp.power(d.base[:, None], exponent.astype(jnp.float32))
    penalty = jnp.minimum(penalty, jnp.finfo(jnp.float32).max)  # a finite logit stays finite
    lowered = jnp.take_along_axis(x, following, 1) - penalty
    rows = jnp.arange(s)[:, None]
    return x.at[rows, jnp.where(hit, following, v)].min(lowered, mode="drop")


def _dry_append(d: DryState, tokens: jax.Array, take: jax.Array) -> DryState:
    """Append tokens [S] to the history of the rows in `take` [S] bool whose DRY is on; the match lengths
    follow: a run ending at j continues the new last token iff history[j] is that token and a run ended
    at j - 1."""
    s, h = d.history.shape
    n = d.length
    take = take & (n < h)
    j = jnp.arange(h)[None, :]
    before = jnp.concatenate([jnp.zeros((s, 1), jnp.int32), d.match[:, :-1]], axis=1)
    match = jnp.where((d.history == tokens[:, None]) & (j < n[:, None]), before + 1, 0)
    history = d.history.at[jnp.arange(s), jnp.where(take, n, h)].set(tokens, mode="drop")
    return d._replace(history=history, match=jnp.where(take[:, None], match, d.match),
                      length=jnp.where(take, n + 1, n))


def _process_logits(logits: jax.Array, state: SamplerState, allowed_mask: jax.Array | None,
                    penalties: bool, dry_limit: jax.Array, dry_rows: jax.Array) -> jax.Array:
    s, v = logits.shape
    x = logits.astype(jnp.float32)
    if penalties:
        rp = state.repetition_penalty[:, None]
        x = jnp.where(state.seen, jnp.where(x > 0, x / rp, x * rp), x)
        c = state.counts.astype(jnp.float32)
        x = x - state.frequency_penalty[:, None] * c - state.presence_penalty[:, None] * (c > 0)
        x = lax.cond(jnp.any(dry_rows), lambda: _dry_penalise(x, state.dry, dry_limit, dry_rows), lambda: x)
    rows = jnp.arange(s)[:, None]
    x = x.at[rows, state.bias_ids].add(state.bias_vals, mode="drop")  # padding ids == V are dropped
    if allowed_mask is not None:
        x = jnp.where(unpack_mask(allowed_mask, v), x, _NEG_INF)
    return x


def _logprobs(x: jax.Array, m: jax.Array, valid: jax.Array, tokens: jax.Array, reports: jax.Array,
              active: jax.Array, num_top: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's token logprob [S] and its num_top most likely tokens [S, num_top] with logprobs, from the
    processed logits x [S, V] and their max m [S]. Rows that do not report (reports [S] False) get logprob 0
    and no top tokens (ids -1, logprobs -inf), whatever the other rows do, and a step where no active row
    reports skips the normaliser's pass over V; a row whose mask allows nothing (valid False) gets -inf."""
    s = x.shape[0]
    reports = reports & valid

    def computed() -> tuple[jax.Array, jax.Array, jax.Array]:
        lse = m + jnp.log(jnp.sum(jnp.exp(x - m[:, None]), -1))
        token_lp = jnp.take_along_axis(x, jnp.maximum(tokens, 0)[:, None], 1)[:, 0] - lse
        if not num_top:
            return token_lp, jnp.zeros((s, 0), jnp.int32), jnp.zeros((s, 0), jnp.float32)
        top_vals, top_ids = _block_top_k(_to_blocks(x, _TOPK_BLOCK), num_top)
        return token_lp, top_ids, top_vals - lse[:, None]

    def skipped() -> tuple[jax.Array, jax.Array, jax.Array]:
        return jnp.zeros((s,), jnp.float32), jnp.zeros((s, num_top), jnp.int32), jnp.zeros((s, num_top), jnp.float32)

    token_lp, top_ids, top_lp = lax.cond(jnp.any(reports & active), computed, skipped)
    token_lp = jnp.where(reports, token_lp, jnp.where(valid, 0.0, _NEG_INF))
    return token_lp, jnp.where(reports[:, None], top_ids, -1), jnp.where(reports[:, None], top_lp, _NEG_INF)


def sample(logits: jax.Array, state: SamplerState, allowed_mask: jax.Array | None, step: jax.Array,
           active: jax.Array, dry_limit: jax.Array | None = None, *, num_top: int = 0, needs_full: bool = True,
           k_max: int = K_MAX) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, SamplerState]:
    """One token per row. Jit with static_argnames=("num_top", "needs_full", "k_max"); donate `state`.

    logits [S, V] f32; allowed_mask uint32 [S, ceil(V/32)] packed bits or None (a separate compile with
    no mask work: pass None when no active row is constrained, else all-ones words for free rows);
    step [S] i32 tokens generated so far (keys the per-row draw); active [S] bool (only active rows add
    their token to the counts and the DRY history); dry_limit [S] i32 how many trailing tokens a DRY run
    may span (`core.dry.RepeatLimit.limit`; None: no breaker limits them). needs_full=False compiles a
    cheaper variant that ignores penalties and top-k/top-p/min-p (bias, mask, temperature, greedy and
    logprobs still apply, with the same results as the full variant); use it only when `batch_needs_full`
    is False for the active requests.

    Returns tokens [S] i32 (-1 where the mask allows nothing), the token's logprob [S] f32, the num_top
    most likely tokens [S, num_top] i32 and their logprobs (descending, ties by lower id; all logprobs
    are log_softmax(processed logits), before temperature and truncation, so disallowed tokens that fill
    out a short list have logprob -inf; rows with no allowed token give ids -1; rows whose slot does not
    report logprobs give 0 and no top tokens, `_logprobs`), and the updated state.
    """
    s, v = logits.shape
    if not 0 <= num_top <= v:
        raise ValueError(f"num_top must be in [0, {v}], got {num_top}")
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    if dry_limit is None:
        dry_limit = jnp.full((s,), state.dry.history.shape[1], jnp.int32)
    dry_rows = active & (state.dry.window > 0)
    x = _process_logits(logits, state, allowed_mask, needs_full, dry_limit, dry_rows)
    tokens, m, valid = _choose(x, state, step, needs_full, k_max)
    token_lp, top_ids, top_lp = _logprobs(x, m, valid, tokens, state.logprobs, active, num_top)

    # Count the token for active rows only; index V (out of range) drops the update.
    idx = jnp.where(active & (tokens >= 0), tokens, v)
    rows = jnp.arange(s)
    dry_state = lax.cond(jnp.any(dry_rows), lambda: _dry_append(state.dry, tokens, dry_rows & (tokens >= 0)),
                         lambda: state.dry)
    new_state = state._replace(counts=state.counts.at[rows, idx].add(1, mode="drop"),
                               seen=state.seen.at[rows, idx].set(True, mode="drop"), dry=dry_state)
    return tokens, token_lp, top_ids, top_lp, new_state


def _choose(x: jax.Array, state: SamplerState, step: jax.Array, truncate: bool, k_max: int
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's token from its processed logits x [R, V] (`sample`'s draw; truncate: honour top-k, top-p
    and min-p). Returns the tokens [R] (-1 where no token is allowed), each row's max logit m [R] (0 on such
    a row) and whether the row allows any token, valid [R]."""
    s = x.shape[0]
    lb = _to_blocks(x, _BLOCK)
    m, greedy_tok = _block_argmax(lb)
    valid = m > _NEG_INF  # some token allowed
    m = jnp.where(valid, m, 0.0)  # keeps exp(x - m) NaN-free on an all -inf row

    sampling = (state.temperature > 0) & valid
    t = jnp.where(sampling, state.temperature, 1.0)
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(state.key, impl="threefry2x32"), step)
    u = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)

    def draw() -> jax.Array:
        if truncate:
            return _draw_full(lb, x, m, t, u, state, k_max)
        return _draw_blocks(lb, _block_sums(lb, m, t, jnp.full((s,), _NEG_INF)), m, t, jnp.full((s,), _NEG_INF), u)

    # An all-greedy batch skips the sampling passes; no row's result depends on which branch runs.
    drawn = lax.cond(sampling.any(), draw, lambda: jnp.zeros((s,), jnp.int32))
    tokens = jnp.where(valid, jnp.where(sampling, drawn, greedy_tok), -1).astype(jnp.int32)
    return tokens, m, valid


def draw_tokens(logits: jax.Array, state: SamplerState, step: jax.Array, *, k_max: int = K_MAX) -> jax.Array:
    """The tokens [R] `sample` gives rows logits [R, V] at steps [R] (each row its own parameters and seed in
    ``state``, rows R), for requests that are not penalised (`SamplingParams.penalised`), masked or
    reporting logprobs: then a row's token depends on its logits, parameters, seed and step alone, so a
    speculative verify pass may draw the token of every position it computes (step + i at position i) and
    get exactly the tokens plain decoding would. The state is read, not updated (such a request's counts
    are never read). Top-k, top-p and min-p always apply (the same tokens as `sample` without them where
    a request sets none)."""
    rows = jnp.zeros(logits.shape[:1], bool)  # no DRY row
    x = _process_logits(logits, state, None, False, jnp.zeros(logits.shape[:1], jnp.int32), rows)
    return _choose(x, state, step, True, k_max)[0]
