"""Which LoRA adapter each of the engine's adapter slots holds, paged by use (docs/lora.md).

The engine has a fixed number of adapter slots, compiled into every step; requests name adapters (read by
`agents/`, `core.lora.LoraAdapter`), any number of them. An admitted request holds its adapter's slot until it
finishes; an adapter no running request holds stays loaded until its slot is wanted for another (least
recently used first), so agents that take turns keep theirs. A request whose adapter finds every slot held
waits in the queue (`Planner` admits the next one that fits), never evicting a running request's adapter.
Adapters are told apart by their fingerprint (the bytes they were read from): an agent whose adapter file
changed gets a fresh load, and its KV never mixes with the old one's (`Sequence.scope`).
"""

from __future__ import annotations

from core.engine import NO_ADAPTER, Engine
from core.lora import LoraAdapter


class AdapterSlots:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        count = engine.config.adapter_slots
        self._held = engine.loaded_adapters  # fingerprint of the adapter in each slot (the engine's own list)
        self._users = [0] * count  # running requests per slot
        self._last_used = [0] * count  # a tick per acquire, for least-recently-used eviction
        self._tick = 0
        self.loads = 0  # adapters written into a slot (a reuse of a loaded one is not a load)
        self._names: dict[str, str] = {}  # fingerprint -> the adapter's directory name, for people

    @property
    def count(self) -> int:
        return len(self._held)

    @property
    def seen(self) -> bool:
        """Whether any request has run under an adapter (before that, no KV is an adapter's)."""
        return bool(self._names)

    def fits(self, adapter: LoraAdapter | None) -> bool:
        """Whether a request with ``adapter`` can be admitted now (None always can)."""
        return adapter is None or adapter.fingerprint in self._held or 0 in self._users

    def acquire(self, adapter: LoraAdapter | None) -> int:
        """The slot index a request with ``adapter`` runs under (NO_ADAPTER for None), loading it if needed;
        the caller checked `fits`. Pair with `release`."""
        if adapter is None:
            return NO_ADAPTER
        self._names[adapter.fingerprint] = adapter.path.name
        self._tick += 1
        if adapter.fingerprint in self._held:
            index = self._held.index(adapter.fingerprint)
        else:
            free = [i for i in range(self.count) if self._users[i] == 0]
            if not free:
                raise RuntimeError("no adapter slot is free (check fits() before acquire)")
            index = min(free, key=lambda i: (self._held[i] is not None, self._last_used[i]))
            self.engine.load_adapter(index, adapter)
            self.loads += 1
        self._users[index] += 1
        self._last_used[index] = self._tick
        return index

    def release(self, index: int) -> None:
        if index != NO_ADAPTER:
            self._users[index] -= 1

    def forget(self, fingerprint: str) -> None:
        """Drop an adapter no request will name again (its agent was removed) from any slot it idles in."""
        for index, held in enumerate(self._held):
            if held == fingerprint and self._users[index] == 0:
                self.engine.load_adapter(index, None)

    def host_bytes(self, by_scope: dict[object, int]) -> dict[str, int]:
        """Host-tier bytes per adapter name ("" for KV under no adapter), from `HostTier.bytes_by_scope`
        (`Sequence.scope` puts an adapter's fingerprint last in its scope)."""
        out: dict[str, int] = {}
        for scope, nbytes in by_scope.items():
            name = self._names.get(scope[-1], "") if isinstance(scope, tuple) and scope else ""
            out[name] = out.get(name, 0) + nbytes
        return out

    def snapshot(self) -> list[dict[str, object]]:
        """Per slot: the fingerprint it holds (None: empty) and how many running requests use it."""
        return [{"fingerprint": held, "users": users} for held, users in zip(self._held, self._users, strict=True)]
