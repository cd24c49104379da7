"""Start-up progress: one log line per stage with its duration, a live bar on a terminal, and a report for
/ready (stage, percentage, durations so far)."""

from __future__ import annotations

import io

from server.startup import StartupProgress


def test_each_stage_is_logged_once_with_its_duration_and_reported():
    out = io.StringIO()
    progress = StartupProgress(out, live=False)
    for i in range(1, 237):
        progress("load the model", i, 236, "default")  # one call per tensor, one line in the log
    assert progress.report()["stage"] == "load the model" and progress.report()["stage_percent"] == 100.0
    progress("compile the step programs", 3, 12, "decode")
    assert progress.report()["stage_percent"] == 25.0
    progress.finish()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("slotserve: load the model: ") and "(default)" in lines[0]
    assert lines[1].startswith("slotserve: compile the step programs: ")
    report = progress.report()
    assert report["stage"] is None and list(report["stages_s"]) == ["load the model", "compile the step programs"]


def test_a_terminal_gets_a_live_bar_redrawn_in_place():
    out = io.StringIO()
    progress = StartupProgress(out, live=True)
    progress("compile the step programs", 6, 12, "prefill 128")
    assert "\r" in out.getvalue() and "[" + "#" * 12 + "." * 12 + "] 6/12" in out.getvalue()
    progress.finish()
    assert out.getvalue().endswith("\n") and "compile the step programs: " in out.getvalue().splitlines()[-1]
