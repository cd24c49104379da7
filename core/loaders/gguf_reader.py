"""gguf.GGUFReader without the per-element parsing of big metadata arrays.

The stock reader builds one numpy view per element of every metadata array; for Gemma's 262k-token
vocabulary (tokens, scores, token types) that is ~13 s of a ~13 s open. Model loading needs none of
those arrays, so for big arrays this reader views a scalar array as one block and skips a string array
over; small ones (general.tags, ...) go through the stock code unchanged.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader, GGUFValueType

# Arrays shorter than this are parsed by the stock code; only vocabulary-sized ones take the fast path.
BIG_ARRAY = 4096


class FastGGUFReader(GGUFReader):
    """A GGUFReader with big scalar arrays as one view and big string arrays empty (`contents() == []`)."""

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[GGUFValueType]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        if int(length[0]) < BIG_ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        offs = orig_offs + 12
        item_type = GGUFValueType(raw_itype[0])
        types = [GGUFValueType.ARRAY, item_type]
        nptype = self.gguf_scalar_to_np.get(item_type)
        if nptype is not None:
            # One view of the whole array; contents() flattens parts[data] so it still returns every value.
            values = self._get(offs, nptype, int(length[0]))
            return 12 + int(values.nbytes), [raw_itype, length, values], [2], types
        if item_type == GGUFValueType.STRING:
            return offs + self._skip_strings(offs, int(length[0])) - orig_offs, [raw_itype, length], [], types
        # Nested arrays are rare and small: the stock element-by-element path handles them.
        return super()._get_field_parts(orig_offs, raw_type)

    def _skip_strings(self, offs: int, count: int) -> int:
        """Bytes taken by `count` length-prefixed strings starting at `offs`."""
        # byte_order is relative to the host: "I" the same, "S" swapped.
        file_is_little = (sys.byteorder == "little") == (self.byte_order == "I")
        unpack = struct.Struct("<Q" if file_is_little else ">Q").unpack_from
        view = memoryview(self.data)
        start = offs
        for _ in range(count):
            (size,) = unpack(view, offs)
            offs += 8 + size
        if offs > len(self.data):
            raise ValueError(f"string array at offset {start} runs past the end of the file")
        return offs - start
