"""Tiny random Gemma 3 / Gemma 4 checkpoints written by transformers' own save_pretrained.

They carry the real structures in miniature (Gemma 4: KV-shared layers of both types, two head
sizes, per-layer embeddings, double-wide MLP) with a window of 8 so short prompts cross it.
"""

from __future__ import annotations

from pathlib import Path

WINDOW = 8


GEMMA3 = {
    "model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "query_pre_attn_scalar": 16, "sliding_window": WINDOW, "max_position_embeddings": 4096,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                    "sliding_attention", "sliding_attention", "full_attention"],
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}},
}
GEMMA4 = {
    "model_type": "gemma4_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
    "global_head_dim": 32, "sliding_window": WINDOW, "num_kv_shared_layers": 3, "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 512, "final_logit_softcapping": 30.0,
    "max_position_embeddings": 4096,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                    "full_attention", "sliding_attention", "full_attention"],
}
CONFIGS = {"gemma3": GEMMA3, "gemma4": GEMMA4}


def model_config(family: str):
    """Our parsed config for a tiny family config (no transformers needed)."""
    from core.config import ModelConfig

    return ModelConfig.from_hf_dict(CONFIGS[family])


def hf_config(family: str):
    from transformers import Gemma3TextConfig, Gemma4TextConfig

    fields = {k: v for k, v in CONFIGS[family].items() if k != "model_type"}
    return Gemma3TextConfig(**fields) if family == "gemma3" else Gemma4TextConfig(**fields)


def build(family: str, seed: int = 0):
    """A transformers CausalLM with random weights, norms and layer scalars included."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma4ForCausalLM

    torch.manual_seed(seed)
    model_class = Gemma3ForCausalLM if family == "gemma3" else Gemma4ForCausalLM
    model = model_class(hf_config(family))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn_like(param) * 0.1 + (0.0 if family == "gemma3" else 1.0))
            else:
                param.copy_(torch.randn_like(param) * 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("layer_scalar"):
                buf.copy_(torch.rand_like(buf) + 0.5)
    return model.float().eval()


def save(family: str, directory: Path, seed: int = 0):
    model = build(family, seed)
    model.save_pretrained(directory, safe_serialization=True)
    return model
