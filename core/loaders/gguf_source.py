"""A llama.cpp GGUF file of a Gemma 3 text model, dequantized to float32 one tensor at a time."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from .errors import CheckpointError
from .gguf_config import field, gemma3_text_config
from .gguf_reader import GGUFTensor, read_gguf_header

SUPPORTED_ARCHITECTURES = ("gemma3",)

# Types gguf-py dequantizes in numpy (the same routine transformers calls); integer and exotic types
# are refused at open time rather than failing halfway through a load.
SUPPORTED_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)

GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

# Rows are dequantized in chunks of about this many elements, so a large embedding never needs
# several float32 temporaries of its full size at once (blocks never span rows, so this is exact).
CHUNK_ELEMENTS = 1 << 24


def canonical_name(gguf_name: str) -> str:
    """The HF text-model name for a GGUF tensor name; unknown names are returned unchanged."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = BLOCK_RE.fullmatch(gguf_name)
    if match and match.group(2) in BLOCK_NAMES:
        return f"layers.{match.group(1)}.{BLOCK_NAMES[match.group(2)]}.weight"
    return gguf_name


def stores_one_plus_w(gguf_name: str) -> bool:
    """Whether llama.cpp stored this tensor as 1 + w.

    Its Gemma converters add 1 to every RMSNorm weight; transformers' Gemma2TensorProcessor (used for
    gemma3) undoes it for every name containing "norm.weight", and so do we, with the same test.
    """
    return "norm.weight" in gguf_name


class GGUFSource:
    """Text-model tensors of a Gemma 3 GGUF file under canonical HF names, as float32."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            header = read_gguf_header(self.path, string_arrays=False)  # the tokenizer reads the vocabulary
        except Exception as exc:  # bad magic, truncation and bad values surface as assorted exception types
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({exc})") from exc
        arch = field(header.metadata, "general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{self.path}: GGUF architecture {arch!r} is not supported "
                f"(only {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        self._tensors: dict[str, GGUFTensor] = {}
        for tensor in header.tensors:
            if tensor.tensor_type not in SUPPORTED_TYPES:
                raise CheckpointError(
                    f"{self.path}: tensor {tensor.name!r} has unsupported GGUF type {tensor.tensor_type.name}"
                )
            name = canonical_name(tensor.name)
            if name in self._tensors:
                other = self._tensors[name].name
                raise CheckpointError(
                    f"{self.path}: tensors {other!r} and {tensor.name!r} both map to {name!r}"
                )
            self._tensors[name] = tensor
        if "embed_tokens.weight" not in self._tensors:
            raise CheckpointError(f"{self.path}: tensor 'token_embd.weight' is missing")
        self.config: dict = gemma3_text_config(
            header.metadata,
            self.path,
            vocab_size=self.shape("embed_tokens.weight")[0],
            tied="lm_head.weight" not in self._tensors,
        )

    def names(self) -> list[str]:
        """Canonical names of every tensor in the file."""
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        """HF-order shape: GGUF lists dimensions fastest-first (ne), so it is the reverse."""
        return tuple(int(d) for d in reversed(self._tensor(name).shape))

    def file_of(self, name: str) -> Path:
        """The .gguf file (every tensor lives in it)."""
        self._tensor(name)
        return self.path

    def read(self, name: str) -> np.ndarray:
        """One tensor dequantized to float32 exactly as transformers does (gguf-py, then w - 1 for norms)."""
        tensor = self._tensor(name)
        shape = self.shape(name)
        data = tensor.data
        # gguf-py hands blocks as (rows..., bytes_per_row) uint8, plain floats as (rows..., cols).
        rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
        cols = shape[-1] if shape else 1
        out = np.empty((rows.shape[0], cols), np.float32)
        step = max(1, CHUNK_ELEMENTS // max(cols, 1))
        minus_one = stores_one_plus_w(tensor.name)
        try:
            for start in range(0, rows.shape[0], step):
                chunk = dequantize(rows[start : start + step], tensor.tensor_type)
                if minus_one:
                    chunk = chunk - 1  # same expression, in the same (dequantized) dtype, as transformers
                out[start : start + step] = chunk
        except (ValueError, NotImplementedError) as exc:
            raise CheckpointError(f"{self.path}: cannot dequantize tensor {tensor.name!r} ({exc})") from exc
        return out.reshape(shape)

    def _tensor(self, name: str) -> GGUFTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this checkpoint") from None

    def __repr__(self) -> str:
        return f"GGUFSource({str(self.path)!r}, {len(self._tensors)} tensors)"
