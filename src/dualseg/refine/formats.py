"""Method B's files: the refiner (``FORMAT``) and its training state (``TRAIN_FORMAT``).

Both are plain dicts with a ``format`` key, read by :func:`load_state` through the one safe
loader (:func:`dualseg.serialization.safe_torch_load`). A model checkpoint given where a
refiner is expected gets a message that says which option takes it.
"""

from __future__ import annotations

import os
from typing import Any

from dualseg.engine.checkpoint import FORMAT as CHECKPOINT_FORMAT
from dualseg.errors import CheckpointError
from dualseg.serialization import safe_torch_load

FORMAT = "dualseg-refiner/1"
TRAIN_FORMAT = "dualseg-refiner-train/1"


def load_state(path: str | os.PathLike[str], fmt: str, what: str) -> dict[str, Any]:
    """The dict stored in ``path``, which must have ``format == fmt`` (one clear error else)."""
    state = safe_torch_load(
        path,
        what=what,
        fix="refit or use another file",
        written_by="'dualseg refine fit --out' writes it",
    )
    found = state.get("format") if isinstance(state, dict) else type(state).__name__
    if found == CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{path} is a dualseg model checkpoint, not a method-B {what}: pass it as "
            "--checkpoint (refine: --base), and a 'dualseg refine fit' file as --refiner"
        )
    if found == TRAIN_FORMAT and fmt == FORMAT:
        raise CheckpointError(
            f"{path} is the training state of 'dualseg refine fit', not a refiner: pass the "
            "refiner that fit wrote (its --out), or continue the fit with 'refine fit --resume'"
        )
    if found != fmt:
        raise CheckpointError(
            f"{path} is not a dualseg {what} (format {found!r}, expected {fmt!r})"
        )
    return state
