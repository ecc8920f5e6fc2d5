"""Method B's files: the refiner (``FORMAT``) and its training state (``TRAIN_FORMAT``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from torch import Tensor

from dualseg._version import __version__
from dualseg.data.contract import LabelContract
from dualseg.engine.checkpoint import FORMAT as CHECKPOINT_FORMAT
from dualseg.errors import CheckpointError, ConfigError, DataError, OutputError
from dualseg.io import atomic_torch_save
from dualseg.refine.config import RefinerConfig
from dualseg.refine.inputs import check_finite_refiner
from dualseg.serialization import safe_torch_load, torch_file_format

FORMAT = "dualseg-refiner/1"
TRAIN_FORMAT = "dualseg-refiner-train/1"


def load_state(path: str | os.PathLike[str], fmt: str, what: str) -> dict[str, Any]:
    """The dict stored in ``path``, which must have ``format == fmt`` (one clear error else)."""
    state = safe_torch_load(path, what=what, fix="refit or use another file",
                            written_by="'dualseg refine fit --out' writes it")  # fmt: skip
    found = state.get("format") if isinstance(state, dict) else type(state).__name__
    if found == CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{path} is a dualseg model checkpoint, not a method-B {what}: pass it as "
            "--checkpoint (refine: --base)"
        )
    if found == TRAIN_FORMAT and fmt == FORMAT:
        raise CheckpointError(
            f"{path} is the training state of 'dualseg refine fit', not a refiner: pass its "
            "--out, or continue the fit with --resume"
        )
    if found != fmt:
        raise CheckpointError(
            f"{path} is not a dualseg {what} (format {found!r}, expected {fmt!r})"
        )
    return state


class StoredRefiner(NamedTuple):
    """A saved refiner's parts, as read from a ``.pt`` or a folder (not yet checked)."""

    description: Mapping[str, Any]
    net_state: Mapping[str, Tensor]
    prototypes: Tensor
    present: Tensor
    source: str | os.PathLike[str]


def save_refiner_file(
    path: str | os.PathLike[str], description: Mapping[str, Any], net_state: Mapping[str, Tensor],
    prototypes: Tensor, present: Tensor,
) -> Path:  # fmt: skip
    """Write a refiner atomically to one file."""
    target = Path(path)
    if target.is_dir():
        raise OutputError(f"{target} is a folder; save writes one file (save_pretrained: a folder)")
    kind = torch_file_format(target) if target.is_file() else ""
    if kind not in (FORMAT, ""):  # "": an interrupted save's leftover
        raise OutputError(
            f"{target} exists and is not a method-B refiner ({kind}): choose another path"
        )
    state = {"format": FORMAT, "version": __version__, **description,
             "model": {k: v.detach().cpu() for k, v in net_state.items()},
             "prototypes": prototypes.cpu(), "present": present.cpu()}  # fmt: skip
    atomic_torch_save(state, target)
    return target


def read_refiner_file(path: str | os.PathLike[str]) -> StoredRefiner:
    if not os.fspath(path).strip():  # Path("") is the current folder
        raise ConfigError("the refiner path is empty (an unset variable?)")
    state = load_state(path, FORMAT, "refiner")
    if missing := [k for k in ("model", "prototypes", "present", "config") if k not in state]:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}; fit the refiner again")
    check_finite_refiner(path, {**state["model"], "prototypes": state["prototypes"]})
    return StoredRefiner(state, state["model"], state["prototypes"], state["present"], path)


def stored_description(stored: Mapping[str, Any], source: str | os.PathLike[str]) -> dict[str, Any]:
    """The options, class names, ignore index, palette, calibration, taps and label contract
    a saved refiner describes, checked: a damaged one is a :class:`CheckpointError` naming
    ``source``."""

    def bad(key: str, want: str) -> CheckpointError:
        got = stored.get(key)
        return CheckpointError(f"{source}: {key} must be {want}, got {got!r:.60}; save it again")

    def ints(values: Any, low: int, high: int) -> bool:
        return isinstance(values, list | tuple) and all(
            isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in values
        )

    def strs(values: Any) -> bool:
        return isinstance(values, list | tuple) and all(isinstance(v, str) for v in values)

    names = stored.get("class_names")
    if not isinstance(names, list | tuple) or not names:
        raise bad("class_names", "a list of class names")
    if not strs(names):
        raise bad("class_names", "strings")
    ignore = stored.get("ignore_index", 255)
    if not ints([ignore], 0, 255):
        raise bad("ignore_index", "an integer in 0..255")
    palette = stored.get("palette")
    colours = isinstance(palette, list | tuple) and len(palette) == len(names)
    if palette is not None and not (colours and all(ints(c, 0, 255) and len(c) == 3
                                                    for c in palette)):  # fmt: skip
        raise bad("palette", f"null or one [r, g, b] in 0..255 per class ({len(names)})")
    cal = stored.get("calibration")
    if cal is not None and not (
        isinstance(cal, Mapping) and strs([cal.get("split")]) and ints([cal.get("images")], 0, BIG)
        and (cal.get("image_digests") is None or strs(cal["image_digests"]))
    ):  # fmt: skip
        raise bad("calibration", "null or the record of 'refine fit --calibrate-split'")
    taps = stored.get("taps")
    if taps is not None and not (
        isinstance(taps, Mapping) and all(isinstance(taps.get(k), list) and len(taps[k]) == 2
                                          for k in TAP_KEYS)
        and strs(taps["names"]) and all(ints(taps[k], 1, BIG) for k in TAP_KEYS[1:])
    ):  # fmt: skip
        raise bad("taps", "null or the base modules a tap refiner reads")
    contract = stored.get("label_contract")
    if contract is not None:
        try:
            contract = LabelContract.from_dict(dict(contract)).to_dict()
        except (DataError, TypeError, ValueError):
            raise bad("label_contract", "null or the label contract of its base") from None
    try:
        config = RefinerConfig.from_dict(stored.get("config"))
    except ConfigError as err:
        raise CheckpointError(f"{source}: {err}; save it again") from None
    return {"label_contract": contract, "taps": taps, "class_names": list(names),
            "ignore_index": ignore, "palette": palette, "config": config,
            "calibration": None if cal is None else dict(cal)}  # fmt: skip


TAP_KEYS = ("names", "channels", "strides")
BIG = 2**62


def check_contract(
    refiner: Any, contract: LabelContract | None, *, refiner_name: str, model_name: str
) -> None:
    """Refuse a refiner fitted on labels read otherwise than the model's ``contract`` (either
    side without one passes)."""
    stored = getattr(refiner, "label_contract", None)
    if stored is None or contract is None:
        return
    if diff := contract.differences(LabelContract.from_dict(stored), sides=("model", "refiner")):
        raise CheckpointError(
            f"the refiner {refiner_name} was fitted on labels read otherwise than "
            f"{model_name} reads them: {'; '.join(diff)}; fit the refiner on this model's data "
            "(refine fit --base MODEL)"
        )
