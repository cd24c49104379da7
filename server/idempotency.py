"""`Idempotency-Key`: a retried request returns the first one's answer instead of running (and committing) again.

The first request with a key claims it in the store (atomic, so it holds across servers sharing Redis); a
retry that arrives while it runs waits for its answer; a retry after it finished gets the stored answer at
once, until the key's time to live ends. A request that failed gives its claim up, so a retry runs anew.
Keys are scoped by agent and by the caller's key fingerprint: one tenant's keys never meet another's.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from agents.store import Store
from server.errors import APIError

HEADER = "idempotency-key"
KEY_PATTERN = re.compile(r"^[\x21-\x7e]{1,255}$")  # printable ASCII, as Stripe's and the IETF draft's keys
TTL_S = 24 * 3600.0  # how long an answer is kept for retries
RUNNING_TTL_S = 600.0  # how long a claim lasts if its request never finishes nor gives up (a crash, a dropped stream)
POLL_S = 0.1


class IdempotentRequest:
    def __init__(self, store: Store, scope: str, key: str, wait_s: float, ttl_s: float = TTL_S) -> None:
        if not KEY_PATTERN.fullmatch(key):
            raise APIError(400, "Idempotency-Key must be 1 to 255 printable ASCII characters",
                           param="Idempotency-Key", code="invalid_value")
        self.store, self.scope, self.key, self.wait_s, self.ttl_s = store, scope, key, wait_s, ttl_s

    async def start(self) -> dict[str, Any] | None:
        """None once this request holds the key (run it, then `finish` or `abandon`); else the first request's
        answer, after waiting up to ``wait_s`` for it to finish (409 if it is still running then)."""
        deadline = asyncio.get_running_loop().time() + self.wait_s
        while True:
            state, answer = await self.store.claim_request(self.scope, self.key, RUNNING_TTL_S)
            if state == "claimed":
                return None
            if state == "done":
                return json.loads(answer)
            if asyncio.get_running_loop().time() > deadline:
                raise APIError(409, "a request with this Idempotency-Key is still running; retry later",
                               param="Idempotency-Key", code="idempotency_key_in_use")
            await asyncio.sleep(POLL_S)

    async def finish(self, answer: dict[str, Any]) -> None:
        await self.store.finish_request(self.scope, self.key, json.dumps(answer), self.ttl_s)

    async def abandon(self) -> None:
        await self.store.abandon_request(self.scope, self.key)
