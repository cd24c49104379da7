"""A real headless Chromium driven over the DevTools protocol (no test dependency: the protocol runs over two
pipes, ``--remote-debugging-pipe``, fd 3 for commands and fd 4 for replies, each message JSON ended by NUL).

    with Chromium(tmp_path) as browser:
        tab = browser.open("http://127.0.0.1:8000/dashboard")
        browser.evaluate(tab, "document.title")
        browser.screenshot(tab, tmp_path / "page.png")

Chromium is the Debian package `chromium` (``make test`` installs it when missing).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

FIRST_REPLY_S = 60.0  # a cold start on a busy 2-core machine takes seconds; a hung one gets a second start


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.fail("chromium not found: install the Debian package `chromium` (make test installs it)")


class Chromium:
    def __init__(self, workdir: Path, width: int = 1280, height: int = 900) -> None:
        self.width, self.height = width, height
        self.log_path = workdir / "chromium.log"
        self._profile = workdir / "chromium-profile"
        self._launch()
        try:
            self.send("Browser.getVersion", timeout=FIRST_REPLY_S)
        except (TimeoutError, RuntimeError):
            # a browser that never answers its first command (seen once on a loaded CI machine) gets one
            # fresh start; its log is kept beside the new one
            self._stop(wait_s=0)
            self.log_path.rename(self.log_path.with_suffix(".first.log"))
            self._profile = workdir / "chromium-profile-2"
            self._launch()
            try:
                self.send("Browser.getVersion", timeout=FIRST_REPLY_S)
            except BaseException:
                self._stop(wait_s=0)
                raise

    def _launch(self) -> None:
        to_child, self._to = os.pipe()
        self._from, from_child = os.pipe()
        # above fd 10, so that placing them at 3 and 4 in the child cannot overwrite one with the other
        child_in = fcntl.fcntl(to_child, fcntl.F_DUPFD_CLOEXEC, 10)
        child_out = fcntl.fcntl(from_child, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(to_child)
        os.close(from_child)
        # bash (dash takes one-digit fds only) puts them at 3 and 4 and execs Chromium: no preexec_fn, so this
        # process (JAX threads) is never forked
        place = f'exec "$0" "$@" 3<&{child_in} 4>&{child_out} {child_in}<&- {child_out}>&-'
        flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--no-default-browser-check", "--disable-extensions", "--mute-audio", "--remote-debugging-pipe",
                 f"--user-data-dir={self._profile}", f"--window-size={self.width},{self.height}", "about:blank"]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [shutil.which("bash") or "/bin/bash", "-c", place, chromium_binary(), *flags],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, pass_fds=(child_in, child_out),
                env={**os.environ, "DBUS_SESSION_BUS_ADDRESS": "disabled:"})  # no bus: never wait on one
        os.close(child_in)
        os.close(child_out)
        self._buffer = b""
        self._next_id = 0

    # ---- the protocol ------------------------------------------------------------------------------
    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply from chromium in time; its log ends:\n{self._log_tail()}")
            ready, _, _ = select.select([self._from], [], [], left)
            if ready:
                chunk = os.read(self._from, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium exited ({self.proc.poll()}); its log ends:\n{self._log_tail()}")
                self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    # ---- pages ---------------------------------------------------------------------------------------
    def open(self, url: str) -> str:
        """A new tab showing ``url``; returns its session id (what the other calls take)."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Emulation.setDeviceMetricsOverride", {"width": self.width, "height": self.height,
                                                         "deviceScaleFactor": 1, "mobile": False}, session)
        self.send("Page.navigate", {"url": url}, session)
        return session

    def evaluate(self, session: str, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, session: str, expression: str, timeout: float = 30.0, interval: float = 0.1) -> Any:
        """Evaluate until the value is truthy (an exception counts as false: the page may still be loading)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value, error = self.evaluate(session, expression), None
            except RuntimeError as e:
                value, error = None, e
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"not true in {timeout} s: {expression} ({error or value!r})")
            time.sleep(interval)

    def screenshot(self, session: str, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def _log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):
            self.send("Browser.close", timeout=5)
        self._stop()

    def _stop(self, wait_s: float = 10) -> None:
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to)
        os.close(self._from)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
