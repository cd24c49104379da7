"""Saving a benchmark's JSON report: every script writes one document under benchmarks/results/ and prints it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save_report(path: str | Path, report: dict[str, Any], echo: bool = True) -> Path:
    """Write `report` as indented JSON to `path` (folders made as needed); print it too unless echo=False."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2)
    path.write_text(text + "\n", encoding="utf-8")
    if echo:
        print(text)
    return path
