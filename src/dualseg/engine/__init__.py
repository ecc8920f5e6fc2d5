"""dualseg.engine: training (:func:`fit`), :func:`evaluate` and checkpoints, imported lazily so
that ``dualseg train --help`` and the config module stay light."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["evaluate", "fit", "load_checkpoint", "save_checkpoint", "train_one_epoch"]

_LAZY = {
    "evaluate": "dualseg.engine.evaluation",
    "fit": "dualseg.engine.train",
    "train_one_epoch": "dualseg.engine.step",
    "save_checkpoint": "dualseg.engine.checkpoint",
    "load_checkpoint": "dualseg.engine.checkpoint",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dualseg.engine' has no attribute {name!r}")
