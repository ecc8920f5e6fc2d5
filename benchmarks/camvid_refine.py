"""The CamVid benchmark's post-processing: method B fitted (or reused) per base, its decision
and dense CRF's settings chosen on dev, and every variant scored and timed on a split."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from camvid_protocols import LABELS, REFINED

from dualseg.data import build_dataset
from dualseg.data.transforms import build_train_transform
from dualseg.engine.evaluation import evaluate
from dualseg.errors import ConfigError
from dualseg.io import atomic_write_json
from dualseg.models.base import class_labels
from dualseg.refine import BoundaryRefiner
from dualseg.refine.base import model_fingerprint
from dualseg.refine.calibrate import (
    DECISION_KEYS,
    METRIC_NAMES,
    METRICS,
    calibrate_decision,
    calibration_record,
)
from dualseg.refine.crf import CRFSettings, choose_crf
from dualseg.refine.decision import describe_decision
from dualseg.refine.refiner import RefinerConfig

REFINER_RECIPE = (
    "steps",
    "input_scale",
    "output_stride",
    "embed_dim",
    "batch_size",
    "seed",
    "backbone_source",
    "mining",
    "decoder_channels",
)


def refiner_mismatch(saved: RefinerConfig, wanted: RefinerConfig, path: Path) -> str | None:
    """As :func:`reuse_mismatch`, for a refiner reused with ``--reuse``: the first
    :data:`REFINER_RECIPE` option in which the refiner in ``path`` differs from this call's."""
    return first_difference(
        {k: getattr(saved, k) for k in REFINER_RECIPE},
        {k: getattr(wanted, k) for k in REFINER_RECIPE},
        path,
        fix="rerun with that refiner's --refine-* flags, or use another --out",
    )


def inputs_mismatch(record: Path, inputs: dict[str, Any], path: Path) -> str | None:
    """As :func:`refiner_mismatch`, for what the refiner in ``path`` was fit on (its split,
    the list's hash, ``--prototype-limit``, the base model's weights for ``base-*``), kept in
    ``record`` beside it."""
    if not record.is_file():
        return (
            f"{path} does not record what it was fit on (no {record.name}): delete it to fit "
            "it again, or use another --out"
        )
    saved = json.loads(record.read_text())  # base, fit_list_sha256: hashes of weights / lists
    return first_difference(
        saved, inputs, path, fix="delete it to fit it again, or use another --out"
    )


def first_difference(
    saved: dict[str, Any], wanted: dict[str, Any], path: Path, *, fix: str
) -> str | None:
    """The first key of ``wanted`` whose value the refiner in ``path`` was fit with differs,
    in words ending in ``fix``; ``None`` when all agree."""
    for key, want in wanted.items():
        if saved.get(key) != want:
            return f"{path} was fit with {key} = {saved.get(key)!r}, this call asks {want!r}: {fix}"
    return None


def eval_loader(
    root: str | Path, split_path: str | None, n: int | None, workers: int
) -> tuple[str, Any]:
    """(name, loader) of CamVid val, or of a further split given as a list file or a folder;
    ``workers`` loader processes (``--workers``: they decode beside the timed forward)."""
    if split_path is None:
        ds, name = build_dataset(root, split="val", preset="camvid"), "val"
    else:
        p = Path(split_path)
        if p.is_file():
            ds, name = build_dataset(p.parent, split=p.stem, preset="camvid"), p.stem
        else:
            ds, name = build_dataset(p, preset="camvid"), p.name
    return name, torch.utils.data.DataLoader(limit(ds, n), batch_size=1, num_workers=workers)


def limit(ds: Any, n: int | None) -> torch.utils.data.Subset:
    """The first ``n`` samples of ``ds`` (all when ``n`` is None), as a ``Subset`` whose
    ``indices`` name the images read (the chosen refiner records their digests)."""
    return torch.utils.data.Subset(ds, range(len(ds) if n is None else min(n, len(ds))))


