"""Program parameters as a few stacked arrays instead of one array per tensor.

A compiled step takes every array of its arguments separately, and dispatching a call costs time per array:
the decode step of the 270M model takes ~250 parameter arrays, ~1 ms of host time a call on a TPU v5e's
host, longer than the device's step when steps are queued back to back (docs/design-notes.md). Per-layer
tensors repeat the same shapes layer after layer, so a `ParamStack` groups the tree's leaves by shape and
dtype and stacks each group into one array [n, *shape]; inside a program `unstack` slices them back into the
tree the model reads. A group of one leaf (the embedding tables) stays that leaf, uncopied.

On CPU the slices become copies of the weights in every step (its dot kernels read whole buffers), so
the engine stacks only on accelerators (`core.device.choose_param_stacking`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

Stacked = tuple[jax.Array, ...]  # one array per group: [n, *shape] for n > 1 leaves, else the leaf itself


class ParamStack:
    """How one parameter tree's leaves map to stacked groups. Built from shapes alone (`jax.ShapeDtypeStruct`
    leaves will do), so programs can be compiled before any weight is stacked."""

    def __init__(self, tree: Any) -> None:
        leaves, self.treedef = jax.tree_util.tree_flatten(tree)
        self.paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        groups: dict[tuple[tuple[int, ...], str], list[int]] = {}
        for i, leaf in enumerate(leaves):
            groups.setdefault((tuple(leaf.shape), str(leaf.dtype)), []).append(i)
        self.groups: list[list[int]] = list(groups.values())  # leaf indices per group, in tree order
        self.place: list[tuple[int, int]] = [(0, 0)] * len(leaves)  # leaf -> (group, index in group)
        for g, members in enumerate(self.groups):
            for k, leaf_index in enumerate(members):
                self.place[leaf_index] = (g, k)
        self.leaf_shapes = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]

    @property
    def identity(self) -> str:
        """Names the grouping for the program store's key (the stacked shapes alone do not fix the tree)."""
        text = repr((self.treedef, self.groups, [(s.shape, str(s.dtype)) for s in self.leaf_shapes]))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def stack(self, tree: Any) -> Stacked:
        """The stacked arrays of ``tree`` (a tree of this structure and shapes), one group at a time: the device
        holds one group's leaves twice at most, for as long as the caller keeps ``tree``."""
        leaves = self._leaves_of(tree)
        return tuple(self._stack_group(members, leaves) for members in self.groups)

    def unstack(self, stacked: Stacked) -> Any:
        """The parameter tree again: traced inside a program, static slices of the stacked arguments."""
        return jax.tree_util.tree_unflatten(self.treedef, [self._leaf(stacked, i) for i in range(len(self.place))])

    def abstract_tree(self) -> Any:
        """The tree's shapes and dtypes, for readers that need no values (byte counts, structure)."""
        return jax.tree_util.tree_unflatten(self.treedef, self.leaf_shapes)

    def named_leaves(self, stacked: Stacked, keep: Callable[[str], bool] = lambda path: True
                     ) -> Iterator[tuple[str, jax.Array]]:
        """(path, leaf) for the leaves whose path ``keep`` accepts, each sliced out only when reached."""
        for i, path in enumerate(self.paths):
            if keep(path):
                yield path, self._leaf(stacked, i)

    def replace(self, stacked: Stacked, update: Callable[[Any], Any], touched: Callable[[str], bool]) -> Stacked:
        """``stacked`` after ``update`` (a function of the tree returning a tree of the same structure and
        shapes) where it changes only leaves whose path ``touched`` accepts: ``update`` sees those leaves as
        arrays and the rest as shapes, and only groups holding a touched leaf are stacked again."""
        view = [self._leaf(stacked, i) if touched(path) else self.leaf_shapes[i] for i, path in enumerate(self.paths)]
        new = self._leaves_of(update(jax.tree_util.tree_unflatten(self.treedef, view)))
        merged = [new[i] if touched(p) else None for i, p in enumerate(self.paths)]
        out = list(stacked)
        for g, members in enumerate(self.groups):
            if any(merged[i] is not None for i in members):
                leaves = [merged[i] if merged[i] is not None else self._leaf(stacked, i) for i in members]
                out[g] = self._stack_group(list(range(len(members))), leaves)
        return tuple(out)

    def _leaves_of(self, tree: Any) -> list[Any]:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef:
            raise ValueError("a parameter tree of another structure than the stack was built for")
        return leaves

    def _stack_group(self, members: list[int], leaves: list[Any]) -> jax.Array:
        if len(members) == 1:
            return leaves[members[0]]
        return jnp.stack([leaves[i] for i in members])

    def _leaf(self, stacked: Stacked, index: int) -> jax.Array:
        group, k = self.place[index]
        return stacked[group] if len(self.groups[group]) == 1 else stacked[group][k]
