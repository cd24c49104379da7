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

All methods take one lock: the engine thread stores and fetches, the metrics endpoint reads `stats()`.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

import numpy as np

from core.engine import SlotSnapshot

Key = tuple[int, ...]
Arrays = dict[str, dict[str, np.ndarray]]  # layer key -> array name -> [positions, ...]


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


class _Node:
    __slots__ = ("label", "kv", "children", "parent", "last_used", "nbytes")

    def __init__(self, label: Key, kv: Arrays, parent: _Node | None) -> None:
        self.label = label  # the tokens of this edge; () only for a scope's root
        self.kv = kv  # their KV: [len(label), ...] per array
        self.children: dict[int, _Node] = {}  # keyed by the first token of the child's label
        self.parent = parent
        self.last_used = 0
        self.nbytes = _nbytes(kv)


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
            pieces: list[Arrays] = []
            depth = 0
            self._clock += 1
            for node, used in path:
                lo, hi = max(start, depth), min(end, depth + used)
                if lo < hi:
                    pieces.append({k: {n: a[lo - depth:hi - depth] for n, a in e.items()} for k, e in node.kv.items()})
                node.last_used = self._clock
                depth += used
            self._hits += 1
        if not pieces:
            raise ValueError("nothing to fetch: an empty range")
        layers = {k: {n: np.concatenate([p[k][n] for p in pieces]) for n in entry} for k, entry in pieces[0].items()}
        return SlotSnapshot(start=start, end=end, layers=layers)

    def insert(self, scope: Hashable, tokens: Sequence[int] | np.ndarray, snapshot: SlotSnapshot) -> int:
        """Store the KV of `tokens` from `snapshot`, which holds positions [snapshot.start, len(tokens)). Returns
        the positions newly stored: 0 when the tree already held them all, when the new run alone exceeds the
        budget, or when the tree no longer holds [0, snapshot.start) (evicted since the caller looked)."""
        key = as_key(tokens)
        if snapshot.end != len(key):
            raise ValueError(f"the snapshot ends at {snapshot.end}, the tokens at {len(key)}")
        with self._lock:
            path, matched = self._walk(scope, key)
            if matched < snapshot.start:
                return 0
            self._clock += 1
            for node, _ in path:
                node.last_used = self._clock
            if matched == len(key):
                return 0
            run = _slice(snapshot.layers, matched - snapshot.start, len(key) - snapshot.start)
            if _nbytes(run) > self._budget:
                return 0
            parent = self._roots.setdefault(scope, _Node((), {}, None))
            if path:
                node, used = path[-1]
                parent = node if used == len(node.label) else self._split(node, used)
            leaf = _Node(key[matched:], run, parent)
            leaf.last_used = self._clock
            self._attach(parent, leaf)
            self._evict_until_within_budget(keep=leaf)
            self._stored_positions += len(leaf.label)
            return len(leaf.label)

    def clear(self) -> None:
        """Drop every entry; the counters are kept."""
        with self._lock:
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
            out = []
            for leaf in self._leaves:
                scope = scopes[id(self._root_of(leaf))]
                path, node = [], leaf
                while node.parent is not None:
                    path.append(node)
                    node = node.parent
                path.reverse()
                tokens = tuple(t for n in path for t in n.label)
                layers = {k: {name: np.concatenate([n.kv[k][name] for n in path]) for name in entry}
                          for k, entry in path[0].kv.items()}
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

    def _root_of(self, node: _Node) -> _Node:
        while node.parent is not None:
            node = node.parent
        return node

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut node's edge after `at` tokens (0 < at < len(label)); returns the new upper node."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.label[:at], _slice(node.kv, 0, at), parent)
        upper.last_used = node.last_used
        lower_kv = _slice(node.kv, at, len(node.label))
        self._bytes += upper.nbytes + _nbytes(lower_kv) - node.nbytes
        node.label, node.kv, node.nbytes = node.label[at:], lower_kv, _nbytes(lower_kv)
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
        self._bytes -= leaf.nbytes
        self._nodes -= 1
        self._evictions += 1
        if parent.parent is not None and not parent.children:
            self._leaves.add(parent)
