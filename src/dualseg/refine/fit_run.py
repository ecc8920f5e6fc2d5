"""``refine fit`` on a dataset folder: its option checks, datasets and held-out calibration."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dualseg.data import build_dataset, build_eval_transform, build_train_transform
from dualseg.data.contract import LabelContract
from dualseg.data.datasets import dataset_meta
from dualseg.data.presets import require_same_classes
from dualseg.engine.checkpoint import FORMAT as MODEL_FORMAT
from dualseg.engine.outputs import check_outputs, dataset_files, unique_names
from dualseg.engine.pretrained import is_hub_source
from dualseg.errors import ConfigError, DataError, OutputError, RunExistsError
from dualseg.io import check_writable
from dualseg.refine.base import model_fingerprint
from dualseg.refine.calibrate import (
    CLAIM_DECISION,
    DECISION_KEYS,
    calibrate_decision,
    calibration_record,
    no_gain,
    within_ratio,
)
from dualseg.refine.config import RefinerConfig
from dualseg.refine.decision import describe_decision, switch_names
from dualseg.refine.formats import FORMAT, TRAIN_FORMAT
from dualseg.refine.refiner import BoundaryRefiner
from dualseg.serialization import torch_file_format

# split names that are for reporting: never where method B's decision options are chosen
EVALUATION_SPLITS = ("val", "test")
MIN_CROP = 16  # px a side: the smallest fit crop that can hold a boundary band


def check_options(
    cfg: RefinerConfig, *, split: str, calibrate_split: str | None, crop_size: Sequence[int],
    weights: str | None, init_backbone: str, has_base: bool, sweep_flags: Sequence[str] = (),
) -> None:  # fmt: skip
    """Refuse option combinations that fit a useless refiner or ignore an option unsaid."""
    if cfg.base_features is not None:
        if not has_base:
            raise ConfigError("--base-features reads modules of the base model: add --base")
        own = (("--weights", weights), ("--init-backbone", init_backbone != "imagenet"),
               ("--backbone-source", cfg.backbone_source != "independent"))  # fmt: skip
        if ignored := [flag for flag, given in own if given]:
            raise ConfigError(
                f"{' and '.join(ignored)} set the refiner's own backbone, which a refiner on "
                "--base-features has not: drop them"
            )
    if min(crop_size) < MIN_CROP:  # found only after every step had drawn nothing
        raise ConfigError(
            f"--crop-size {crop_size[0]} {crop_size[1]} is too small to hold a class boundary; "
            f"use at least {MIN_CROP} {MIN_CROP}"
        )
    if weights and init_backbone == "none" and cfg.backbone_source == "independent":
        raise ConfigError(
            f"--weights {weights} and --init-backbone none conflict (none never reads the file): "
            "drop --weights, or --init-backbone none"
        )
    if not calibrate_split:
        if sweep_flags:  # flags that only choose among the sweep's rows
            need, they = ("need", "they choose") if sweep_flags[1:] else ("needs", "it chooses")
            raise ConfigError(f"{' and '.join(sweep_flags)} {need} --calibrate-split: {they} "
                              "among that sweep's settings")  # fmt: skip
        return
    if not has_base:
        raise ConfigError("--calibrate-split scores the refiner on top of a base model: add --base")
    given = [
        f"--{k.replace('_', '-')}" for k in DECISION_KEYS if getattr(cfg, k) != CLAIM_DECISION[k]
    ]
    if given:  # the sweep would replace them without a word
        raise ConfigError(
            f"{' and '.join(given)} and --calibrate-split both set the decision: drop one"
        )
    if calibrate_split in EVALUATION_SPLITS:
        raise ConfigError(
            f"--calibrate-split {calibrate_split} is an evaluation split, where results are "
            "reported: carve a split from train (e.g. dev.txt)"
        )
    if calibrate_split == split:
        raise ConfigError(
            f"--calibrate-split {calibrate_split} is the --split the refiner is fitted on; "
            "name a split held out of it"
        )


def check_earlier_fit(out: Path, checkpoint: Path, *, resume: bool, overwrite: bool) -> None:
    """An existing ``out`` or ``checkpoint`` (its training state) needs ``resume`` or
    ``overwrite``."""
    if overwrite and resume:
        raise ConfigError("--resume continues a fit, --overwrite replaces it: pass one of them")
    if overwrite or (resume and checkpoint.is_file()):
        return
    if resume and out.exists():
        raise RunExistsError(
            f"--resume: no training state {checkpoint} to continue {out} from; pass --overwrite "
            "to replace it, --checkpoint FILE for its state, or another --out"
        )
    if resume:
        print(f"dualseg refine fit: note: --resume: no training state {checkpoint} yet; "
              "starting a new fit from step 0", file=sys.stderr)  # fmt: skip
    elif out.exists() or checkpoint.exists():
        what = f"--out {out} holds a refiner" if out.exists() else f"{checkpoint} holds a fit"
        raise RunExistsError(
            f"{what}; replace it with --overwrite, continue it with --resume, or choose "
            "another --out / --checkpoint"
        )


def fit_outputs(
    out: str, checkpoint: str | None, *, data: str, layout: str, base: str | None, resume: bool,
    overwrite: bool,
) -> tuple[Path, Path]:  # fmt: skip
    """The refiner file and its training state (default ``<out>.train.pt``), checked before
    any data is read."""
    target = check_writable(out, kind="file", what="--out")
    state = Path(checkpoint) if checkpoint else target.with_suffix(".train.pt")
    check_writable(state, kind="file", what="--checkpoint")
    if target.resolve() == state.resolve():  # found at the first save, after the whole fit
        raise ConfigError(f"--checkpoint {state} is --out: name another, or drop --checkpoint")
    # never the --base model or a file of the dataset, even with --overwrite
    protected = [(f"a file of the dataset {data}", dataset_files(data, layout=layout))]
    if base is not None and Path(base).is_file():
        protected.insert(0, ("the --base model", [Path(base)]))
    kinds = (
        (target, "--out", FORMAT, "a method-B refiner"),
        (state, "--checkpoint", TRAIN_FORMAT, "the training state of a refine fit"),
    )
    for path, what, fmt, kind in kinds:
        check_outputs([path], overwrite=True, protected=protected, what=what)
        found = torch_file_format(path) if path.is_file() else ""
        if found not in (fmt, ""):
            model = " (a dualseg model checkpoint: pass it as --base)"
            raise OutputError(
                f"{what} {path} exists and is not {kind}{model if found == MODEL_FORMAT else ''}: "
                f"choose another {what}"
            )
    check_earlier_fit(target, state, resume=resume, overwrite=overwrite)
    return target, state


class FitData(NamedTuple):
    train: Any  # with step 1's augmentation
    prototypes: Any  # the same images without it (the first ``proto_images``)
    held_out: Any | None  # the --calibrate-split images
    held_out_split: str | None


def fit_datasets(
    data: str, *, split: str, layout: str, preset: str | None, labels: Mapping[str, Any],
    crop_size: Sequence[int], scale_range: Sequence[float], seed: int, proto_images: int,
    calibrate_split: str | None, contract: LabelContract | None = None,
) -> FitData:  # fmt: skip
    """The datasets of a fit, labels read as ``labels`` says (or, with no preset and no
    meta.json, as the base's ``contract``); the calibration split checked before the fit."""
    common: dict[str, Any] = {"split": split, "layout": layout, "preset": preset, **labels}
    if contract is not None and preset is None and not dataset_meta(data, layout=layout,
                                                                    split=split):  # fmt: skip
        common.update(preset=contract.meta, bit_depth=contract.bit_depth)
    tf = build_train_transform(crop_size=tuple(crop_size), scale_range=tuple(scale_range))
    train = build_dataset(data, transform=tf, seed=seed, **common)
    held_out = None
    if calibrate_split:
        held_out = _calibration_dataset(data, train, common, calibrate_split)
    protos = build_dataset(data, transform=build_eval_transform(), **common)
    if proto_images > 0:
        protos = torch.utils.data.Subset(protos, range(min(proto_images, len(protos))))
    return FitData(train, protos, held_out, calibrate_split)


def _calibration_dataset(data: str, train: Any, common: dict[str, Any], split: str) -> Any:
    """The ``--calibrate-split`` dataset, sharing no image with --split, val or test."""
    try:
        held_out = build_dataset(
            data, transform=build_eval_transform(), **{**common, "split": split}
        )
    except DataError as err:  # the dataset's messages name --split: here it is this flag
        raise DataError(re.sub(r"--split\b", "--calibrate-split", str(err))) from None

    def images(ds: Any) -> set[Path]:
        return {Path(image).resolve() for image, _ in getattr(ds, "samples", [])}

    others = [(f"--split {common['split']}", images(train))]
    for name in EVALUATION_SPLITS:  # val under another name would be tuned on, then scored
        try:
            evaluated = build_dataset(data, **{**common, "split": name})
        except DataError:  # no such split: nothing to keep apart
            continue
        others.append((f"the {name} split", images(evaluated)))
    calibrating = [image for image, _ in getattr(held_out, "samples", [])]
    for name, taken in others:
        shared = [image for image in calibrating if Path(image).resolve() in taken]
        if shared:
            raise ConfigError(
                f"{len(shared)} of the {len(held_out)} --calibrate-split {split} images are "
                f"also in {name} (e.g. {shared[0]}): carve the calibration split from train"
            )
    return held_out


def fit_inputs(
    data: str, *, split: str, layout: str, preset: str | None, crop_size: Sequence[int],
    scale_range: Sequence[float], base: str | None, labels: Mapping[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """What the triplet steps read beyond the RefinerConfig, which a ``--resume`` must repeat."""
    if base is not None and not is_hub_source(base):
        base = str(Path(base).resolve())
    mapping = labels["label_map"] or {}
    return {
        "data": str(Path(data).resolve()), "split": split, "layout": layout, "preset": preset,
        "crop_size": list(crop_size), "scale_range": list(scale_range), "base": base,
        "labels": {"label_format": labels["label_format"],
                   "label_map": sorted([int(k), int(v)] for k, v in mapping.items()),
                   "ignore_value": labels["ignore_value"]},
    }  # fmt: skip


def run_fit(
    cfg: RefinerConfig, data: FitData, base: Any, *, root: str, base_name: str | None,
    where: Mapping[str, Any], labels: Mapping[str, Any], crop_size: Sequence[int],
    scale_range: Sequence[float], init_backbone: str, weights: str | None, device: Any,
    amp: bool, workers: int, checkpoint: Path, checkpoint_every: int, resume: bool,
    overwrite: bool, progress: str, log_every: int, calibrate_metric: str,
    calibrate_max_broken_ratio: float | None, time_budget_s: float | None,
) -> tuple[BoundaryRefiner, str]:  # fmt: skip
    """Steps 1-5 on checked inputs, then the ``--calibrate-split`` sweep; the refiner and what
    to print about the sweep ("" without one)."""
    if base is not None and base.class_names is not None:
        require_same_classes(tuple(base.class_names), tuple(data.train.meta.class_names),
                             model=f"the base model {base_name}", data=root)  # fmt: skip
    files = None
    if data.held_out is not None:  # named as predict names them: how a folder base finds them
        files = unique_names([(Path(i), Path(i).stem) for i, _ in data.held_out.samples])
        if hasattr(base, "require"):  # a probability folder: every map, before the fit
            base.require([name for _, name in files], [str(path) for path, _ in files])
    # ImageNet weights unless none; the base's backbone for base / a base-* source
    init_weights, init_from = weights, None
    if init_backbone != "base" and cfg.backbone_source == "independent":
        init_weights = None if init_backbone == "none" else weights or "imagenet"
    elif not hasattr(base, "module"):
        raise ConfigError("--init-backbone base and --backbone-source base-* need a --base model")
    else:
        init_from = base.module
    taps_of = getattr(base, "module", None) if cfg.base_features else None
    read = base_name if init_from is not None or taps_of is not None else None
    inputs = fit_inputs(root, **where, crop_size=crop_size, labels=labels,
                        scale_range=scale_range, base=read)  # fmt: skip
    if overwrite:  # every input checked: the earlier fit's state goes now
        checkpoint.unlink(missing_ok=True)
    bf16 = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if amp else None
    with bf16 or contextlib.nullcontext():
        refiner = BoundaryRefiner.fit(
            data.train, class_names=data.train.meta.class_names, config=cfg,
            prototype_dataset=data.prototypes, weights=init_weights, init_from=init_from,
            base=taps_of, device=device, num_workers=workers, checkpoint=checkpoint,
            checkpoint_every=checkpoint_every, resume=resume, time_budget_s=time_budget_s,
            progress=progress == "bar", log_every=0 if progress == "off" else log_every,
            fit_inputs=inputs,
        )  # fmt: skip
    t = data.train  # the base's contract, else how this fit read its labels
    contract = getattr(base, "contract", None) or LabelContract(t.meta, t.label_format, t.bit_depth)
    refiner.label_contract = contract.to_dict()
    if data.held_out is None:
        return refiner, ""
    split, metric, ratio = data.held_out_split, calibrate_metric, calibrate_max_broken_ratio
    rows = calibrate(refiner, base, data.held_out, files, split=split, metric=metric,
                     max_broken_ratio=ratio, device=device)  # fmt: skip
    options = {k: getattr(refiner.config, k) for k in DECISION_KEYS}
    pairs = options["blocked_switches"]
    shown = options | {"blocked_switches": switch_names(pairs, refiner.class_names)}
    chosen = ", ".join(f"{k} {v}" for k, v in shown.items())
    if refiner.config.gate_margin == 0:
        chosen = f"gate_margin 0, never relabel ({no_gain(metric, ratio)} this base)"
    elif ratio is not None:
        chosen += f" (the best of the settings{within_ratio(ratio)})"
    table = format_sweep(rows, metric=metric, chosen=options)
    return refiner, (
        f"decision sweep on {split} ({len(data.held_out)} held-out images):\n{table}\n"
        f"chosen: {chosen}"
    )


def calibrate(
    refiner: Any, base: Any, held_out: Any, files: Sequence[tuple[Path, str]], *, split: str,
    metric: str, device: Any, max_broken_ratio: float | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Choose the decision options on the held-out images (``files``: their paths and names)
    and store them in the refiner with the sweep's table, which is returned."""
    at: list[tuple[Path, str]] = []  # the image the sweep scores now: a folder base needs it

    def batches() -> Iterator[Any]:
        for i in range(len(held_out)):
            image, label = held_out[i]
            at[:] = files[i : i + 1]
            yield image[None], label[None]

    def base_scores(x: torch.Tensor) -> torch.Tensor:  # logits or probabilities: both read
        ((path, name),) = at
        return base.scores(x, [name], sources=[str(path)])

    module = getattr(base, "module", None)  # a model's backbone output is read, not rerun
    kept = refiner.shared_features(module) if module is not None else contextlib.nullcontext()
    with kept as shared:
        chosen, rows = calibrate_decision(
            refiner, base_scores, batches, num_classes=refiner.num_classes, metric=metric,
            max_broken_ratio=max_broken_ratio, ignore_index=held_out.meta.ignore_index,
            device=device, shared=shared,
        )  # fmt: skip
    refiner.config = dataclasses.replace(refiner.config, **chosen)
    refiner.calibration = calibration_record(
        rows, split=split, images=[path for path, _ in files], metric=metric,
        max_broken_ratio=max_broken_ratio,
        # the base these options were chosen for (a probability folder: unknown)
        base_fingerprint=None if module is None else model_fingerprint(module),
    )  # fmt: skip
    return rows


def fit_summary(refiner: Any, out: Path) -> str:
    """What ``refine fit`` prints at the end: the last step's readings and the refiner."""
    cfg, lines = refiner.config, []
    if refiner.history:
        h = refiner.history[-1]
        lines.append(f"step {h['step']}: loss {h['loss']:.4f}, violating triplets "
                     f"{100 * h['violating']:.1f}%, mean margin {h['margin']:.3f}")  # fmt: skip
    missing = [n for n, p in zip(refiner.class_names, refiner.present.tolist()) if not p]
    no_proto = f"; no prototype for {missing}" if missing else ""
    on = f"taps {' + '.join(refiner.taps.names)}" if refiner.taps else cfg.backbone
    lines.append(f"refiner ({on}, C={cfg.embed_dim}, {refiner.num_classes} classes"
                 f"{no_proto}) -> {out}")  # fmt: skip
    return "\n".join(lines)


def format_sweep(
    rows: list[dict[str, Any]], *, metric: str, best: int = 5,
    chosen: Mapping[str, Any] | None = None,
) -> str:  # fmt: skip
    """The base row, the claim's row, the ``best`` rows by ``metric`` and the ``chosen`` one,
    one line each."""

    def setting(r: dict[str, Any]) -> dict[str, Any]:  # a reading missing from a row: default
        return {k: r.get(k, v) for k, v in CLAIM_DECISION.items()}

    base = [r for r in rows if r["gate_margin"] == "base"]
    rest = sorted((r for r in rows if r not in base), key=lambda r: (-r[metric], r["changed"]))
    picked = None if chosen is None else CLAIM_DECISION | chosen  # never a base row's setting
    show = [r for r in rest if setting(r) == CLAIM_DECISION] + rest[:best]
    show += [r for r in rest if setting(r) == picked]
    lines = []
    for r in base + [r for i, r in enumerate(show) if r not in show[:i]]:
        name = "base model" if r in base else describe_decision(**setting(r))
        line = f"  {name:>32}: mIoU {100 * r['miou']:.1f}  boundary F1 {100 * r['boundary_f1']:.1f}"
        line += f"  changed {100 * r['changed']:.2f}%"
        if r not in base:
            line += f"  fixed {100 * r['fixed']:.2f}%  broke {100 * r['broken']:.2f}%"
        if setting(r) == picked:
            line += "  <- chosen"
        lines.append(line)
    return "\n".join(lines)
