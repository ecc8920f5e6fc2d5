"""Deprecated import paths: a moved command module keeps answering at its old path for one
release (``dualseg.engine.cli`` -> ``dualseg.commands.train``, ...), with a warning."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved(old: str, new: str) -> tuple[Callable[..., int], Callable[[str], Any]]:
    """Warn that ``old`` moved to ``new``; return ``new``'s ``main`` and a module
    ``__getattr__`` that forwards every other name to ``new``."""
    warnings.warn(
        f"{old} moved to {new} (the old path goes in dualseg 0.2)",
        DeprecationWarning,
        stacklevel=3,
    )
    module = importlib.import_module(new)

    def forward(name: str) -> Any:
        return getattr(module, name)

    return module.main, forward
