"""User-facing errors.

Every expected failure (bad image, bad label, mismatched sizes, corrupt or incompatible
checkpoint, empty dataset, ...) raises a subclass of :class:`DualsegError` whose message names
the file and says how to fix it. The CLI prints such errors as one line, without a traceback.
"""

from __future__ import annotations


class DualsegError(Exception):
    """Base class of dualseg's user-facing errors."""


class DataError(DualsegError, ValueError):
    """A dataset, image or label file is missing, unreadable or inconsistent."""


class CheckpointError(DualsegError, ValueError):
    """A checkpoint is corrupt, or belongs to another architecture or class set."""


class WeightsNotFoundError(DualsegError, FileNotFoundError):
    """Pretrained weights could not be found in any of the places searched."""


class ConfigError(DualsegError, ValueError):
    """A configuration value is invalid."""
