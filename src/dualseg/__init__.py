"""dualseg: dual-branch semantic segmentation and boundary re-optimization.

Public API (imported lazily so that ``import dualseg`` stays cheap):

- :func:`dualseg.build_model` — build a network by name (``dualseg.models``).
- :func:`dualseg.load_model` — load a trained checkpoint as a ready-to-use segmenter.
- :class:`dualseg.BoundaryRefiner` — method B, boundary re-optimization for any model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dualseg._version import __version__

__all__ = ["BoundaryRefiner", "__version__", "build_model", "load_model"]

if TYPE_CHECKING:  # pragma: no cover
    from dualseg.engine.predict import load_model
    from dualseg.models import build_model
    from dualseg.refine import BoundaryRefiner

_LAZY = {
    "build_model": "dualseg.models",
    "load_model": "dualseg.engine.predict",
    "BoundaryRefiner": "dualseg.refine",
}


# subpackages reached as attributes after a plain ``import dualseg`` (the README's
# ``dualseg.engine.fit(...)``, ``dualseg.data.build_dataset(...)``), imported on first use
_SUBMODULES = ("data", "engine", "export", "imaging", "io", "metrics", "models", "refine", "viz")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"dualseg.{name}")
    raise AttributeError(f"module 'dualseg' has no attribute {name!r}")
