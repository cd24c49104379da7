"""Checkpoint readers: HF safetensors directories and Gemma 3 GGUF files, as numpy, one tensor at a time."""

from .base import CheckpointSource, is_multimodal
from .check import check_tensors
from .errors import CheckpointError
from .gguf_source import GGUFSource
from .open import open_checkpoint
from .safetensors_source import SafetensorsSource

__all__ = [
    "CheckpointError",
    "CheckpointSource",
    "GGUFSource",
    "SafetensorsSource",
    "check_tensors",
    "is_multimodal",
    "open_checkpoint",
]