def time_inference(
    model: torch.nn.Module,
    loader: Any,
    n: int,
    device: torch.device,
    refiner: BoundaryRefiner | CRFSettings | None = None,
) -> tuple[float, float, bool]:
    """Median seconds per image (batch 1, full resolution) of the base model (its forward and
    labels), and what the ``refiner`` adds to it (0.0 without), timed on the same images right
    after each forward: the two are measured under the same load, so their ratio holds on a
    busy machine. The first two images warm up (fewer when the split is tiny). Third: whether
    every timed refinement read the base's backbone output (``dualseg.refine.shared``) instead
    of running its own.

    What the refiner adds is its refinement less the base's labels: a refiner takes them
    itself (P2; dense CRF labels its own output), so the pipeline with it is the forward and
    the refinement, and the base's alone is the forward and its labels."""
    base, extra = [], []
    shared_n = 0
    warmup = min(2, len(loader) - 1)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    # a refiner on the base's own frozen backbone at scale 1 reads the base's features
    share = getattr(refiner, "shared_features", None)  # none: dense CRF, on probabilities
    shared = share(model) if share is not None else contextlib.nullcontext()
    with torch.inference_mode(), shared:
        for i, (x, _) in enumerate(loader):
            if i >= n + warmup:
                break
            x = x.to(device)
            sync()
            t0 = time.perf_counter()
            logits = model(x)
            sync()
            forward = time.perf_counter()
            class_labels(logits)  # the base's labels (argmax would add ~10% on the CPU)
            sync()
            t1 = time.perf_counter()
            if share is not None:
                # logits: softmax only at the near-boundary rows
                features = shared.take(x)  # None where they do not match x
                refiner.refine(x, logits, features=features)
                shared_n += i >= warmup and features is not None
            elif refiner is not None:
                refiner.refine(x, logits.softmax(1))
            sync()
            end = time.perf_counter()
            if i >= warmup:
                base.append(t1 - t0)
                extra.append((end - t1) - (t1 - forward))  # less the labels: see above
    extra_s = statistics.median(extra) if refiner is not None else 0.0
    return statistics.median(base), extra_s, refiner is not None and shared_n == len(base)


def refiner_config(args: argparse.Namespace) -> RefinerConfig:
    """Method B's options as the ``--refine-*`` flags (and the base's batch, seed) set them."""
    return RefinerConfig(
        steps=args.refine_steps,
        input_scale=args.refine_input_scale,
        output_stride=args.refine_output_stride,
        embed_dim=args.refine_embed_dim,
        batch_size=args.batch_size,
        seed=args.seed,
        backbone_source=args.refine_backbone_source,
        mining=args.refine_mining,
        decoder_channels=args.refine_decoder_channels,
    )


def fit_refiners(
    args: argparse.Namespace,
    out: Path,
    models: dict[str, torch.nn.Module],
    meta: Any,
    device: torch.device,
    results: dict[str, Any],
) -> tuple[dict[str, BoundaryRefiner], dict[str, BoundaryRefiner]]:
    """Method B for each base in ``REFINED``: ``(refiners, gated)``.

    ``--refine-backbone-source independent`` fits one refiner (ground truth only) for every
    base; ``base-frozen`` / ``base-finetune`` one per base on that base's backbone. Under the
    plateau protocol the fit reads train_fit (dev held out), and the decision is chosen per
    base on dev (:func:`choose_decisions`). Fitted refiners are kept in ``--out`` and reused
    with ``--reuse``; a fit interrupted (SIGINT / SIGTERM) keeps its training state in
    ``refiner_*.train.pt`` there, and ``--reuse`` continues it.
    """
    bases = [n for n in REFINED if n in models]
    if args.refine_steps <= 0 or not bases:
        return {}, {}
    plateau = args.protocol == "plateau"
    root, split = (out / "data", "train_fit") if plateau else (Path(args.data), "train")
    shared = args.refine_backbone_source == "independent"
    listed = (root / f"{split}.txt").read_text()
    fitted: dict[str, BoundaryRefiner] = {}  # "all" (independent) or one per base
    for name in bases:
        key = "all" if shared else name
        if key in fitted:
            continue
        # what the fit read besides its options: a refiner reused must have read the same
        inputs = {
            "fit_split": split,
            "fit_list_sha256": hashlib.sha256(listed.encode()).hexdigest()[:16],
            "prototype_limit": args.prototype_limit,
            "base": None if shared else model_fingerprint(models[name]),
        }
        base = None if shared else models[name]
        fitted[key] = fit_refiner(args, out / f"refiner_{key}.pt", inputs, base, meta, device,
                                  results)  # fmt: skip
    refiners = {name: fitted["all" if shared else name] for name in bases}
    gated = choose_decisions(args, out, models, refiners, meta, device, results) if plateau else {}
    return refiners, gated


