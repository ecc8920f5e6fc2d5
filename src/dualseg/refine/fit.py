"""Fitting a refiner (method B, steps 3-5): the embedding model, trained by a fixed number of
triplet-hinge steps (step 4; or fewer, within a time budget), then the class prototypes (step 5)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from dualseg.data.transforms import seeded
from dualseg.engine.runlog import Interrupt
from dualseg.errors import CheckpointError, ConfigError, DataError, Terminated
from dualseg.io import atomic_torch_save
from dualseg.refine.calibrate import DECISION_KEYS
from dualseg.refine.config import RefinerConfig
from dualseg.refine.embedding import (
    EmbeddingNet,
    build_embedding_net,
    init_backbone_from,
    tap_embedding_net,
)
from dualseg.refine.formats import TRAIN_FORMAT, load_state
from dualseg.refine.prototypes import require_class_labels
from dualseg.refine.taps import TapRecord, list_taps, measure_taps, pick_taps
from dualseg.refine.triplet import triplet_step

log = logging.getLogger(__name__)


def _batches(
    n: int, batch_size: int, seed: int, start_step: int, steps: int
) -> Iterator[list[tuple[int, int]]]:
    """``(pass, index)`` batches for steps ``start_step..steps-1``: a permutation per pass,
    seeded by (seed, pass), so a resumed run draws the batches it would have drawn."""
    per_epoch = max(1, n // batch_size)
    for step in range(start_step, steps):
        epoch, k = divmod(step, per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        yield [(epoch, i) for i in perm[k * batch_size : (k + 1) * batch_size].tolist()]


class _EpochView(torch.utils.data.Dataset):
    """``view[(pass, i)] = dataset[i]`` with the augmentation seeded for that pass (also in
    DataLoader workers)."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        return self.dataset[index]


def _require_same_inputs(
    path: Path, saved: Mapping[str, Any] | None, given: Mapping[str, Any] | None
) -> None:
    """Refuse a resume whose data, augmentation or base differ from the checkpoint's (a fit
    from Python without ``fit_inputs`` records none: nothing to compare)."""
    if saved is None or given is None:
        return
    if changed := [k for k in sorted(set(saved) | set(given)) if saved.get(k) != given.get(k)]:
        what = "; ".join(f"{k}: {saved.get(k)!r} then, {given.get(k)!r} now" for k in changed)
        raise CheckpointError(
            f"{path} was fitted on other inputs ({what}); resume with the same ones, or "
            "delete it to start over"
        )


# options the embedding's training never reads: a resume may change them (--steps: train longer)
RESUMABLE_CHANGES = ("steps", "top_n", *DECISION_KEYS)


def _resume(
    path: Path, net: nn.Module, opt: torch.optim.Optimizer, cfg: RefinerConfig,
    class_names: Sequence[str], fit_inputs: Mapping[str, Any] | None,
) -> tuple[int, list[dict[str, float]]]:  # fmt: skip
    """Load the training state at ``path`` into ``net`` and ``opt``: ``(step, history)``."""
    state = load_state(path, TRAIN_FORMAT, "refiner training checkpoint")
    saved = RefinerConfig.from_dict(state["config"])
    changed = [
        f"{f.name} {getattr(saved, f.name)!r} -> {getattr(cfg, f.name)!r}"
        for f in dataclasses.fields(cfg)
        if f.name not in RESUMABLE_CHANGES and getattr(saved, f.name) != getattr(cfg, f.name)
    ]
    if list(state["class_names"]) != list(class_names):
        changed.append("the class names")
    if changed:
        raise CheckpointError(
            f"{path} was written with other options ({'; '.join(changed)}); resume with the "
            f"same ones (only --steps, {', '.join(RESUMABLE_CHANGES[1:])} may change), or "
            "delete it to start over"
        )
    if int(state["step"]) > cfg.steps:
        raise CheckpointError(
            f"{path} has trained {int(state['step'])} steps already, more than "
            f"--steps {cfg.steps}; resume with --steps {int(state['step'])} or more"
        )
    _require_same_inputs(path, state.get("fit_inputs"), fit_inputs)
    net.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    log.info("resuming refiner training from step %d (%s)", int(state["step"]), path)
    return int(state["step"]), list(state["history"])


