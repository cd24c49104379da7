"""Radix tree (compressed trie) over token-id sequences, mapping exact keys to values.

The prefix cache needs "the longest stored key that is a prefix of this prompt" for prompts of up to
~8K tokens, where many keys share a long common head (every session of an agent starts with the same
1-2K-token system prompt). A plain dict of tuples would need one hash of a prefix per candidate length;
a token-per-node trie would do per-token Python work. Here each edge carries a whole run of tokens as a
tuple, so a walk compares one edge per node with a tuple-slice equality (a C loop), and the number of
Python-level steps is the number of branch points on the path, not the number of tokens.

Keys are normalised to tuples of ints: tuples are used as they are (cheapest), lists are copied, 1-D
numpy integer arrays go through `tolist()`. Elements are not checked one by one (that would cost a Python
loop per token); numpy integer scalars inside a list or tuple work, since they hash and compare equal to
ints. The empty key is not storable (`insert` raises ValueError): an empty prefix covers no KV and
"matched zero tokens" is what a `None` from `longest_prefix` already means. Looking the empty key up is
not an error; it is simply never present.

Not thread-safe; callers that share an index across threads lock around it (see host_tier.HostTier).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

V = TypeVar("V")

Key = tuple[int, ...]

# Marks a node that is only a branch point. A sentinel rather than None so that None is a storable value.
_EMPTY: Any = object()


def as_key(tokens: Sequence[int] | np.ndarray) -> Key:
    """Normalise a token sequence (tuple, list, 1-D integer numpy array, ...) to a tuple key."""
    if type(tokens) is tuple:
        return tokens
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"token array must be 1-D, got shape {tokens.shape}")
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"token array must have an integer dtype, got {tokens.dtype}")
        return tuple(tokens.tolist())
    if isinstance(tokens, str | bytes | bytearray):
        # A str is a Sequence too; accepting it would silently index characters.
        raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    return tuple(tokens)


def _common_len(key: Key, start: int, label: Key) -> int:
    """Length of the common prefix of key[start:] and label.

    Gallops over equal runs with tuple-slice comparisons (C loops), doubling the run on a match and halving
    it on a mismatch, so a divergence thousands of tokens in costs O(log n) Python steps and O(n) C work."""
    limit = min(len(key) - start, len(label))
    i, step = 0, 64
    while i < limit:
        n = min(step, limit - i)
        if key[start + i : start + i + n] == label[i : i + n]:
            i += n
            step *= 2
        elif n > 8:
            step = n // 2
        else:
            while key[start + i] == label[i]:  # the mismatch lies within these n tokens
                i += 1
            break
    return i


class _Node:
    __slots__ = ("label", "children", "value")

    def __init__(self, label: Key, value: Any = _EMPTY) -> None:
        self.label = label  # tokens on the edge from the parent; () only for the root
        self.children: dict[int, _Node] = {}  # keyed by the first token of the child's label
        self.value = value


class PrefixIndex(Generic[V]):
    """Map from non-empty token sequences to values, with longest-stored-prefix lookup."""

    def __init__(self) -> None:
        self._root = _Node(())
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, tokens: object) -> bool:
        try:
            node = self._find(as_key(tokens))  # type: ignore[arg-type]
        except TypeError:
            return False
        return node is not None and node.value is not _EMPTY

    def __repr__(self) -> str:
        return f"PrefixIndex(entries={self._size})"

    def _find(self, key: Key) -> _Node | None:
        """The node whose path spells exactly `key`, or None (a key ending mid-edge has no node)."""
        node, i, n = self._root, 0, len(key)
        while i < n:
            child = node.children.get(key[i])
            if child is None:
                return None
            label = child.label
            end = i + len(label)
            if key[i:end] != label:
                return None
            node, i = child, end
        return node

    def get(self, tokens: Sequence[int] | np.ndarray) -> V | None:
        """The value stored at exactly this key, or None."""
        node = self._find(as_key(tokens))
        if node is None or node.value is _EMPTY:
            return None
        return node.value

    def insert(self, tokens: Sequence[int] | np.ndarray, value: V) -> V | None:
        """Store `value` at exactly this key; returns the value it replaced (None if the key was new)."""
        key = as_key(tokens)
        n = len(key)
        if n == 0:
            raise ValueError("the empty key cannot be stored")
        node, i = self._root, 0
        while True:
            if i == n:
                old = node.value
                node.value = value
                if old is _EMPTY:
                    self._size += 1
                    return None
                return old
            child = node.children.get(key[i])
            if child is None:
                node.children[key[i]] = _Node(key[i:], value)
                self._size += 1
                return None
            label = child.label
            end = i + len(label)
            if key[i:end] == label:
                node, i = child, end
                continue
            # The key leaves (or ends inside) this edge: split it at the divergence point.
            m = _common_len(key, i, label)  # 1 <= m < len(label): the first token matched via the dict
            mid = _Node(label[:m])
            child.label = label[m:]
            mid.children[child.label[0]] = child
            node.children[key[i]] = mid
            if i + m == n:
                mid.value = value
            else:
                mid.children[key[i + m]] = _Node(key[i + m :], value)
            self._size += 1
            return None

    def remove(self, tokens: Sequence[int] | np.ndarray) -> V | None:
        """Delete this exact key; returns its value (None if absent). Keeps the tree compressed: a node left
        without a value is dropped if it has no children and merged into its child if it has one."""
        key = as_key(tokens)
        n = len(key)
        parent: _Node | None = None
        grandparent: _Node | None = None
        node, i = self._root, 0
        while i < n:
            child = node.children.get(key[i])
            if child is None:
                return None
            label = child.label
            end = i + len(label)
            if key[i:end] != label:
                return None
            grandparent, parent, node, i = parent, node, child, end
        if parent is None or node.value is _EMPTY:  # parent None <=> node is the root (empty key)
            return None
        old = node.value
        node.value = _EMPTY
        self._size -= 1
        if len(node.children) == 1:
            self._merge_into_child(parent, node)
        elif not node.children:
            del parent.children[node.label[0]]
            # The parent may now be a valueless pass-through node with a single child.
            if grandparent is not None and parent.value is _EMPTY and len(parent.children) == 1:
                self._merge_into_child(grandparent, parent)
        return old

    @staticmethod
    def _merge_into_child(parent: _Node, node: _Node) -> None:
        """Replace valueless `node` (exactly one child) by its child, whose edge absorbs node's label."""
        (child,) = node.children.values()
        child.label = node.label + child.label
        parent.children[node.label[0]] = child

    def longest_prefix(self, tokens: Sequence[int] | np.ndarray) -> tuple[int, V] | None:
        """(length, value) of the longest stored key that is a prefix of `tokens` (possibly all of it)."""
        key = as_key(tokens)
        best: tuple[int, V] | None = None
        node, i, n = self._root, 0, len(key)
        while i < n:
            child = node.children.get(key[i])
            if child is None:
                break
            label = child.label
            end = i + len(label)
            if key[i:end] != label:
                break  # values live only at node boundaries, so a partial edge match adds nothing
            node, i = child, end
            if node.value is not _EMPTY:
                best = (i, node.value)
        return best

    def items(self) -> Iterator[tuple[Key, V]]:
        """(key, value) pairs in lexicographic key order. Do not mutate the index while iterating."""
        stack: list[tuple[_Node, Key]] = [(self._root, ())]
        while stack:
            node, prefix = stack.pop()
            if node.value is not _EMPTY:
                yield prefix, node.value
            for first in sorted(node.children, reverse=True):
                child = node.children[first]
                stack.append((child, prefix + child.label))

    def keys(self) -> Iterator[Key]:
        for key, _ in self.items():
            yield key

    def clear(self) -> None:
        self._root = _Node(())
        self._size = 0
