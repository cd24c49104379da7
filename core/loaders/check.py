"""Checking a checkpoint's tensors against the shapes a model expects."""

from __future__ import annotations

from collections.abc import Mapping, Set

from .base import CheckpointSource, is_multimodal
from .errors import CheckpointError


def check_tensors(
    source: CheckpointSource,
    expected: Mapping[str, tuple[int, ...]],
    optional: Set[str] = frozenset(),
) -> None:
    """Raise one CheckpointError listing every missing, wrongly shaped or unexpected text-model tensor.

    Names in `optional` may be absent (e.g. an untied `lm_head.weight`); when present they are shape-checked
    if `expected` has them. Vision/audio tensors are never reported.
    """
    present = set(source.names())
    problems = []
    missing = [n for n in expected if n not in present and n not in optional]
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {', '.join(missing)}")
    for name, want in expected.items():
        if name in present:
            got = tuple(source.shape(name))
            if got != tuple(want):
                problems.append(
                    f"wrong shape for tensor {name!r} in {source.file_of(name)}: "
                    f"expected {tuple(want)}, got {got}"
                )
    unexpected = sorted(n for n in present - set(expected) - set(optional) if not is_multimodal(n))
    if unexpected:
        listed = ", ".join(f"{n!r} ({source.file_of(n).name})" for n in unexpected)
        problems.append(f"unexpected tensors ({len(unexpected)}): {listed}")
    if problems:
        details = "\n  ".join(problems)
        raise CheckpointError(f"checkpoint {source.path} does not match the model:\n  {details}")
