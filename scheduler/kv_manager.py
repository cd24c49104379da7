"""The KV-cache manager: owns the slot table, the host tier and the disk tier, and makes every reuse decision.

A slot's KV at position p is a pure function of tokens 0..p (core.kv_cache), so a request can start from
the longest prefix of its prompt that any slot of its cache scope holds (in place, or copied on the device),
or that the host tier holds (restored), however far that slot has moved on since. Placement, in order:

1. a free slot holding this session's conversation (affinity), else a free slot whose whole content is a
   prefix of the prompt (nothing is lost), else the least recently used free slot;
2. what the chosen slot holds beyond the shared prefix is saved to the host tier first (it may be another
   conversation's), unless the host already holds it;
3. the prefix comes from the best source: the slot itself, another slot (device copy), the host (restore),
   the disk (read, then restored like a host run; the host is preferred when it holds as much);
4. in-flight sharing: if another request of the scope is still prefilling a longer common prefix, the new
   one waits for it and copies it then (`resolve`), instead of computing it a second time.

Every change to what a slot holds goes through this class: cache operations as they are planned (the
executor runs them in the same order), and `extend` as the update step appends computed tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from scheduler.disk_tier import DiskTier
from scheduler.host_tier import HostTier
from scheduler.plan import CacheOp, CopyPrefix, RestoreFromHost, SaveToHost
from scheduler.sequence import SeqState, Sequence
from scheduler.slots import Slot, common_prefix


@dataclass(frozen=True)
class CacheConfig:
    prefix_caching: bool = True  # reuse a prompt's longest cached prefix (in a slot, another slot, the host)
    host_tier_bytes: int = 2 * 2**30  # host memory for evicted conversations and system-prompt prefixes
    min_snapshot_tokens: int = 16  # runs shorter than this are cheaper to recompute than to keep on the host
    min_wait_tokens: int = 32  # wait for an in-flight prefix only when it saves at least this many tokens


@dataclass
class ReuseStats:
    slot_reuses: int = 0  # prefixes served in place
    device_copies: int = 0
    host_restores: int = 0
    disk_restores: int = 0
    host_saves: int = 0
    in_flight_waits: int = 0  # requests that waited for another's prefill instead of computing it


class KVCacheManager:
    def __init__(self, num_slots: int, config: CacheConfig | None = None, disk: DiskTier | None = None) -> None:
        """``disk``: the disk tier below the host tier (None: none)."""
        self.config = config or CacheConfig()
        self.slots = [Slot(i) for i in range(num_slots)]
        self.host = HostTier(self.config.host_tier_bytes)
        self.disk = disk if self.config.prefix_caching else None
        self.stats = ReuseStats()

    # ---- placement -------------------------------------------------------------------------------
    def has_free_slot(self) -> bool:
        return any(not slot.busy for slot in self.slots)

    def place(self, seq: Sequence, ops: list[CacheOp]) -> None:
        """Give a waiting sequence a free slot and its cached prefix (or a wait for one); appends cache ops."""
        target = self._choose_slot(seq)
        self._keep_on_host(target, seq, ops)
        target.tokens = target.tokens[:self._shared(target, seq)]
        target.scope, target.affinity = seq.scope, seq.request.affinity
        target.group, target.label = seq.group, seq.request.label
        target.adapter = seq.adapter_name
        target.sequence = seq
        target.last_used = time.perf_counter()
        seq.slot = target.index
        seq.state = SeqState.PREFILLING
        donor = self._in_flight_donor(seq)
        if donor is not None:
            seq.awaiting, seq.awaited = donor
            self.stats.in_flight_waits += 1
            return
        self._load_prefix(target, seq, ops)

    def resolve(self, seq: Sequence, ops: list[CacheOp]) -> bool:
        """For a sequence waiting on an in-flight prefix: load its prefix once the donor has computed it (or
        stopped prefilling); False while it still waits."""
        donor = seq.awaiting
        if donor is not None and donor.state is SeqState.PREFILLING and donor.cursor < seq.awaited:
            return False
        seq.awaiting, seq.awaited = None, 0
        self._load_prefix(self.slots[seq.slot], seq, ops)
        return True

    def _choose_slot(self, seq: Sequence) -> Slot:
        free = [s for s in self.slots if not s.busy]
        affinity = seq.request.affinity
        if affinity is not None:
            for slot in free:
                if slot.affinity == affinity and slot.scope == seq.scope:
                    return slot
        if self.config.prefix_caching:
            lossless = [s for s in free if s.held and self._shared(s, seq) == s.held]
            if lossless:
                return max(lossless, key=lambda s: s.held)
        return min(free, key=lambda s: (s.held > 0, s.last_used))

    def _shared(self, slot: Slot, seq: Sequence) -> int:
        """Prompt positions this slot's KV can serve: the common prefix (same scope only), short of the last
        prompt token, whose logits must be computed."""
        if not self.config.prefix_caching or slot.scope != seq.scope:
            return 0
        return min(common_prefix(slot.tokens, seq.prompt), len(seq.prompt) - 1)

    def _keep_on_host(self, target: Slot, seq: Sequence, ops: list[CacheOp]) -> None:
        """Before the target's content past the shared prefix is overwritten, save what the host lacks of it
        (the host tree needs the run from where it diverges from what the host holds)."""
        if not self.config.prefix_caching:
            return
        on_host = self.host.match(target.scope, target.tokens)
        if target.held - max(self._shared(target, seq), on_host) >= self.config.min_snapshot_tokens:
            ops.append(SaveToHost(target.index, target.scope, tuple(target.tokens), on_host))
            self.stats.host_saves += 1

    def _load_prefix(self, target: Slot, seq: Sequence, ops: list[CacheOp]) -> None:
        """Bring the longest cached prefix of the prompt into the target slot: in place, copied, restored from
        the host, or read from disk."""
        own = self._shared(target, seq)
        donors = [s for s in self.slots if s is not target]
        donor = max(donors, key=lambda s: self._shared(s, seq), default=None)
        copied = self._shared(donor, seq) if donor is not None else 0
        restored = self._on_host(seq)
        n = max(own, copied, restored)
        on_disk = self._on_disk(seq)
        if on_disk > n:
            snapshot = self.disk.fetch(seq.scope, seq.prompt, own, on_disk)
            if snapshot is not None:  # else a file was damaged or went: the other sources still serve
                ops.append(RestoreFromHost(target.index, snapshot))
                self.stats.disk_restores += 1
                self._loaded(target, seq, on_disk)
                return
        if n == own:
            self.stats.slot_reuses += n > 0
        elif n == copied:
            ops.append(CopyPrefix(donor.index, target.index, n))
            self.stats.device_copies += 1
        else:
            ops.append(RestoreFromHost(target.index, self.host.fetch(seq.scope, seq.prompt, own, n)))
            self.stats.host_restores += 1
        self._loaded(target, seq, n)

    @staticmethod
    def _loaded(target: Slot, seq: Sequence, n: int) -> None:
        target.tokens = list(seq.prompt[:n])
        seq.cursor = seq.cached_tokens = n

    def _on_host(self, seq: Sequence) -> int:
        if not self.config.prefix_caching:
            return 0
        return min(self.host.match(seq.scope, seq.prompt), len(seq.prompt) - 1)

    def _on_disk(self, seq: Sequence) -> int:
        if self.disk is None:
            return 0
        return min(self.disk.match(seq.scope, seq.prompt), len(seq.prompt) - 1)

    def _in_flight_donor(self, seq: Sequence) -> tuple[Sequence, int] | None:
        """A sequence still prefilling a longer common prefix than any cache holds now, and that length. The
        caches (the host and disk lookups among them) are asked only when some sequence of the scope is still
        prefilling: most placements have none."""
        if not self.config.prefix_caching:
            return None
        ahead_of: list[tuple[Sequence, int]] = []
        for slot in self.slots:
            other = slot.sequence
            if other is None or other is seq or other.state is not SeqState.PREFILLING or other.awaiting is not None:
                continue
            if other.scope == seq.scope:
                ahead_of.append((other, min(common_prefix(other.prompt, seq.prompt), len(seq.prompt) - 1)))
        if not ahead_of:
            return None
        best = max(self._available(seq), self._shared(self.slots[seq.slot], seq))
        chosen = None
        for other, ahead in ahead_of:
            if ahead - best >= self.config.min_wait_tokens and (chosen is None or ahead > chosen[1]):
                chosen = (other, ahead)
        return chosen

    def _available(self, seq: Sequence) -> int:
        """The longest prefix a slot other than the sequence's own, or the host, could serve right now."""
        copied = max((self._shared(s, seq) for s in self.slots if s.index != seq.slot), default=0)
        return max(copied, self._on_host(seq), self._on_disk(seq))

    # ---- what slots hold ---------------------------------------------------------------------------
    def extend(self, slot: int, tokens: list[int] | tuple[int, ...]) -> None:
        """The update step: these tokens' KV was just written at the slot's next positions."""
        self.slots[slot].tokens.extend(tokens)

    def release(self, seq: Sequence) -> None:
        """The sequence is done with its slot; the slot keeps its KV for later reuse."""
        slot = self.slots[seq.slot]
        slot.sequence = None
        slot.last_used = time.perf_counter()

    def held(self, seq: Sequence) -> int:
        return self.slots[seq.slot].held
