"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` per chunk, then ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MEDIA_TYPE = "text/event-stream"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