def fit_refiner(
    args: argparse.Namespace,
    path: Path,
    inputs: dict[str, Any],
    base: torch.nn.Module | None,
    meta: Any,
    device: torch.device,
    results: dict[str, Any],
) -> BoundaryRefiner:
    """The refiner in ``path``: reused (``--reuse``, refused when fit otherwise) or fitted on
    ``inputs["fit_split"]``, on ``base``'s backbone or (``None``) its own."""
    wanted = refiner_config(args)
    record = path.with_suffix(".inputs.json")
    if args.reuse and path.is_file():
        refiner = BoundaryRefiner.load(path, device=device)
        mismatch = refiner_mismatch(refiner.config, wanted, path)
        mismatch = mismatch or inputs_mismatch(record, inputs, path)
        if mismatch:
            raise ConfigError(mismatch)
        return refiner
    root = path.parent / "data" if args.protocol == "plateau" else Path(args.data)
    split = inputs["fit_split"]
    transform = build_train_transform(crop_size=tuple(args.crop), scale_range=tuple(args.scale))
    train_ds = build_dataset(root, split=split, preset="camvid", transform=transform)
    protos = limit(build_dataset(root, split=split, preset="camvid"), args.prototype_limit)
    t0 = time.time()
    # its training state is saved every 200 steps and when interrupted: --reuse continues it
    refiner = BoundaryRefiner.fit(
        train_ds,
        class_names=meta.class_names,
        config=wanted,
        prototype_dataset=protos,
        weights=None if args.weights == "none" or base is not None else args.weights,
        init_from=base,
        device=device,
        num_workers=args.workers,
        progress=False,
        log_every=250,
        checkpoint=path.with_suffix(".train.pt"),
        resume=args.reuse,
        fit_inputs=inputs,  # a resume on another split, list or base is refused
    )
    refiner.save(path)
    atomic_write_json(record, inputs)
    results["train"][path.stem.replace("refiner_", "method_b_", 1)] = {
        "steps": args.refine_steps,
        "backbone_source": args.refine_backbone_source,
        "mining": args.refine_mining,
        "seconds": time.time() - t0,
    }
    return refiner


def with_decision(refiner: BoundaryRefiner, options: dict[str, Any]) -> BoundaryRefiner:
    """A copy of ``refiner`` deciding with ``options`` (gate, prior, floor, switch cost, blur)."""
    r = refiner
    config = dataclasses.replace(r.config, **options)
    return BoundaryRefiner(r.net, r.prototypes, r.present, class_names=r.class_names,
                           config=config, taps=r.taps)  # fmt: skip


def choose_decisions(
    args: argparse.Namespace,
    out: Path,
    models: dict[str, torch.nn.Module],
    refiners: dict[str, BoundaryRefiner],
    meta: Any,
    device: torch.device,
    results: dict[str, Any],
) -> dict[str, BoundaryRefiner]:
    """Per base, the decision options (gate τ, prior weight, probability floor, switch cost)
    chosen on dev (:mod:`dualseg.refine.calibrate`; without P1 blur where the refiner reads the
    base's own backbone output): ``gated[name]`` holds that copy, also saved as
    ``refiner_NAME_chosen.pt`` in ``out`` for ``dualseg eval --refiner``."""
    _, dev = eval_loader(args.data, str(out / "data" / "dev.txt"), args.eval_limit, args.workers)
    metric, ratio = args.refine_decision_metric, args.refine_decision_max_broken_ratio
    gated: dict[str, BoundaryRefiner] = {}
    for name, refiner in refiners.items():
        model = models[name]
        with refiner.shared_features(model) as kept:  # as evaluate() will read them
            chosen, rows = calibrate_decision(
                refiner,
                lambda x, m=model: m(x).softmax(1),
                lambda: dev,
                num_classes=meta.num_classes,
                metric=metric,
                max_broken_ratio=ratio,
                device=device,
                shared=kept,
            )
        sweep = {"metric": metric, "max_broken_ratio": ratio, "chosen": chosen, "rows": rows}
        print(f"[{name}] decision chosen on dev: {chosen}", flush=True)
        gated[name] = with_decision(refiner, chosen)
        # as refine fit --calibrate-split stores it: dualseg eval --refiner then says so when
        # it scores the dev images, another base, or a choice never to relabel
        images = [dev.dataset.dataset.samples[i][0] for i in dev.dataset.indices]
        gated[name].calibration = calibration_record(
            rows, split="dev", images=images, metric=metric, max_broken_ratio=ratio,
            base_fingerprint=model_fingerprint(model),
        )  # fmt: skip
        gated[name].save(out / f"refiner_{name}_chosen.pt")  # what dualseg eval --refiner scores
        results.setdefault("decision_sweep_dev", {})[name] = sweep
    return gated


