"""``refine apply``'s library side: a refiner set up for one base, run over image files."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from dualseg.console import ProgressMode, track
from dualseg.engine.inference import InferenceOptions, infer_logits
from dualseg.engine.outputs import write_outputs
from dualseg.engine.predict import as_rgb_array
from dualseg.errors import ConfigError, DualsegError
from dualseg.imaging import normalize
from dualseg.io import atomic_save_image
from dualseg.refine.base import pairing_notes
from dualseg.refine.calibrate import DECISION_KEYS
from dualseg.refine.crf import CRFSettings, import_pydensecrf
from dualseg.refine.decision import switch_names
from dualseg.refine.formats import check_contract
from dualseg.viz import default_palette

KINDS = ("labels", "color", "overlay", "changed")  # refine apply's output folders


# the options refine apply and eval can set for one run: what inference reads (P3, P4, the
# decision); not P1's blur, which a refiner reading the base's features cannot take
OVERRIDABLE = ("top_n", "radius", *(k for k in DECISION_KEYS if k != "p1_blur_sigma"))


def flags_of(overrides: Mapping[str, Any]) -> str:
    """How the overrides were given, for a message: ``--top-n and --switch-cost``."""
    return " and ".join(f"--{k.replace('_', '-')}" for k in overrides)


def override(refiner: Any, overrides: Mapping[str, Any], *, refiner_name: str) -> list[str]:
    """Set ``overrides`` (options of :data:`OVERRIDABLE`, checked by their flags) on
    ``refiner`` for this run: the notes to show."""
    notes = []

    def shown(key: str) -> Any:  # a stored value, blocked switches by their classes
        value = getattr(refiner.config, key)
        return switch_names(value, refiner.class_names) if key == "blocked_switches" else value

    if overrides and refiner.calibration is not None:  # the sweep ran at the stored ones
        stored = ", ".join(f"{k} {shown(k)}" for k in overrides)
        notes.append(f"note: {refiner_name}'s decision options were chosen on its calibration "
                     f"split at {stored}; at other values they may not be the best")  # fmt: skip
    refiner.config = dataclasses.replace(refiner.config, **overrides)
    refiner.config.check_switches(
        refiner.num_classes, f"pass --blocked-switches pairs of {refiner_name}'s classes"
    )
    top_n = overrides.get("top_n")
    if top_n is not None and top_n > refiner.num_classes:  # a stored one was noted by fit
        notes.append(f"note: {top_n_over_classes(top_n, refiner.num_classes)}")
    if refiner.config.top_n == 1:
        notes.append("note: Top-N 1 leaves each pixel one candidate: no pixel can change")
    return notes


def configure(
    refiner: Any, base: Any, *, overrides: Mapping[str, Any], refiner_name: str,
    base_name: str,
) -> list[str]:  # fmt: skip
    """Apply the ``overrides`` (:func:`override`) and check ``base`` against ``refiner``:
    the notes and warnings to show."""
    notes = override(refiner, overrides, refiner_name=refiner_name)
    if base.class_names is not None:
        refiner.check_classes(base.class_names, len(base.class_names), what=base_name)
    check_contract(refiner, getattr(base, "contract", None), refiner_name=refiner_name,
                   model_name=base_name)  # fmt: skip
    return notes + pairing_notes(refiner, getattr(base, "module", None), refiner_name)


def require_a_model(base: Any, opts: InferenceOptions, base_name: str) -> None:
    """Refuse --mode slide and --tta-* on saved probabilities: they run the base model (a
    folder's maps would be averaged with their own mirror image, or cut to tiles)."""
    if opts.augmented and not hasattr(base, "module"):
        raise ConfigError(
            f"--mode slide and --tta-* run the base model, but --base {base_name} holds saved "
            "probabilities: pass a checkpoint"
        )


def top_n_over_classes(top_n: int, num_classes: int) -> str:
    return (
        f"Top-N {top_n} is more than the {num_classes} classes: every class is a candidate, "
        f"as at Top-N {num_classes}"
    )


def base_scores(
    base: Any, x: torch.Tensor, name: str, path: Path, opts: InferenceOptions
) -> torch.Tensor:
    """The base's class scores for one image, with ``opts``' sliding window and TTA."""
    scores = infer_logits(
        lambda t: base.scores(t, [name] * t.shape[0], sources=[str(path)] * t.shape[0]), x,
        mode=opts.mode, window=opts.window, stride=opts.stride, tta_scales=opts.tta_scales,
        tta_flip=opts.tta_flip, tile_batch=opts.tile_batch,
    ).float()  # fmt: skip
    # the averaged log-probabilities came back
    return scores.softmax(1) if opts.augmented else scores


def crf_settings(overrides: Mapping[str, Any]) -> CRFSettings:
    """``refine apply --crf``: the dense CRF, method B's overrides refused (it has none)."""
    if overrides:
        given = flags_of(overrides)
        raise ConfigError(f"{given} set method B's refiner; --crf has none: drop them")
    import_pydensecrf()  # before any output: one line saying how to install it
    return CRFSettings()


class Applied(NamedTuple):
    changed: int
    pixels: int
    failures: list[str]


def apply_images(
    refiner: Any, base: Any, images: Sequence[tuple[Path, str]], out: Path, *, device: Any,
    opts: InferenceOptions, amp: bool, alpha: float, overwrite: bool, progress: ProgressMode,
) -> Applied:  # fmt: skip
    """Refine each ``(path, name)`` image and write its ``KINDS`` PNGs to ``out``; an unreadable
    image is skipped (its stale outputs removed with ``overwrite``) and reported."""
    crf = isinstance(refiner, CRFSettings)
    if hasattr(base, "require"):  # a probability folder: every image's map, before any output
        base.require([name for _, name in images], [str(path) for path, _ in images])
    # the base's colours, else those refine fit stored (an exported refiner has none)
    palette = base.palette or getattr(refiner, "palette", None)
    changed_total = pixels_total = 0
    failures: list[str] = []
    # a plain forward's backbone output is read, not rerun (a tap refiner reads any forward)
    plain = (not opts.augmented and not amp) or getattr(refiner, "taps", None) is not None
    module = getattr(base, "module", None) if plain else None
    share = getattr(refiner, "shared_features", None)
    kept = share(module) if module is not None and share else contextlib.nullcontext()
    cuda_amp = amp and device.type == "cuda"
    with kept as shared:
        for path, name in track(images, desc="refine", unit="img", mode=progress):
            try:
                rgb = as_rgb_array(path)
            except DualsegError as err:
                failures.append(str(err))
                for folder in KINDS if overwrite else ():  # an earlier run's, now stale
                    (out / folder / f"{name}.png").unlink(missing_ok=True)
                continue
            x = torch.from_numpy(normalize([rgb])).to(device)
            bf16 = torch.autocast("cuda", dtype=torch.bfloat16) if cuda_amp else None
            with torch.no_grad(), bf16 or contextlib.nullcontext():
                scores = base_scores(base, x, name, path, opts)
                if crf:  # logits or probabilities, told apart as method B's decision does
                    labels, changed = refiner.refine(x, scores)
                else:
                    features = shared.take(x) if shared is not None else None
                    labels, changed = refiner.refine(x, scores, return_changed=True,
                                                     features=features)  # fmt: skip
                palette = palette or default_palette(scores.shape[1])
            write_outputs(out, name, rgb, labels[0].cpu().numpy(), palette, alpha=alpha)
            mask = changed[0].cpu().numpy().astype(np.uint8) * 255
            atomic_save_image(out / "changed" / f"{name}.png", mask)
            changed_total += int(changed.sum())
            pixels_total += changed.numel()
    return Applied(changed_total, pixels_total, failures)
