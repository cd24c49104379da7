"""The one exception the checkpoint readers raise."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed or does not fit the model.

    The message names the tensor and the file whenever one is involved, so a user can tell which
    download is broken without a debugger.
    """
