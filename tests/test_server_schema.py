"""Property-based fuzzing of the whole HTTP API from its own OpenAPI schema (schemathesis): whatever a
client sends, the server never answers 5xx."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
from test_server_helpers import LiveServer, server_config, tiny_runtime

from server.app import create_app


def test_openapi_schema_fuzzing_finds_no_server_errors(tmp_path):
    app = create_app(server_config(limits__max_tokens=4), runtime=tiny_runtime())
    binary = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or "schemathesis"
    with LiveServer(app) as srv:
        schema = httpx.get(f"{srv.url}/openapi.json").json()
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/admin/agents",
                "/agents/{agent}/v1/chat/completions",
                "/agents/{agent}/v1/sessions/{session_id}"} <= set(schema["paths"])
        run = subprocess.run(
            [binary, "run", f"{srv.url}/openapi.json", "--checks", "not_a_server_error", "--max-examples", "60",
             "--phases", "examples,coverage,fuzzing", "--seed", "7", "--request-timeout", "120",
             "--continue-on-failure", "--report-dir", str(tmp_path), "--no-color",
             # An endless event stream by design (the dashboard's): each example would run to the request
             # timeout. tests/test_dashboard.py covers it.
             "--exclude-path", "/admin/slots/stream"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path)  # its caches go to tmp_path
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert "passed" in run.stdout