def train_embedding(
    net: EmbeddingNet, dataset: torch.utils.data.Dataset, cfg: RefinerConfig, *,
    class_names: Sequence[str], device: torch.device, num_workers: int = 0,
    checkpoint: str | os.PathLike[str] | None = None, checkpoint_every: int = 200,
    resume: bool = False, progress: bool = True, log_every: int = 0, ignore_index: int = 255,
    time_budget_s: float | None = None, fit_inputs: Mapping[str, Any] | None = None,
) -> list[dict[str, float]]:  # fmt: skip
    """Step 4: ``cfg.steps`` optimizer steps of the sampled triplet hinge."""
    if time_budget_s is not None and not time_budget_s > 0:  # NaN: a budget never reached
        raise ConfigError(f"the time budget must be > 0 minutes, got {time_budget_s / 60:g}")
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise DataError("the refiner's training dataset is empty; check --data and --split")
    meta_classes = getattr(getattr(dataset, "meta", None), "class_names", None)
    if meta_classes is not None and len(meta_classes) != len(class_names):  # before any step
        raise ConfigError(
            f"the dataset has {len(meta_classes)} classes and the refiner {len(class_names)} "
            "class names: pass dataset.meta.class_names"
        )
    params = [p for p in net.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        if cfg.optimizer == "sgd"
        else torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    )
    start, history = 0, []
    ckpt_path = Path(checkpoint) if checkpoint is not None else None
    if resume and ckpt_path is not None and ckpt_path.is_file():
        start, history = _resume(ckpt_path, net, opt, cfg, class_names, fit_inputs)

    def save(step: int) -> None:
        if ckpt_path is not None:
            state = {"format": TRAIN_FORMAT, "step": step, "model": net.state_dict(),
                     "optimizer": opt.state_dict(), "config": cfg.to_dict(),
                     "class_names": list(class_names), "history": history,
                     "fit_inputs": None if fit_inputs is None else dict(fit_inputs)}  # fmt: skip
            atomic_torch_save(state, ckpt_path)

    loader = torch.utils.data.DataLoader(
        _EpochView(dataset),
        batch_sampler=list(_batches(len(dataset), cfg.batch_size, cfg.seed, start, cfg.steps)),  # type: ignore[arg-type]
        num_workers=num_workers,
    )
    history = _run_steps(
        net, opt, loader, cfg, start, history, save, device=device, num_classes=len(class_names),
        ignore_index=ignore_index, progress=progress, log_every=log_every,
        checkpoint_every=checkpoint_every, time_budget_s=time_budget_s,
    )  # fmt: skip
    net.eval()
    if not any(h.get("num_triplets", 1) for h in history):  # an untrained embedding
        raise DataError(
            f"no triplet could be drawn in {len(history)} steps: no training image has "
            "near-boundary pixels of two classes; check the labels and their mapping "
            "(meta.json, --label-map, --ignore-index) and --radius"
        )
    return history


def _run_steps(
    net: EmbeddingNet, opt: torch.optim.Optimizer, loader: Any, cfg: RefinerConfig, start: int,
    history: list[dict[str, float]], save: Any, *, device: torch.device, num_classes: int,
    ignore_index: int, progress: bool, log_every: int, checkpoint_every: int,
    time_budget_s: float | None,
) -> list[dict[str, float]]:  # fmt: skip
    """The triplet steps ``start..cfg.steps``."""
    net.train()
    started = time.monotonic()
    reached = start
    bar = tqdm(loader, total=cfg.steps, initial=start, desc="refine fit", disable=not progress)
    with Interrupt() as interrupted:
        for step, (images, labels) in enumerate(bar, start=start):
            require_class_labels(labels, num_classes, ignore_index, "the training images")
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            stats = triplet_step(
                net, opt, images.to(device), labels.to(device), generator=gen,
                radius=cfg.radius, edge_method=cfg.edge_method, num_triplets=cfg.num_triplets,
                margin=cfg.margin, reduction=cfg.reduction, mining=cfg.mining,
                mining_pool=cfg.mining_pool, input_scale=cfg.input_scale,
                output_stride=cfg.output_stride, ignore_index=ignore_index,
            )  # fmt: skip
            history.append({"step": step + 1, **stats})
            bar.set_postfix(loss=f"{stats['loss']:.3f}", viol=f"{stats['violating']:.2f}",
                            margin=f"{stats['margin']:.2f}")  # fmt: skip
            if log_every and (step + 1) % log_every == 0:
                v, m = 100 * stats["violating"], stats["margin"]
                bar.write(f"[{step + 1}/{cfg.steps}] triplet loss {stats['loss']:.4f}, "
                          f"violating {v:.1f}%, margin {m:.3f}")  # fmt: skip
            reached = step + 1
            if reached % max(1, checkpoint_every) == 0:
                save(reached)
            if interrupted():
                break
            if time_budget_s is not None and time.monotonic() - started >= time_budget_s:
                if reached < cfg.steps:
                    log.warning("refiner time budget (%.1f min) reached at step %d of %d",
                                time_budget_s / 60, reached, cfg.steps)  # fmt: skip
                break
    bar.close()
    if reached > start:
        save(reached)
    if interrupted():
        log.info("refiner training interrupted at step %d; --resume continues it", reached)
        raise Terminated if interrupted.signum == signal.SIGTERM else KeyboardInterrupt
    return history


