"""dualseg: dual-branch semantic segmentation and boundary re-optimization.

Public API, imported on first use so that ``import dualseg`` stays cheap: :func:`build_model`,
:func:`load_model`, :class:`BoundaryRefiner`, and the subpackages (``dualseg.engine.fit``,
``dualseg.data.build_dataset`` ...).
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

_LAZY = {"build_model": "models", "load_model": "engine.predict", "BoundaryRefiner": "refine"}
_SUBMODULES = ("data", "engine", "export", "imaging", "io", "metrics", "models", "refine", "viz")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"dualseg.{_LAZY[name]}"), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"dualseg.{name}")
    raise AttributeError(f"module 'dualseg' has no attribute {name!r}")
