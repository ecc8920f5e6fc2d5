"""Deprecated alias of :mod:`dualseg.commands.data` (moved there; this module goes in 0.2)."""

import warnings

from dualseg.commands import data as _moved

warnings.warn(
    "dualseg.data.cli moved to dualseg.commands.data (the old path goes in dualseg 0.2)",
    DeprecationWarning,
    stacklevel=2,
)
main = _moved.main


def __getattr__(name: str) -> object:
    return getattr(_moved, name)
