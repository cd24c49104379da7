"""`Idempotency-Key`: a retried request returns the first one's answer instead of running (and committing) again.

The first request with a key claims it in the store (atomic, so it holds across servers sharing Redis); a
retry that arrives while it runs waits for its answer; a retry after it finished gets the stored answer at
once, until the key's time to live ends. A request that failed gives its claim up, so a retry runs anew.
The running claim is a lease renewed while the request runs: if its server dies, a retry runs anew once
the lease lapses.
Keys are scoped by agent and by the caller's key fingerprint: one tenant's keys never meet another's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

from agents.store import Store, StoreError
from server.errors import APIError

log = logging.getLogger("slotserve.server")

HEADER = "idempotency-key"
KEY_PATTERN = re.compile(r"^[\x21-\x7e]{1,255}$")  # printable ASCII, as Stripe's and the IETF draft's keys
TTL_S = 24 * 3600.0  # how long an answer is kept for retries
POLL_S = 0.1


class IdempotentRequest:
    def __init__(self, store: Store, scope: str, key: str, wait_s: float, lease_s: float,
                 ttl_s: float = TTL_S) -> None:
        if not KEY_PATTERN.fullmatch(key):
            raise APIError(400, "Idempotency-Key must be 1 to 255 printable ASCII characters",
                           param="Idempotency-Key", code="invalid_value")
        self.store, self.scope, self.key, self.wait_s, self.ttl_s = store, scope, key, wait_s, ttl_s
        self.lease_s = lease_s
        self._renewal: asyncio.Task | None = None

    async def start(self) -> dict[str, Any] | None:
        """None once this request holds the key (run it, then `finish` or `abandon`); else the first request's
        answer, after waiting up to ``wait_s`` for it to finish (409 if it is still running then)."""
        deadline = asyncio.get_running_loop().time() + self.wait_s
        while True:
            state, answer = await self.store.claim_request(self.scope, self.key, self.lease_s)
            if state == "claimed":
                self._renewal = asyncio.ensure_future(self._keep())
                return None
            if state == "done":
                return json.loads(answer)
            if asyncio.get_running_loop().time() > deadline:
                raise APIError(409, "a request with this Idempotency-Key is still running; retry later",
                               param="Idempotency-Key", code="idempotency_key_in_use")
            await asyncio.sleep(POLL_S)

    async def _keep(self) -> None:
        """Renew the running claim until the request finishes or gives up."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                if not await self.store.renew_request(self.scope, self.key, self.lease_s):
                    return
            except StoreError as e:  # the store is down: the claim lapses on its own, the request goes on
                log.warning("could not renew an Idempotency-Key claim: %s", e)

    def _stop_renewing(self) -> None:
        if self._renewal is not None:
            self._renewal.cancel()
            self._renewal = None

    async def finish(self, answer: dict[str, Any]) -> None:
        self._stop_renewing()
        await self.store.finish_request(self.scope, self.key, json.dumps(answer), self.ttl_s)

    async def abandon(self) -> None:
        self._stop_renewing()
        await self.store.abandon_request(self.scope, self.key)
