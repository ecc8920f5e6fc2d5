"""Method B's decision options, chosen on held-out labelled images (beyond the claim)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from dualseg.io import file_digest
from dualseg.metrics import BoundaryMetrics, ChangeScorer, ConfusionMatrix
from dualseg.refine.decision import decide

# The claim's decision (every near-boundary pixel, nearest prototype, no filter) as a setting
CLAIM_DECISION: Mapping[str, Any] = MappingProxyType({
    "gate_margin": None, "prior_weight": 0.0, "min_prob": 0.0, "switch_cost": 0.0,
    "blocked_switches": (), "p1_blur_sigma": 0.0,
})  # fmt: skip
DECISION_KEYS = tuple(CLAIM_DECISION)
GRID_KEYS = tuple(k for k in DECISION_KEYS if k != "blocked_switches")  # decision_grid's axes
# the second stage of the choice: block each switch (class a -> b) of the best setting that
# broke more than r correct pixels of the held-out images per pixel it fixed, for each r
SWITCH_RATIOS = (2.0, 1.0, 0.75, 0.5, 0.25)
# what choose_decision may maximize (scored on every row of the sweep); the first is the default
METRICS: tuple[str, ...] = ("miou", "boundary_f1", "net_fixed")
# how messages and tables name them
METRIC_NAMES = {"miou": "mIoU", "boundary_f1": "boundary F1",
                "net_fixed": "pixels fixed less twice those broken"}  # fmt: skip
SWITCH_COSTS = (0.0, 0.1, 0.2)  # the sweep's switch costs δ
# net_fixed's price of a broken pixel: a relabel pays only where it is right two times in three,
# so the chosen setting breaks at most half as many pixels as it fixes at its margin, and well
# under half on the whole (the headroom a new scene's drift needs: docs/refine.md)
BROKEN_WEIGHT = 2.0


def net_fixed(fixed: float, broken: float) -> float:
    """The ``net_fixed`` metric: the pixels fixed less :data:`BROKEN_WEIGHT` times those broken
    (fractions or counts, as given)."""
    return fixed - BROKEN_WEIGHT * broken


def decision_grid(
    gates: Sequence[float | None] = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, None),
    priors: Sequence[float] = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0),
    min_probs: Sequence[float] = (0.0, 0.05, 0.2),
    switch_costs: Sequence[float] = SWITCH_COSTS,
    blur_sigmas: Sequence[float] = (0.0, 1.0),  # P1's filter: each runs the embedding
) -> list[dict[str, Any]]:
    """The sweep's grid: every combination, except that τ = 0 (which changes nothing) appears
    once; gate None, prior 0, floor 0 and switch cost 0 together are the claim."""
    grid = []
    axes = (gates, priors, min_probs, switch_costs, blur_sigmas)
    for values in itertools.product(*axes):
        first = all(v == axis[0] for v, axis in zip(values[1:], axes[1:], strict=True))
        if values[0] == 0 and not first:
            continue
        grid.append(CLAIM_DECISION | dict(zip(GRID_KEYS, values, strict=True)))
    return grid


def labelled_candidates(
    refiner: Any, base: Callable[[Tensor], Tensor], batches: Iterable[tuple[Tensor, Tensor]],
    sigmas: Iterable[float], *, device: torch.device, shared: Any = None,
) -> Iterator[tuple[Tensor, dict[float, Any]]]:  # fmt: skip
    """Each labelled batch's labels and its candidates at each P1 blur of ``sigmas``: the base
    runs once a batch, the embedding once a blur."""
    for images, labels in batches:
        images, labels = images.to(device), labels.to(device)
        probs = base(images).float()  # before take(): the base's forward fills what it keeps
        kept = shared.take(images) if shared is not None else None
        yield labels, {
            sigma: refiner.candidates(images, probs, p1_blur_sigma=sigma,
                                      features=kept if sigma == 0 else None)
            for sigma in sigmas
        }  # fmt: skip


@torch.no_grad()
def sweep_decision(
    refiner: Any, base: Callable[[Tensor], Tensor], batches: Iterable[tuple[Tensor, Tensor]],
    *, num_classes: int, grid: Sequence[dict[str, Any]] | None = None, ignore_index: int = 255,
    device: str | torch.device = "cpu", shared: Any = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Score the base model and the refiner at each decision setting on labelled ``batches``."""
    dev = torch.device(device)
    settings = list(decision_grid() if grid is None else grid)
    # a refiner reading the base's own (unblurred) forward: a blur would run a second backbone,
    # +80-90% of the peer's forward on CamVid instead of ~13%, for a choice no one asked to pay
    if getattr(refiner, "taps", None) is not None or getattr(shared, "module", None) is not None:
        settings = [s for s in settings if not s.get("p1_blur_sigma")]
    keys: list[Any] = ["base", *range(len(settings))]
    conf = {k: ConfusionMatrix(num_classes, ignore_index=ignore_index, device=dev) for k in keys}
    bnd = {k: BoundaryMetrics(num_classes, ignore_index=ignore_index, device=dev) for k in keys}
    counts = {k: torch.zeros(4, dtype=torch.int64, device=dev) for k in keys}
    sigmas = {s.get("p1_blur_sigma", 0.0) for s in settings}  # one embedding run each
    for labels, cands in labelled_candidates(refiner, base, batches, sigmas, device=dev,
                                             shared=shared):  # fmt: skip
        pred = next(iter(cands.values())).pred.to(dev)  # Pred, as every decision reads it
        scorer = ChangeScorer(pred, labels, num_classes, ignore_index=ignore_index,
                              tolerance=bnd["base"].tolerance,
                              trimap_width=bnd["base"].trimap_width)  # fmt: skip
        for k in keys:
            out = pred
            if k != "base":
                setting = dict(settings[k])
                out = decide(cands[setting.pop("p1_blur_sigma", 0.0)], **setting)[0].to(dev)
            confusion, state, changes = scorer.scores(out)
            conf[k].mat += confusion
            bnd[k].state += state
            counts[k] += changes
    rows = []
    for k in keys:
        scores = conf[k].compute()
        setting = {"gate_margin": "base"} if k == "base" else dict(settings[k])
        labelled, *px = counts[k].tolist()
        changed, fixed, broken = (n / max(labelled, 1) for n in px)
        rows.append({
            **setting, "miou": float(scores["miou"]), "pixel_acc": float(scores["pixel_acc"]),
            "boundary_f1": float(bnd[k].compute()["boundary_f1"]),
            "changed": changed, "fixed": fixed, "broken": broken,
            "net_fixed": net_fixed(fixed, broken),
        })  # fmt: skip
    return rows


