"""Reading the text-model part of a Hugging Face `config.json`."""

from __future__ import annotations

from pathlib import Path

from core.json_file import load_json_object

from .errors import CheckpointError

# Keys a multimodal config (e.g. Gemma 4 E2B: model_type gemma4 with a gemma4_text `text_config`) may state
# only at the top level although they describe the text model.
TOP_LEVEL_TEXT_KEYS = (
    "tie_word_embeddings",
    "dtype",
    "torch_dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def read_text_config(config_file: Path) -> dict:
    """The text config: the nested `text_config` (plus top-level-only text keys) if there is one, else all."""
    try:
        config = load_json_object(config_file)
    except FileNotFoundError:
        raise CheckpointError(f"{config_file}: config.json is missing") from None
    except ValueError as exc:
        raise CheckpointError(f"{config_file}: {exc}") from exc
    text = config.get("text_config")
    if text is None:
        return config
    if not isinstance(text, dict):
        raise CheckpointError(f"{config_file}: `text_config` is {type(text).__name__}, expected an object")
    text = dict(text)
    for key in TOP_LEVEL_TEXT_KEYS:
        if key in config and key not in text:
            text[key] = config[key]
    if "model_type" not in text and isinstance(config.get("model_type"), str):
        # Older multimodal configs leave the text model_type implicit; the HF text class is "<family>_text".
        text["model_type"] = f"{config['model_type']}_text"
    return text
