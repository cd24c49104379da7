"""What every checkpoint reader offers, and the names that are not part of the text model."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

# Path components that belong to vision/audio towers and their projectors: a text-only server skips them.
MULTIMODAL_COMPONENTS = frozenset(
    {
        "vision_tower",
        "vision_model",
        "audio_tower",
        "audio_model",
        "embed_vision",
        "embed_audio",
        "multi_modal_projector",
        "mm_input_projection",
        "mm_soft_emb_norm",
    }
)


def is_multimodal(name: str) -> bool:
    """Whether a (raw or canonical) tensor name belongs to a vision/audio part of the checkpoint."""
    return any(part in MULTIMODAL_COMPONENTS for part in name.split("."))


@runtime_checkable
class CheckpointSource(Protocol):
    """A checkpoint's text-model tensors under canonical HF names (no `model.` prefix), read one at a time."""

    path: Path
    config: dict

    def names(self) -> list[str]:
        """Canonical names of every text-model tensor in the checkpoint."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a tensor in HF layout (linear weights are [out, in])."""
        ...

    def file_of(self, name: str) -> Path:
        """The file that holds a tensor."""
        ...

    def read(self, name: str) -> np.ndarray:
        """One tensor in HF layout: float32, float16 or ml_dtypes.bfloat16."""
        ...