def embedding_net(
    cfg: RefinerConfig, *, weights: str | os.PathLike[str] | None = None
) -> EmbeddingNet:
    """The step-3 model ``cfg`` describes (``weights``: backbone initialization)."""
    return build_embedding_net(
        cfg.backbone, embed_dim=cfg.embed_dim, output_stride=cfg.output_stride,
        aspp_rates=cfg.aspp_rates, weights=weights, decoder_channels=cfg.decoder_channels,
        freeze_backbone=cfg.backbone_source == "base-frozen",
    )  # fmt: skip


def prepare_net(
    cfg: RefinerConfig, *, base: nn.Module | None,
    init_from: nn.Module | Mapping[str, Tensor] | None,
    weights: str | os.PathLike[str] | None, device: torch.device,
) -> tuple[RefinerConfig, EmbeddingNet, TapRecord | None]:  # fmt: skip
    """Step 3's model on ``device``: on the base's taps (``cfg.base_features``, which then set
    the embedding's input and stride), or its own backbone (``init_from``: the base's)."""
    if cfg.base_features is not None:
        if not isinstance(base, nn.Module):
            raise ConfigError(
                "base_features reads modules of the base model: pass the model itself (base=model; "
                "on the CLI --base CHECKPOINT or --base file.py:NAME)"
            )
        base.to(device)
        names, found = cfg.base_features, list_taps(base)  # on a sample on base's device
        if names == ("auto",):
            names = pick_taps(base, found, high_stride=cfg.output_stride)
            if names is None:
                raise ConfigError(
                    f"no taps could be picked in a {type(base).__name__}: give them "
                    "(--base-features LOW HIGH); 'dualseg refine layers' lists the candidates"
                )
        taps = measure_taps(found, names)
        cfg = dataclasses.replace(
            cfg, base_features=taps.names, backbone="base", backbone_source="base-frozen",
            input_scale=1.0, output_stride=taps.strides[1],
        )  # fmt: skip
        with seeded(cfg.seed):
            net = tap_embedding_net(taps, embed_dim=cfg.embed_dim, aspp_rates=cfg.aspp_rates,
                                    decoder_channels=cfg.decoder_channels)  # fmt: skip
        net.backbone.attach(base)
        return cfg, net.to(device), taps
    if cfg.backbone_source != "independent" and init_from is None:
        raise ConfigError(
            f"backbone_source={cfg.backbone_source!r} takes the base model's backbone: pass "
            "the base model (init_from; on the CLI --base CHECKPOINT)"
        )
    with seeded(cfg.seed):  # the random head (and backbone) too: one seed, one refiner
        net = embedding_net(cfg, weights=weights)
    if init_from is not None:  # the base's whole backbone, or refused
        init_backbone_from(net.backbone, init_from, strict=True)
    return cfg, net.to(device), None


def check_prototypes(protos: Tensor, present: Tensor, class_names: Sequence[str]) -> None:
    """Step 5's outcome: at least two classes have a prototype; collapsed ones are warned of."""
    missing = [n for n, p in zip(class_names, present.tolist()) if not p]
    if len(class_names) - len(missing) < 2:  # nothing to choose between
        raise DataError(
            f"only {len(class_names) - len(missing)} class(es) have near-boundary pixels in "
            "the prototype images; method B chooses among at least two: check the labels "
            "and their mapping (meta.json, --label-map, --ignore-index)"
        )
    if missing:
        log.warning("no near-boundary pixels for %s: these classes get no prototype", missing)
    same = coinciding_prototypes(protos, present, class_names)
    if same:
        log.warning(
            "the prototypes of %s coincide (to 1e-4 of their length): the embedding has "
            "collapsed, and this refiner would pick between these classes on rounding "
            "noise; fit longer (--steps) or from ImageNet weights (--init-backbone imagenet)",
            " and ".join("/".join(pair) for pair in same[:3])
            + (f" and {len(same) - 3} more pairs" if len(same) > 3 else ""),
        )


def coinciding_prototypes(
    prototypes: Tensor, present: Tensor, class_names: Sequence[str], *, rtol: float = 1e-4
) -> list[tuple[str, str]]:
    """The pairs of present classes whose prototypes lie within ``rtol`` of their mean length of
    each other: a collapsed embedding (a healthy one keeps its closest pair ~0.1 apart)."""
    index = present.nonzero().flatten()
    protos = prototypes[index].float()
    if len(protos) < 2:
        return []
    scale = float(protos.norm(dim=1).mean())
    close = torch.cdist(protos, protos) <= rtol * max(scale, 1e-12)
    rows, cols = torch.triu_indices(len(protos), len(protos), 1)
    return [
        (class_names[int(index[i])], class_names[int(index[j])])
        for i, j in zip(rows.tolist(), cols.tolist())
        if close[i, j]
    ]