@torch.no_grad()
def switch_counts(
    refiner: Any, base: Callable[[Tensor], Tensor], batches: Iterable[tuple[Tensor, Tensor]],
    setting: Mapping[str, Any], *, num_classes: int, ignore_index: int = 255,
    device: str | torch.device = "cpu", shared: Any = None,
) -> Tensor:  # fmt: skip
    """The pixels ``setting`` relabels from class a to class b on labelled ``batches``, which
    it fixed and which it broke: ``[2,K,K]`` int64 (``[0, a, b]`` fixed, ``[1, a, b]`` broken)."""
    dev, k = torch.device(device), num_classes
    counts = torch.zeros(2, k * k, dtype=torch.int64, device=dev)
    rest = dict(setting)
    sigma = rest.pop("p1_blur_sigma", 0.0)
    for labels, cands in labelled_candidates(refiner, base, batches, [sigma], device=dev,
                                             shared=shared):  # fmt: skip
        c = cands[sigma]
        out, changed = (t.to(dev) for t in decide(c, **rest))
        changed &= labels != ignore_index
        a, b, truth = c.pred.to(dev)[changed], out[changed], labels[changed]
        for row, right in enumerate((truth == b, truth == a)):
            counts[row] += torch.bincount((a * k + b)[right], minlength=k * k)
    return counts.view(2, k, k)


def blocked_at(counts: Tensor, ratio: float) -> tuple[tuple[int, int], ...]:
    """The switches (a, b) of :func:`switch_counts` that broke more than ``ratio`` pixels per
    pixel they fixed."""
    fixed, broken = counts.double()
    a, b = torch.nonzero(broken > ratio * fixed, as_tuple=True)
    return tuple(zip(a.tolist(), b.tolist(), strict=True))


