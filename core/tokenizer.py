"""Tokenizer for slotserve: built from a checkpoint's tokenizer.json or from a GGUF file's vocabulary.

A GGUF carries no tokenizer.json, only llama.cpp's ``tokenizer.ggml.*`` metadata. transformers turns
that into a `tokenizers` BPE (transformers/integrations/gguf/gguf_tokenizer_mapping.py), which costs
tens of seconds: the merges are derived from the vocabulary in slow Python and the GGUF reader is slow.
We rebuild the *same* `tokenizers` object (same vocab, merges in the same order, same normalizer,
pre-tokenizer, decoder and added tokens), so ids and decoded text match transformers exactly, and
cache its tokenizer.json on disk keyed by a hash of the tokenizer metadata.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from core.device import default_cache_dir
from core.file_memo import remembered

__all__ = ["IncrementalDetokenizer", "Tokenizer", "gguf_tokenizer_key", "tokenizer_cache_dir"]

# Bump when the GGUF -> tokenizer.json conversion changes, so stale cache entries are not reused.
_BUILD_VERSION = "1"
_CONFIG_FILE = "tokenizer_config.json"
_TOKENIZER_FILE = "tokenizer.json"
_SPIECE_SPACE = "\u2581"

# llama.cpp token types (gguf.TokenType): CONTROL marks special tokens, USER_DEFINED plain added tokens.
_CONTROL, _USER_DEFINED = 3, 4
# Architectures whose "llama" (sentencepiece) vocabulary transformers builds with `gemma_tokenizer`.
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})


def tokenizer_cache_dir() -> Path:
    """Where GGUF tokenizers are cached once converted: ``<slotserve cache>/tokenizers``."""
    return default_cache_dir() / "tokenizers"


# --------------------------------------------------------------------------------------------------
# GGUF tokenizer cache key (the metadata itself: core.loaders.gguf_reader)
# --------------------------------------------------------------------------------------------------


def gguf_tokenizer_key(path: str | Path, spans: dict[str, tuple[int, int]] | None = None) -> str:
    """The sha256 naming a GGUF's converted tokenizer in the cache: the build version and the raw bytes of
    ``general.architecture`` and every ``tokenizer.*`` entry, i.e. all the conversion reads. `spans` is
    the header's (`core.loaders.gguf_reader.read_gguf_header`), read here when not given."""
    if spans is None:
        from core.loaders.gguf_reader import read_gguf_header

        spans = read_gguf_header(path).spans
    digest = hashlib.sha256(f"slotserve-tokenizer-v{_BUILD_VERSION}".encode())
    with open(path, "rb") as f:
        for key, (start, end) in spans.items():
            if key.startswith("tokenizer.") or key == "general.architecture":
                f.seek(start)
                digest.update(f.read(end - start))
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# GGUF -> tokenizers, mirroring transformers' conversion
# --------------------------------------------------------------------------------------------------


