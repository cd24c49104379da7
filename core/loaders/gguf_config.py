"""The HF-style text config of a Gemma 3 GGUF, rebuilt from its metadata as transformers does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import CheckpointError

# Values transformers takes from Gemma3TextConfig's defaults, since a Gemma 3 GGUF does not state them
# (llama.cpp hard-codes the same ones: a global layer every 6th, local rope base 10k, gelu-tanh).
SLIDING_WINDOW_PATTERN = 6
LOCAL_ROPE_THETA = 10000.0
HIDDEN_ACTIVATION = "gelu_pytorch_tanh"
# llama.cpp scales queries by 1/sqrt(hidden/heads) for Gemma 3 27B (62 layers) and by 1/sqrt(head_dim)
# otherwise; transformers leaves query_pre_attn_scalar at its default 256, which equals head_dim for every
# size but 27B, so this agrees with transformers wherever transformers is right.
GEMMA3_27B_LAYERS = 62

REQUIRED_KEYS = (
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "context_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "attention.sliding_window",
)


def field(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    """One metadata value as a Python scalar, string or list, or `default` if absent."""
    return metadata.get(key, default)


def gemma3_text_config(metadata: dict[str, Any], path: Path, vocab_size: int, tied: bool) -> dict:
    """A transformers `Gemma3TextConfig`-style dict for the `gemma3` GGUF at `path`, from its metadata
    (`core.loaders.gguf_reader.read_gguf_header`).

    `vocab_size` comes from the embedding's shape and `tied` from whether `output.weight` exists, the
    same evidence transformers uses.
    """
    arch = "gemma3"
    missing = [f"{arch}.{k}" for k in REQUIRED_KEYS if f"{arch}.{k}" not in metadata]
    if missing:
        raise CheckpointError(f"{path}: GGUF metadata lacks {', '.join(missing)}")

    def key(name: str, default: Any = None) -> Any:
        return field(metadata, f"{arch}.{name}", default)

    layers = key("block_count")
    hidden = key("embedding_length")
    heads = key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    rope_theta = float(key("rope.freq_base", 1_000_000.0))
    local_theta = float(key("rope.freq_base_swa", LOCAL_ROPE_THETA))

    pattern = key("attention.sliding_window_pattern", SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # llama.cpp's per-layer form: true marks a sliding-window layer
        layer_types = ["sliding_attention" if swa else "full_attention" for swa in pattern]
        pattern = None
    else:
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]

    # Gemma 3 4B+ stretch global-layer positions linearly; transformers' GGUF path ignores these keys,
    # so only a file that has them (not the default 270M) can differ from transformers here.
    scaling_type = key("rope.scaling.type")
    rope_scaling = None
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor", 1.0))}

    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv"),
        "head_dim": head_dim,
        "hidden_activation": HIDDEN_ACTIVATION,
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "query_pre_attn_scalar": hidden // heads if layers == GEMMA3_27B_LAYERS else head_dim,
        "sliding_window": key("attention.sliding_window"),
        "sliding_window_pattern": pattern,
        "layer_types": layer_types,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
            "full_attention": {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})},
        },
        # The pre-transformers-5 spelling of the same rope settings, for readers of older configs.
        "rope_theta": rope_theta,
        "rope_local_base_freq": local_theta,
        "rope_scaling": rope_scaling,
        "final_logit_softcapping": key("final_logit_softcapping"),
        "attn_logit_softcapping": key("attn_logit_softcapping"),
        "attention_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": field(metadata, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(metadata, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": field(metadata, "tokenizer.ggml.padding_token_id"),
        "unk_token_id": field(metadata, "tokenizer.ggml.unknown_token_id"),
    }