def choose_crfs(
    args: argparse.Namespace,
    out: Path,
    models: dict[str, torch.nn.Module],
    meta: Any,
    device: torch.device,
    results: dict[str, Any],
) -> dict[str, CRFSettings]:
    """With ``--crf``, dense CRF's kernel settings for each base in ``REFINED``: under the
    plateau protocol chosen on dev (by ``--refine-decision-metric``, as method B's decision),
    else the defaults."""
    if not args.crf:
        return {}
    bases = [n for n in REFINED if n in models]
    if args.protocol != "plateau":
        return dict.fromkeys(bases, CRFSettings())
    _, dev = eval_loader(args.data, str(out / "data" / "dev.txt"), args.eval_limit, args.workers)
    chosen = {}
    for name in bases:
        metric = args.refine_decision_metric
        chosen[name], rows = choose_crf(
            models[name], dev, num_classes=meta.num_classes, device=device, metric=metric
        )
        results.setdefault("crf_sweep_dev", {})[name] = {"metric": metric, "rows": rows}
        print(f"[{name}] dense CRF chosen on dev: {chosen[name].describe()}", flush=True)
    return chosen


def decision_label(
    cfg: RefinerConfig, metric: str = METRICS[0], max_broken_ratio: float | None = None
) -> str:
    """How a dev-chosen decision reads in a table: 'gate 0.1, prior 2 (chosen on dev)', with
    '... by boundary F1' where the sweep maximized another metric than mIoU, and '..., broken
    <= 0.5 x fixed' where it chose among the settings within that ratio."""
    by = "" if metric == METRICS[0] else " by " + METRIC_NAMES[metric]
    if max_broken_ratio is not None:
        by += f", broken <= {max_broken_ratio:g} x fixed"
    words = describe_decision(**{k: getattr(cfg, k) for k in DECISION_KEYS})
    return f"{words} (chosen on dev{by})"


def post_processors(
    name: str,
    args: argparse.Namespace,
    refiners: dict[str, BoundaryRefiner],
    gated: dict[str, BoundaryRefiner],
    crfs: dict[str, CRFSettings],
) -> list[tuple[str, str, Any]]:
    """``(row key, label, post-processor)`` of base ``name``'s rows: the base alone (``None``),
    method B, method B with its decision chosen on dev, dense CRF."""
    variants: list[tuple[str, str, Any]] = [(name, LABELS[name], None)]
    if name in refiners:
        variants.append((f"{name}+B", LABELS[name] + " + method B", refiners[name]))
    if name in gated:
        how = decision_label(
            gated[name].config, args.refine_decision_metric, args.refine_decision_max_broken_ratio
        )
        variants.append((f"{name}+B_gated", f"{LABELS[name]} + method B, {how}", gated[name]))
    if name in crfs:
        how = "chosen on dev" if args.protocol == "plateau" else "default settings"
        label = f"{LABELS[name]} + dense CRF ({crfs[name].describe()}; {how})"
        variants.append((f"{name}+CRF", label, crfs[name]))
    return variants


def summarize(m: dict[str, Any]) -> dict[str, Any]:
    keys = ("miou", "pixel_acc", "mean_acc", "boundary_f1", "trimap_miou", "iou")
    return {k: m[k] for k in keys if k in m}


def score_variants(
    model: torch.nn.Module,
    variants: list[tuple[str, str, Any]],
    loader: Any,
    split: str,
    args: argparse.Namespace,
    meta: Any,
    device: torch.device,
) -> dict[str, Any]:
    """One results row per variant of :func:`post_processors` on ``loader``'s split."""
    rows: dict[str, Any] = {}
    for key, label, refiner in variants:
        m = evaluate(
            model,
            loader,
            num_classes=meta.num_classes,
            device=device,
            refiner=refiner,
            # fp32, as the dev sweep and the timing run: on CUDA bf16 would also turn off the
            # reading of the base's features, so the figures would come from another
            # computation than the one timed
            amp=False,
        )
        if refiner is None:
            ms = 1000 * time_inference(model, loader, args.timing_images, device)[0]
            rows[key] = {"label": label, **summarize(m), "ms_per_image": ms}
            print(f"[{split}] {label}: mIoU {100 * m['miou']:.1f}", flush=True)
            continue
        base_s, refine_s, timed_shared = time_inference(
            model, loader, args.timing_images, device, refiner
        )
        rows[key] = {
            "label": label,
            **summarize(m["refined"]),
            # base + refinement, both timed in this row's own paired pass: compare rows by
            # extra_time_ratio, not by ms_per_image against the base row's pass
            "ms_per_image": 1000 * (base_s + refine_s),
            "base_ms_per_image_paired": 1000 * base_s,
            "extra_time_ratio": refine_s / base_s,  # paired, under the same load
            # whether the refiner read the base's backbone output instead of running its own,
            # on every image evaluated and timed
            "shares_base_features": timed_shared
            and m["refine"]["shared_images"] == m["num_images"],
            "refine": m["refine"],
        }
        print(
            f"[{split}] {label}: mIoU {100 * m['refined']['miou']:.1f}, "
            f"{m['refine']['fixed']} pixels fixed, {m['refine']['broke']} broken",
            flush=True,
        )
    return rows
