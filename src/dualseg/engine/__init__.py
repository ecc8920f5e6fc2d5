"""dualseg.engine: training, evaluation and prediction as plain functions.

- :func:`fit` (``dualseg train``) and its inner :func:`train_one_epoch`
- :func:`evaluate` (validation, ``dualseg eval``)
- :func:`save_checkpoint` / :func:`load_checkpoint` (atomic, ``weights_only=True``)

Imported lazily so that ``dualseg train --help`` and the config module stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["evaluate", "fit", "load_checkpoint", "save_checkpoint", "train_one_epoch"]

if TYPE_CHECKING:  # pragma: no cover
    from dualseg.engine.checkpoint import load_checkpoint, save_checkpoint
    from dualseg.engine.evaluation import evaluate
    from dualseg.engine.train import fit, train_one_epoch

_LAZY = {
    "evaluate": "dualseg.engine.evaluation",
    "fit": "dualseg.engine.train",
    "train_one_epoch": "dualseg.engine.train",
    "save_checkpoint": "dualseg.engine.checkpoint",
    "load_checkpoint": "dualseg.engine.checkpoint",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dualseg.engine' has no attribute {name!r}")
