"""A session turn's lease on the store: one turn of a session runs at a time, here or on another server, and
a crashed server's hold lapses on its own."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agents.store.base import Store, StoreError

if TYPE_CHECKING:
    from scheduler.request import RequestHandle

log = logging.getLogger(__name__)

__all__ = ["LEASE_S", "TurnClaim"]

# A session's turn claim (and a request's Idempotency-Key claim) lapses this long after its last renewal, so a
# crashed server frees them; renewed every third of it while the turn runs.
LEASE_S = 30.0


@dataclass(eq=False)
class TurnClaim:
    """One turn's exclusive hold on its session (Store.begin_turn), renewed while the turn runs."""

    store: Store
    agent: str
    sid: str
    token: str
    lease_s: float = LEASE_S
    renewal: asyncio.Task | None = None
    handle: RequestHandle | None = None  # the turn's generation, once submitted

    async def keep(self) -> None:
        """Renew until released; a generation that finished a whole lease ago without a commit (its response
        was never read) lets the claim lapse rather than hold the session."""
        finished_for = 0.0
        while True:
            await asyncio.sleep(self.lease_s / 3)
            if self.handle is not None and self.handle.finished is not None:
                finished_for += self.lease_s / 3
                if finished_for >= self.lease_s:
                    return
            try:
                if not await self.store.renew_turn(self.agent, self.sid, self.token, self.lease_s):
                    log.warning("a turn's session claim lapsed", extra={"event": {"session": self.sid}})
                    return
            except StoreError as e:  # the store is down: the claim lapses on its own, the turn goes on
                log.warning("could not renew a session claim: %s", e)

    async def release(self) -> None:
        if self.renewal is not None:
            self.renewal.cancel()
        await self.store.end_turn(self.agent, self.sid, self.token)