def calibrate_decision(
    refiner: Any, base: Callable[[Tensor], Tensor],
    batches: Callable[[], Iterable[tuple[Tensor, Tensor]]], *, num_classes: int,
    metric: str = "miou", max_broken_ratio: float | None = None, ignore_index: int = 255,
    device: str | torch.device = "cpu", shared: Any = None,
    switch_ratios: Sequence[float] = SWITCH_RATIOS,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:  # fmt: skip
    """Choose the decision options on labelled images (``batches()`` yields them, each call
    anew): sweep the grid; with ``max_broken_ratio``, also block the best setting's switches
    that broke more than each of ``switch_ratios`` pixels per pixel fixed (two more passes);
    choose among all the rows (:func:`choose_decision`). Returns the choice and the rows."""
    kw = {"num_classes": num_classes, "ignore_index": ignore_index, "device": device,
          "shared": shared}  # fmt: skip
    rows = sweep_decision(refiner, base, batches(), **kw)
    best = choose_decision(rows, metric=metric)
    # only to keep within a ratio: unconstrained, the blocks chosen on these images scored
    # no better than none on new ones (and they chose the blocks: an optimistic row)
    if max_broken_ratio is not None and switch_ratios and best["gate_margin"] != 0:
        counts = switch_counts(refiner, base, batches(), best, **kw)
        blocks = dict.fromkeys(blocked_at(counts, r) for r in switch_ratios)  # ordered, unique
        grid = [best | {"blocked_switches": pairs} for pairs in blocks if pairs]
        if grid:  # the base row again is left out
            rows += sweep_decision(refiner, base, batches(), grid=grid, **kw)[1:]
    return choose_decision(rows, metric=metric, max_broken_ratio=max_broken_ratio), rows


def choose_decision(
    rows: Sequence[dict[str, Any]], *, metric: str = METRICS[0],
    max_broken_ratio: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The decision options of the best row by ``metric`` (one of :data:`METRICS`: mIoU, boundary
    F1, or :func:`net_fixed`); on a tie the row changing fewer pixels. With ``max_broken_ratio``
    r, only among the rows that broke at most r pixels for each pixel they fixed; never
    relabelling (τ = 0) always qualifies, so it is the choice when no other row does (and, by
    net_fixed, when no setting fixes more than twice what it breaks)."""

    def order(r: dict[str, Any]) -> tuple[float, float]:
        return (-r[metric] if math.isfinite(r[metric]) else math.inf, r["changed"])

    rows = [r for r in rows if r["gate_margin"] != "base"]
    if max_broken_ratio is not None:  # fractions of one count: exactly R passes despite rounding
        limit = max_broken_ratio * (1 + 1e-9)
        rows = [r for r in rows if r["broken"] <= limit * r["fixed"]]
    if not rows:
        return CLAIM_DECISION | {"gate_margin": 0.0}
    best = min(rows, key=order)
    return CLAIM_DECISION | {k: best[k] for k in DECISION_KEYS if k in best}


def calibrated_on(calibration: Mapping[str, Any] | None, images: Sequence[Any]) -> int | None:
    """How many of ``images`` (paths) a refiner's decision options were chosen on, by content
    (under any split or file name); ``None`` when unknown."""
    digests = (calibration or {}).get("image_digests")
    if digests is None:
        return None
    chosen_on = set(digests)
    return sum(file_digest(image) in chosen_on for image in images)


def calibration_record(
    rows: list[dict[str, Any]], *, split: str, images: Sequence[Any], metric: str,
    max_broken_ratio: float | None, base_fingerprint: str | None,
) -> dict[str, Any]:  # fmt: skip
    """What a refiner stores of the sweep that chose its decision on ``images`` (paths), for
    ``eval --refiner`` / ``refine apply``: images chosen on (found by content, under any split
    or file name), another base (``base_fingerprint``; None: unknown), a choice never to
    relabel (:func:`calibration_note`)."""
    return {
        "split": split, "images": len(images), "metric": metric,
        "max_broken_ratio": max_broken_ratio, "rows": rows,
        "image_digests": [file_digest(path) for path in images],
        "base_fingerprint": base_fingerprint,
    }  # fmt: skip


def within_ratio(max_broken_ratio: float | None) -> str:
    """``" breaking at most 0.5 pixel per pixel fixed"``, or ``""`` without the ratio."""
    r = max_broken_ratio
    return "" if r is None else f" breaking at most {r:g} pixel per pixel fixed"


def no_gain(metric: str, max_broken_ratio: float | None) -> str:
    """Why a sweep chose never to relabel, to be followed by the base: ``"no setting raised the
    mIoU of"`` (the fit's printed choice and :func:`calibration_note` say it alike)."""
    within = within_ratio(max_broken_ratio)
    if metric == "net_fixed":  # it may leave a setting that raised mIoU but broke too much
        return f"no setting{within} fixed more than twice the pixels it broke for"
    return f"no setting{within} raised the {METRIC_NAMES.get(metric, metric)} of"


def calibration_note(calibration: Mapping[str, Any] | None, config: Any) -> str | None:
    """A warning when the held-out check at fit time found that refinement did not help."""
    if calibration is None or config.gate_margin != 0:
        return None
    why = no_gain(calibration.get("metric", "miou"), calibration.get("max_broken_ratio"))
    return (
        f"this refiner's held-out check ({calibration['images']} images of split "
        f"{calibration['split']!r}) found that {why} the base "
        "model it was fit for: its gate_margin is 0 and it changes no pixel"
    )
