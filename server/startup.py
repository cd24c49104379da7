"""Start-up progress as a person wants to see it: on a terminal one live line per stage with a bar, in logs
one line per stage with its duration, and for `/ready` the stage and how far it has got.

The runtime builder reports ``progress(stage, done, total, detail)`` (`agents.runtime.Progress`): a stage
begins when its name first appears and ends when the next one begins (or `finish` is called).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

BAR_WIDTH = 24
REDRAW_S = 0.2  # a terminal's live line is redrawn at most this often


class StartupProgress:
    def __init__(self, stream: TextIO | None = None, live: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live  # a terminal: redraw one line per stage
        self.begin = time.perf_counter()
        self.stage: str | None = None
        self.stage_began = self.begin
        self.done = self.total = 0
        self.detail = ""
        self.durations: dict[str, float] = {}  # finished stages, in order
        self._drawn = 0.0
        self._lock = threading.Lock()

    def __call__(self, stage: str, done: int = 0, total: int = 0, detail: str = "") -> None:
        with self._lock:
            if stage != self.stage:
                self._end_stage()
                self.stage, self.stage_began = stage, time.perf_counter()
            self.done, self.total, self.detail = done, total, detail
            if self.live and time.perf_counter() - self._drawn >= REDRAW_S:
                self._draw()

    def finish(self) -> None:
        with self._lock:
            self._end_stage()
            self.stage = None

    def _end_stage(self) -> None:
        if self.stage is None:
            return
        seconds = time.perf_counter() - self.stage_began
        self.durations[self.stage] = round(self.durations.get(self.stage, 0.0) + seconds, 2)
        detail = f" ({self.detail})" if self.detail else ""
        clear = "\r\x1b[2K" if self.live else ""
        self.stream.write(f"{clear}slotserve: {self.stage}: {seconds:.1f} s{detail}\n")
        self.stream.flush()

    def _draw(self) -> None:
        self._drawn = time.perf_counter()
        filled = round(BAR_WIDTH * self.done / self.total) if self.total else 0
        bar = f" [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.done}/{self.total}" if self.total else ""
        elapsed = self._drawn - self.stage_began
        self.stream.write(f"\r\x1b[2Kslotserve: {self.stage}{bar} {elapsed:.0f} s {self.detail[:60]}")
        self.stream.flush()

    def report(self) -> dict[str, Any]:
        """Where start-up is, for /ready: the stage, its percentage (when it counts steps), time so far."""
        with self._lock:
            percent = round(100 * self.done / self.total, 1) if self.total else None
            return {"stage": self.stage, "stage_percent": percent, "elapsed_s": round(time.perf_counter() -
                                                                                      self.begin, 1),
                    "stages_s": dict(self.durations)}
