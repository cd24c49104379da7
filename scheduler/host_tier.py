"""Host-memory tier of the prefix cache: a radix tree of KV runs per cache scope.

Every owning layer keeps a position's KV at its absolute index, and the KV at position p depends only on
tokens 0..p, so the KV of a stored conversation serves any prefix of it: a later prompt that shares its
first n tokens with a stored one can restore positions [0, n) from the host, whatever came after n. The
tree makes that cheap and shares what conversations have in common: each edge carries a run of tokens and
the KV of exactly those positions, so an agent's system prompt is stored once under every session that
follows it, and a lookup walks the prompt edge by edge (one comparison per branch point).

Memory is bounded by a byte budget; least-recently-used leaves go first (a node with children holds KV that
its descendants need). "Used" means stored or fetched; `match` is a pure query, so probing keeps nothing
alive. Cache scopes (opaque; agents/ makes one per agent and client cache salt) have separate trees: a
prompt never matches KV stored under another scope.

A stored run need not be on the host yet: a snapshot whose copy off the device is still under way
(`Engine.save_slot` with wait=False) is kept as such, its bytes known from its shape, so that admission does
not wait for the copies of the conversations it moves out of slots (~5 ms each off a TPU v5e). A helper
thread makes their arrays in the order stored; a reader that needs one first makes it itself. At most
`COPIES_IN_FLIGHT` runs wait for a copy (each holds a device buffer); past that a store makes its arrays on
the caller's thread.

All methods take one lock: the engine thread stores and fetches, the metrics endpoint reads `stats()`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Hashable, Sequence

import numpy as np

from core.engine import SlotSnapshot

Key = tuple[int, ...]
Arrays = dict[str, dict[str, np.ndarray]]  # layer key -> array name -> [positions, ...]
COPIES_IN_FLIGHT = 8  # one admission wave's saves on 8 slots


def as_key(tokens: Sequence[int] | np.ndarray) -> Key:
    """A token sequence (tuple, list, 1-D integer array) as a tuple of ints."""
    if type(tokens) is tuple:
        return tokens
    if isinstance(tokens, np.ndarray):
        return tuple(tokens.tolist())
    return tuple(tokens)


def common_run(key: Key, start: int, label: Key) -> int:
    """Length of the common prefix of key[start:] and label. Gallops over equal runs with tuple-slice
    comparisons (C loops), so a divergence thousands of tokens in costs O(log n) Python steps."""
    limit = min(len(key) - start, len(label))
    i, step = 0, 64
    while i < limit:
        n = min(step, limit - i)
        if key[start + i:start + i + n] == label[i:i + n]:
            i += n
            step *= 2
        elif n > 8:
            step = n // 2
        else:
            while key[start + i] == label[i]:  # the mismatch lies within these n tokens
                i += 1
            break
    return i


def _slice(arrays: Arrays, lo: int, hi: int) -> Arrays:
    """Positions [lo, hi) of every array, copied (a view would keep the whole parent run alive)."""
    return {key: {name: np.ascontiguousarray(a[lo:hi]) for name, a in entry.items()} for key, entry in arrays.items()}


def _nbytes(arrays: Arrays) -> int:
    return sum(a.nbytes for entry in arrays.values() for a in entry.values())


class _Run:
    """The KV of a run of positions: host arrays, or positions [lo, hi) of a snapshot (relative to its start)
    whose arrays may not be made yet. Made once, by whichever thread asks first; a dropped run (evicted, or
    split into two new ones) is not made by the helper thread."""

    __slots__ = ("_arrays", "_source", "_lo", "_hi", "nbytes", "dropped", "_lock")

    def __init__(self, arrays: Arrays | None = None, source: SlotSnapshot | None = None, lo: int = 0,
                 hi: int = 0) -> None:
        self._arrays, self._source, self._lo, self._hi = arrays, source, lo, hi
        self.nbytes = _nbytes(arrays) if arrays is not None else (hi - lo) * source.position_bytes
        self.dropped = False
        self._lock = threading.Lock()

    @classmethod
    def of(cls, snapshot: SlotSnapshot, lo: int, hi: int) -> _Run:
        """Positions [lo, hi) of ``snapshot`` (relative to its start): copied now if its arrays are made."""
        if snapshot.ready:
            return cls(_slice(snapshot.layers, lo, hi))
        return cls(source=snapshot, lo=lo, hi=hi)

    @property
    def ready(self) -> bool:
        return self._arrays is not None

    @property
    def arrays(self) -> Arrays:
        """[positions, ...] per array (waits for the copy off the device if it has not landed)."""
        if self._arrays is None:
            with self._lock:
                if self._arrays is None:
                    self._arrays = _slice(self._source.layers, self._lo, self._hi)
                    self._source = None  # the rest of the snapshot (and its device buffer) can go
        return self._arrays

    def part(self, lo: int, hi: int) -> _Run:
        """Positions [lo, hi) of this run, without making it (nor waiting for a thread that is making it)."""
        source = self._source  # read before the arrays: `arrays` sets them before it lets the source go
        if self._arrays is not None:
            return _Run(_slice(self._arrays, lo, hi))
        return _Run(source=source, lo=self._lo + lo, hi=self._lo + hi)


class _Node:
    __slots__ = ("label", "kv", "children", "parent", "last_used", "nbytes")

    def __init__(self, label: Key, kv: _Run, parent: _Node | None) -> None:
        self.label = label  # the tokens of this edge; () only for a scope's root
        self.kv = kv  # their KV: [len(label), ...] per array
        self.children: dict[int, _Node] = {}  # keyed by the first token of the child's label
        self.parent = parent
        self.last_used = 0
        self.nbytes = kv.nbytes


class HostTier:
    """Byte-budgeted LRU radix tree of KV runs, one tree per cache scope."""

    def __init__(self, budget_bytes: int) -> None:
        if not isinstance(budget_bytes, int | np.integer) or isinstance(budget_bytes, bool) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
        self._budget = int(budget_bytes)
        self._roots: dict[Hashable, _Node] = {}
        self._leaves: set[_Node] = set()
        self._bytes = 0
        self._nodes = 0
        self._clock = 0
        self._hits = 0
        self._stored_positions = 0
        self._evictions = 0
        self._lock = threading.Lock()
        self._unmade: queue.Queue[_Run] = queue.Queue()  # runs stored before their copy landed, oldest first
        self._maker: threading.Thread | None = None
        self._maker_lock = threading.Lock()  # not the tree's lock: a split, under that lock, queues runs

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def match(self, scope: Hashable, tokens: Sequence[int] | np.ndarray) -> int:
        """How many leading positions of `tokens` the tree holds under `scope` (0 if none). Touches nothing."""
        with self._lock:
            return self._walk(scope, as_key(tokens))[1]

    def fetch(self, scope: Hashable, tokens: Sequence[int] | np.ndarray, start: int, end: int) -> SlotSnapshot:
        """The KV of positions [start, end) of `tokens` (end <= match(scope, tokens)); marks the path used."""
        key = as_key(tokens)
        with self._lock:
            path, matched = self._walk(scope, key)
            if not 0 <= start < end <= matched:
                raise ValueError(f"positions [{start}, {end}) are not stored (the tree holds {matched})")
            runs: list[tuple[_Run, int, int]] = []
            depth = 0
            self._clock += 1
            for node, used in path:
                lo, hi = max(start, depth), min(end, depth + used)
                if lo < hi:
                    runs.append((node.kv, lo - depth, hi - depth))
                node.last_used = self._clock
                depth += used
            self._hits += 1
        if not runs:
            raise ValueError("nothing to fetch: an empty range")
        # made outside the lock: a run whose copy has not landed waits for it
        pieces = [{k: {n: a[lo:hi] for n, a in e.items()} for k, e in run.arrays.items()} for run, lo, hi in runs]
        layers = {k: {n: np.concatenate([p[k][n] for p in pieces]) for n in entry} for k, entry in pieces[0].items()}
        return SlotSnapshot(start=start, end=end, layers=layers)

    def insert(self, scope: Hashable, tokens: Sequence[int] | np.ndarray, snapshot: SlotSnapshot) -> int:
        """Store the KV of `tokens` from `snapshot`, which holds positions [snapshot.start, len(tokens)). Returns
        the positions newly stored: 0 when the tree already held them all, when the new run alone exceeds the
        budget, or when the tree no longer holds [0, snapshot.start) (evicted since the caller looked). A
        snapshot whose arrays are not made yet is stored as it is (see the module's docstring)."""
        key = as_key(tokens)
        if snapshot.end != len(key):
            raise ValueError(f"the snapshot ends at {snapshot.end}, the tokens at {len(key)}")
        if not snapshot.ready and self._unmade.qsize() >= COPIES_IN_FLIGHT:
            snapshot.layers  # noqa: B018 - made on this thread: the device buffers held stay bounded
        with self._lock:
            path, matched = self._walk(scope, key)
            if matched < snapshot.start:
                return 0
            self._clock += 1
            for node, _ in path:
                node.last_used = self._clock
            if matched == len(key):
                return 0
            run = _Run.of(snapshot, matched - snapshot.start, len(key) - snapshot.start)
            if run.nbytes > self._budget:
                return 0
            parent = self._roots.setdefault(scope, _Node((), _Run({}), None))
            if path:
                node, used = path[-1]
                parent = node if used == len(node.label) else self._split(node, used)
            leaf = _Node(key[matched:], run, parent)
            leaf.last_used = self._clock
            self._attach(parent, leaf)
            self._evict_until_within_budget(keep=leaf)
            self._stored_positions += len(leaf.label)
        if not run.ready:
            self._make_later(run)
        return len(leaf.label)

    def settle(self) -> None:
        """Make every stored run's arrays now (waiting for their copies)."""
        with self._lock:
            runs = [node.kv for node in self._nodes_all()]
        for run in runs:
            run.arrays  # noqa: B018 - made here

    def _make_later(self, run: _Run) -> None:
        self._unmade.put(run)
        with self._maker_lock:
            if self._maker is None:
                self._maker = threading.Thread(target=self._make_runs, name="slotserve-kv-host", daemon=True)
                self._maker.start()

    def _make_runs(self) -> None:
        """The helper thread: make stored runs' arrays as their copies land, oldest first."""
        while True:
            run = self._unmade.get()
            try:
                if not run.dropped:
                    run.arrays  # noqa: B018 - made here, not on the engine thread
            except Exception:  # noqa: BLE001 - a failed copy: a reader that needs it raises the error again
                pass
            finally:
                self._unmade.task_done()

    def clear(self) -> None:
        """Drop every entry; the counters are kept."""
        with self._lock:
            for node in self._nodes_all():
                node.kv.dropped = True
            self._roots.clear()
            self._leaves.clear()
            self._bytes = 0
            self._nodes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "hits": self._hits,
                "evictions": self._evictions,
                "stored_positions": self._stored_positions,
                "bytes_used": self._bytes,
                "nodes": self._nodes,
                "budget_bytes": self._budget,
            }

    def bytes_by_scope(self) -> dict[Hashable, int]:
        """Bytes held per cache scope (what the dashboard breaks the tier down by)."""
        with self._lock:
            out = {}
            for scope, root in self._roots.items():
                total, stack = 0, [root]
                while stack:
                    node = stack.pop()
                    total += node.nbytes
                    stack.extend(node.children.values())
                out[scope] = total
            return out

    def conversations(self) -> list[tuple[Hashable, Key, SlotSnapshot]]:
        """Every stored conversation (a leaf's path from its root): scope, tokens and the KV of all of them
        (what a shutdown writes to the disk tier)."""
        with self._lock:
            scopes = {id(root): scope for scope, root in self._roots.items()}
            found = []
            for leaf in self._leaves:
                scope = scopes[id(self._root_of(leaf))]
                path, node = [], leaf
                while node.parent is not None:
                    path.append(node)
                    node = node.parent
                path.reverse()
                found.append((scope, tuple(t for n in path for t in n.label), [n.kv for n in path]))
        out = []
        for scope, tokens, runs in found:  # made outside the lock: runs whose copies have not landed wait
            layers = {k: {name: np.concatenate([run.arrays[k][name] for run in runs]) for name in entry}
                      for k, entry in runs[0].arrays.items()}
            out.append((scope, tokens, SlotSnapshot(start=0, end=len(tokens), layers=layers)))
        return out

    # ---- the tree (callers hold the lock) --------------------------------------------------------
    def _walk(self, scope: Hashable, key: Key) -> tuple[list[tuple[_Node, int]], int]:
        """The nodes along key's path with the tokens matched in each (the last may be partial), and the total."""
        node = self._roots.get(scope)
        path: list[tuple[_Node, int]] = []
        i = 0
        while node is not None and i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            used = common_run(key, i, child.label)
            path.append((child, used))
            i += used
            if used < len(child.label):
                break
            node = child
        return path, i

    def _nodes_all(self) -> list[_Node]:
        out, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            out.extend(node.children.values())
            stack.extend(node.children.values())
        return out

    def _root_of(self, node: _Node) -> _Node:
        while node.parent is not None:
            node = node.parent
        return node

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut node's edge after `at` tokens (0 < at < len(label)); returns the new upper node."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.label[:at], node.kv.part(0, at), parent)
        upper.last_used = node.last_used
        lower_kv = node.kv.part(at, len(node.label))
        node.kv.dropped = True
        self._bytes += upper.nbytes + lower_kv.nbytes - node.nbytes
        node.label, node.kv, node.nbytes = node.label[at:], lower_kv, lower_kv.nbytes
        for part in (upper.kv, lower_kv):
            if not part.ready:
                self._make_later(part)
        parent.children[upper.label[0]] = upper
        upper.children[node.label[0]] = node
        node.parent = upper
        self._nodes += 1
        return upper

    def _attach(self, parent: _Node, leaf: _Node) -> None:
        parent.children[leaf.label[0]] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self._bytes += leaf.nbytes
        self._nodes += 1

    def _evict_until_within_budget(self, keep: _Node) -> None:
        while self._bytes > self._budget:
            victim = min((leaf for leaf in self._leaves if leaf is not keep), key=lambda n: n.last_used, default=None)
            if victim is None:  # only `keep` is left and it fits alone (checked before attaching)
                return
            self._remove_leaf(victim)

    def _remove_leaf(self, leaf: _Node) -> None:
        parent = leaf.parent
        assert parent is not None
        del parent.children[leaf.label[0]]
        self._leaves.discard(leaf)
        leaf.parent = None
        leaf.kv.dropped = True
        self._bytes -= leaf.nbytes
        self._nodes -= 1
        self._evictions += 1
        if parent.parent is not None and not parent.children:
            self._leaves.add(parent)