def _generate_merges(vocab: dict[str, int], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    """Same result as transformers.tokenization_utils_base.generate_merges (no skip_tokens).

    Every split of a token into two vocabulary pieces is a merge; merges are ranked by the merged
    token's score (best first) then by piece lengths, ties kept in vocabulary order (stable sort).
    """
    reverse = scores is not None
    ranked = scores if scores is not None else vocab
    merges: list[tuple[float, int, int, str, str]] = []
    for merge, score in ranked.items():
        local = []
        for i in range(1, len(merge)):
            left = merge[:i]
            if left in vocab:
                right = merge[i:]
                if right in vocab:
                    local.append((vocab[left], vocab[right], left, right))
        if local:
            local.sort(key=lambda x: (x[0], x[1]))
            merges.extend((score, len(lt), len(rt), lt, rt) for _, _, lt, rt in local)
    merges.sort(key=lambda m: (m[0], m[1], m[2]), reverse=reverse)
    return [(m[3], m[4]) for m in merges]


def _gguf_vocab_and_merges(meta: dict[str, Any]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    arch = meta.get("general.architecture")
    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    if model == "llama" and arch in _GEMMA_ARCHS:
        # transformers' gemma_tokenizer: Gemma files store whitespace-only tokens with real spaces
        # ("  ") where the model looks them up as "▁▁", and Gemma's scores do not follow the merge
        # order while the file order does, so rank by position.
        tokens = [_SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores: dict[str, float] = {t: -i for i, t in enumerate(tokens)}
    elif model == "gemma4":
        scores = dict(zip(tokens, meta["tokenizer.ggml.scores"], strict=True))
    else:
        raise ValueError(
            f"unsupported GGUF tokenizer {model!r} for architecture {arch!r}; "
            "only Gemma sentencepiece vocabularies are converted"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = _generate_merges(vocab, scores)
    return vocab, merges  # type: ignore[return-value]


def _token_name(meta: dict[str, Any], key: str) -> str | None:
    idx = meta.get(f"tokenizer.ggml.{key}")
    return None if idx is None else meta["tokenizer.ggml.tokens"][idx]


def _build_from_gguf(meta: dict[str, Any]) -> tuple[_Backend, dict[str, Any]]:
    """The backend transformers' GemmaTokenizer ends up with, plus an HF-style tokenizer_config."""
    vocab, merges = _gguf_vocab_and_merges(meta)
    backend = _Backend(
        BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>", dropout=None, byte_fallback=True)
    )
    # GemmaTokenizer: spaces become "▁" (no dummy prefix); the Split on " " is a no-op after that
    # normalizer but is kept so the serialized tokenizer is identical to transformers'.
    backend.normalizer = normalizers.Replace(" ", _SPIECE_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )

    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []
    named = {
        k: _token_name(meta, f"{gguf_key}_token_id")
        for k, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))
    }
    config: dict[str, Any] = {f"{k}_token": v for k, v in named.items()}
    if meta.get("tokenizer.ggml.model") == "gemma4":
        add_bos = False  # transformers follows the reference tokenizer here: the template writes <bos>
    else:
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))
    config["add_bos_token"] = add_bos
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))

    # GemmaTokenizer's own specials (its default mask token included), then llama.cpp CONTROL tokens as
    # special and USER_DEFINED ones (newline/tab runs, HTML tags) as plain added tokens. All are matched
    # whole in the raw text, before the normalizer.
    special = [t for t in (named["pad"], named["eos"], named["bos"], named["unk"], "<mask>") if t]
    special += [t for t, ty in zip(tokens, types, strict=False) if ty == _CONTROL]
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(special)]
    )
    user = [t for t, ty in zip(tokens, types, strict=False) if ty == _USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    if config["add_bos_token"] or config["add_eos_token"]:
        _set_post_processor(backend, config)
    return backend, config


def _set_post_processor(backend: _Backend, config: dict[str, Any]) -> None:
    # Mirrors TokenizersBackend.update_post_processor. Our encode() never uses it (it adds BOS itself),
    # but keeping it makes the cached tokenizer.json behave like transformers' for other readers.
    bos, eos = config.get("bos_token"), config.get("eos_token")
    add_bos, add_eos = config["add_bos_token"] and bos, config["add_eos_token"] and eos
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    specials = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _write_files(directory: Path, backend: _Backend, config: dict[str, Any]) -> None:
    # Compact JSON: 14 MB instead of 33 MB pretty-printed for Gemma's 262k vocabulary.
    (directory / _TOKENIZER_FILE).write_text(backend.to_str(), encoding="utf-8")
    (directory / _CONFIG_FILE).write_text(json.dumps(config, indent=1, ensure_ascii=False), encoding="utf-8")


def _write_entry(entry: Path, backend: _Backend, config: dict[str, Any]) -> None:
    """Write tokenizer.json + tokenizer_config.json atomically (a concurrent loader sees all or nothing)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        _write_files(tmp, backend, config)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
        try:
            os.replace(tmp, entry)
        except OSError:
            if not (entry / _TOKENIZER_FILE).is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def _byte_fallback_value(token: str) -> int | None:
    """The byte a "<0xNN>" token stands for, by the same test tokenizers' ByteFallback decoder uses."""
    # Rust checks the *byte* length.
    if len(token.encode("utf-8", "surrogatepass")) != 6 or not token.startswith("<0x") or token[-1] != ">":
        return None
    digits = token[3:5]
    hexdigits = "0123456789abcdefABCDEF"
    # Rust's u8::from_str_radix also takes a leading '+'.
    if all(c in hexdigits for c in digits) or (digits[0] == "+" and digits[1] in hexdigits):
        return int(digits, 16)
    return None


def _named_token(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Text <-> token ids. ``encode`` never turns user text into control tokens."""

    def __init__(self, backend: _Backend, config: dict[str, Any], *, from_cache: bool = False) -> None:
        self._backend = backend
        # `encode_special_tokens` is a flag on the shared backend; the lock keeps a concurrent
        # encode_with_special from flipping it under a plain encode.
        self._backend.encode_special_tokens = True
        self._lock = threading.Lock()
        self.config = config
        self.from_cache = from_cache  # True when a GGUF build was served from the disk cache

        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)

        def tok_id(key: str, *fallbacks: str) -> int | None:
            name = _named_token(config, key)
            if name is not None and (i := backend.token_to_id(name)) is not None:
                return i
            # Without a config, conventional names count only as special tokens: in Gemma's
            # vocabulary "<s>" is the HTML strikethrough tag, not a BOS.
            ids = (backend.token_to_id(n) for n in fallbacks)
            return next((i for i in ids if i in self._special_ids), None)

        self._bos_id = tok_id("bos_token", "<bos>", "<s>")
        eos_id = tok_id("eos_token", "<eos>", "</s>")
        if eos_id is None:
            raise ValueError("tokenizer has no end-of-sequence token")
        self._eos_id = eos_id
        self._pad_id = tok_id("pad_token", "<pad>")
        self.add_bos_token = bool(config.get("add_bos_token", False))
        eot = backend.token_to_id("<end_of_turn>")
        self._stop_ids = frozenset({eos_id} | ({eot} if eot is not None else set()))

        # Per-id decode pieces for token_bytes / IncrementalDetokenizer, built once: the decoder's
        # Replace("▁", " ") applied, and byte-fallback tokens recognised.
        self._pieces: list[str | None] = [None] * self._vocab_size
        self._byte_of: list[int | None] = [None] * self._vocab_size
        for tok, i in backend.get_vocab(with_added_tokens=True).items():
            if 0 <= i < self._vocab_size:
                piece = tok.replace(_SPIECE_SPACE, " ")
                self._pieces[i] = piece
                self._byte_of[i] = _byte_fallback_value(piece)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, cache_dir: Path | None = None) -> Tokenizer:
        """Load from a directory holding tokenizer.json (+ optional tokenizer_config.json) or a .gguf file.

        A GGUF is converted once and cached as ``<cache_dir>/<sha256 of its tokenizer metadata>/``
        (cache_dir defaults to `tokenizer_cache_dir()`); later loads read that tokenizer.json.
        """
        path = Path(path).expanduser()
        if path.is_dir():
            return cls._from_dir(path)
        if path.suffix.lower() != ".gguf" and path.name == _TOKENIZER_FILE:
            return cls._from_dir(path.parent)
        return cls._from_gguf(path, Path(cache_dir) if cache_dir is not None else tokenizer_cache_dir())

    @classmethod
    def _from_dir(cls, directory: Path, *, from_cache: bool = False) -> Tokenizer:
        tok_file = directory / _TOKENIZER_FILE
        if not tok_file.is_file():
            raise FileNotFoundError(f"no {_TOKENIZER_FILE} in {directory}")
        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", _CONFIG_FILE):  # the config wins where both say
            if (directory / name).is_file():
                config.update(json.loads((directory / name).read_text(encoding="utf-8")))
        return cls(_Backend.from_file(str(tok_file)), config, from_cache=from_cache)

    @classmethod
    def _from_gguf(cls, path: Path, cache_dir: Path) -> Tokenizer:
        from core.loaders.gguf_reader import read_gguf_header  # imported here: the loaders are heavy to import

        # The key is remembered per unchanged file (core.file_memo): a restart need not parse the header.
        key = remembered(path, "tokenizer-key", lambda: gguf_tokenizer_key(path), cache_dir)
        entry = cache_dir / key
        if entry.exists():
            if (entry / _TOKENIZER_FILE).is_file() and (entry / _CONFIG_FILE).is_file():
                with contextlib.suppress(Exception):  # a corrupt entry is rebuilt, not fatal
                    return cls._from_dir(entry, from_cache=True)
            shutil.rmtree(entry, ignore_errors=True)
        backend, config = _build_from_gguf(read_gguf_header(path).metadata)
        with contextlib.suppress(OSError):  # a read-only cache only costs speed
            _write_entry(entry, backend, config)
        return cls(backend, config)

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json to ``directory`` (loadable by from_pretrained)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        _write_files(directory, self._backend, self.config)

    # ---- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = False, *, parse_special: bool = False) -> list[int]:
        """Token ids for ``text``. Control-token strings like "<end_of_turn>" stay plain text unless
        ``parse_special`` (for trusted templates only); ``add_bos`` prepends the BOS id."""
        with self._lock:
            self._backend.encode_special_tokens = not parse_special
            try:
                ids = self._backend.encode(text, add_special_tokens=False).ids
            finally:
                self._backend.encode_special_tokens = True
        if add_bos:
            if self._bos_id is None:
                raise ValueError("tokenizer has no BOS token")
            ids.insert(0, self._bos_id)
        return ids

    def encode_with_special(self, text: str, add_bos: bool = False) -> list[int]:
        """Like `encode`, but control-token strings become their ids. Never use on user text."""
        return self.encode(text, add_bos, parse_special=True)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text for ``ids``, as transformers' decode gives it."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special)

    # ---- vocabulary ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end a generation: EOS, and <end_of_turn> where the vocabulary has it."""
        return self._stop_ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of special (control) tokens: what ``decode(skip_special=True)`` drops."""
        return self._special_ids

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry (spelled as stored, e.g. "▁the"), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry for ``token_id``; IndexError if there is none."""
        token = self._backend.id_to_token(token_id) if token_id >= 0 else None
        if token is None:
            raise IndexError(f"token id {token_id} out of range")
        return token

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes this token adds to the output.

        "▁" counts as a space, a "<0xNN>" byte-fallback token as the byte NN, control tokens as b"".
        """
        if token_id in self._special_ids:
            return b""
        byte = self._byte_of[token_id] if 0 <= token_id < self._vocab_size else None
        if byte is not None:
            return bytes((byte,))
        piece = self._pieces[token_id] if 0 <= token_id < self._vocab_size else None
        if piece is None:
            raise IndexError(f"token id {token_id} out of range")
        return piece.encode("utf-8", "surrogateescape")

    def detokenizer(self, skip_special: bool = False) -> IncrementalDetokenizer:
        """A fresh `IncrementalDetokenizer` for one output stream."""
        return IncrementalDetokenizer(self, skip_special=skip_special)


class IncrementalDetokenizer:
    """Streams text from token ids: ``"".join(push(i) for i in ids) + flush() == decode(ids)``.

    tokenizers' ByteFallback decodes each *run* of consecutive "<0xNN>" tokens as one unit: a valid
    UTF-8 run becomes its text, an invalid one becomes one U+FFFD per byte (even bytes that were fine
    on their own). So a run is held until a non-byte token ends it, unless it is already invalid, in
    which case every byte of it is U+FFFD whatever follows and goes out at once. Work is O(1) per token.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip = tokenizer.special_ids if skip_special else frozenset()
        self._run = bytearray()  # pending byte-fallback bytes, all valid UTF-8 so far
        self._need = 0  # continuation bytes the last character in the run still expects
        self._lo, self._hi = 0x80, 0xBF  # allowed range for the next continuation byte
        self._broken = False  # the current run is invalid: the rest of it is U+FFFD per byte

    def push(self, token_id: int) -> str:
        """Feed one id; returns the text it completes (possibly "")."""
        tok = self._tok
        if token_id in self._skip:
            return ""  # decode drops these before ByteFallback, so they do not end a byte run
        piece = tok._pieces[token_id] if 0 <= token_id < tok.vocab_size else None
        if piece is None:
            return ""  # decode drops unknown ids the same way
        byte = tok._byte_of[token_id]
        if byte is not None:
            return self._push_byte(byte)
        return self._end_run() + piece

    def flush(self) -> str:
        """Text still held (an unfinished byte run) at the end of the stream; resets the state."""
        return self._end_run()

    def _push_byte(self, b: int) -> str:
        if self._broken:
            return "\ufffd"
        if self._accept(b):
            self._run.append(b)
            return ""
        self._broken = True
        out = "\ufffd" * (len(self._run) + 1)
        self._run.clear()
        return out

    def _accept(self, b: int) -> bool:
        """One step of a strict UTF-8 validator (as Rust's from_utf8: no overlongs, no surrogates)."""
        if self._need:
            if not self._lo <= b <= self._hi:
                return False
            self._need -= 1
            self._lo, self._hi = 0x80, 0xBF
            return True
        if b < 0x80:
            return True
        if 0xC2 <= b <= 0xDF:
            self._need = 1
        elif 0xE0 <= b <= 0xEF:
            self._need = 2
            self._lo, self._hi = (0xA0, 0xBF) if b == 0xE0 else (0x80, 0x9F) if b == 0xED else (0x80, 0xBF)
        elif 0xF0 <= b <= 0xF4:
            self._need = 3
            self._lo, self._hi = (0x90, 0xBF) if b == 0xF0 else (0x80, 0x8F) if b == 0xF4 else (0x80, 0xBF)
        else:
            return False
        return True

    def _end_run(self) -> str:
        # A truncated last character makes the whole run fail from_utf8.
        out = "\ufffd" * len(self._run) if self._need else self._run.decode("utf-8")
        self._run.clear()
        self._need, self._lo, self._hi, self._broken = 0, 0x80, 0xBF, False
        return out
