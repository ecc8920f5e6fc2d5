"""Method B's files: the refiner (``FORMAT``) and its training state (``TRAIN_FORMAT``).

Both are plain dicts with a ``format`` key, read by :func:`load_state` through the one safe
loader (:func:`dualseg.serialization.safe_torch_load`). A model checkpoint given where a
refiner is expected gets a message that says which option takes it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
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


def stored_description(stored: Mapping[str, Any], source: str | os.PathLike[str]) -> dict[str, Any]:
    """The class names, ignore index, palette and calibration a saved refiner describes (a
    ``.pt``'s dict, a folder's ``refiner.json`` or an export's sidecar), checked: a hand-edited
    or damaged description is one :class:`CheckpointError` naming ``source``, not a traceback
    later or a silently coerced value."""

    def bad(key: str, want: str) -> CheckpointError:
        return CheckpointError(
            f"{source}: {key} must be {want}, got {stored.get(key)!r:.60}; fit or save the "
            "refiner again"
        )

    names = stored.get("class_names")
    if not isinstance(names, list | tuple) or not names:
        raise bad("class_names", "a list of class names")
    if not all(isinstance(n, str) for n in names):
        raise bad("class_names", "strings")
    ignore = stored.get("ignore_index", 255)
    if not isinstance(ignore, int) or isinstance(ignore, bool) or not 0 <= ignore <= 255:
        raise bad("ignore_index", "an integer in 0..255")
    palette = stored.get("palette")
    colours = isinstance(palette, list | tuple) and all(
        isinstance(c, list | tuple)
        and len(c) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255 for v in c)
        for c in palette
    )
    if palette is not None and not (colours and len(palette) == len(names)):
        raise bad("palette", f"null or one [r, g, b] in 0..255 per class ({len(names)})")
    calibration = stored.get("calibration")
    if calibration is not None and not (
        isinstance(calibration, Mapping)
        and isinstance(calibration.get("split"), str)
        and isinstance(calibration.get("images"), int)
        and _none_or_strings(calibration.get("image_digests"))
    ):
        raise bad("calibration", "null or the record of 'refine fit --calibrate-split'")
    return {
        "class_names": [str(n) for n in names],
        "ignore_index": int(ignore),
        "palette": palette,
        "calibration": None if calibration is None else dict(calibration),
    }


def _none_or_strings(value: Any) -> bool:
    """A calibration's ``image_digests``: absent (stored before them) or a list of strings."""
    return value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value))
