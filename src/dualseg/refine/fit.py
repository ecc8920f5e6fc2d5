"""Training the embedding model (method B, step 4): a fixed number of triplet-hinge steps
(or fewer, within a time budget).

Batches are drawn by (seed, pass over the data), so a resumed run (``checkpoint`` +
``resume=True``) draws exactly the batches it would have drawn; the training state is one file
(``TRAIN_FORMAT``) with the weights, optimizer, configuration, class names and loss history.
One step is :func:`dualseg.refine.triplet.triplet_step`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dualseg.engine.runlog import Interrupt
from dualseg.errors import CheckpointError, ConfigError, DataError, Terminated
from dualseg.io import atomic_torch_save
from dualseg.refine.calibrate import DECISION_KEYS
from dualseg.refine.embedding import EmbeddingNet
from dualseg.refine.formats import TRAIN_FORMAT, load_state
from dualseg.refine.prototypes import require_class_labels
from dualseg.refine.triplet import triplet_step

if TYPE_CHECKING:  # pragma: no cover
    from dualseg.refine.refiner import RefinerConfig

log = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "sgd")


def _make_optimizer(net: nn.Module, cfg: RefinerConfig) -> torch.optim.Optimizer:
    params = [p for p in net.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _batches(
    n: int, batch_size: int, seed: int, start_step: int, steps: int
) -> Iterator[list[tuple[int, int]]]:
    """``(pass, index)`` batches for steps ``start_step..steps-1``: a fresh permutation per
    pass over the data, seeded by (seed, pass), so a resumed run draws the batches it would
    have drawn."""
    per_epoch = max(1, n // batch_size) if n >= batch_size else 1
    for step in range(start_step, steps):
        epoch, k = divmod(step, per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        yield [(epoch, i) for i in perm[k * batch_size : (k + 1) * batch_size].tolist()]


class _EpochView(torch.utils.data.Dataset):
    """``view[(pass, i)] = dataset[i]`` with the dataset's augmentation seeded for that pass
    (``set_epoch``, when it has one), also inside DataLoader workers: each pass over the data
    sees new augmentations."""

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
    """Refuse a resume whose data, augmentation or base differ from the checkpoint's; when
    either side records none (a file written before they were recorded, or a fit from Python
    without ``fit_inputs``), there is nothing to compare."""
    if saved is None or given is None:
        if saved is None and given is not None:
            log.warning("%s does not record its data and base; resuming without checking", path)
        return
    list_file = Path(str(given.get("data"))).is_file()
    if list_file and saved.get("split") == "train" != given.get("split"):
        # a list file as --data names its own split (val.txt is val); a state written before
        # recorded the default, train, for it
        saved = {**saved, "split": given.get("split")}
    changed = [k for k in sorted(set(saved) | set(given)) if saved.get(k) != given.get(k)]
    if changed:

        def shown(key: str, value: Any) -> str:
            if key == "base" and value is None:  # --base given or not: it was not read
                return (
                    "no base read (only --init-backbone base or a base-* --backbone-source "
                    "reads --base)"
                )
            return repr(value)

        what = "; ".join(
            f"{k}: {shown(k, saved.get(k))} then, {shown(k, given.get(k))} now" for k in changed
        )
        raise CheckpointError(
            f"{path} was fitted on other inputs ({what}); resume with the same ones, or "
            "delete it to start over"
        )


# options the embedding's training never reads: a resume may change them (--steps: train longer)
RESUMABLE_CHANGES = ("steps", "top_n", *DECISION_KEYS)


def train_embedding(
    net: EmbeddingNet,
    dataset: torch.utils.data.Dataset,
    cfg: RefinerConfig,
    *,
    class_names: Sequence[str],
    device: torch.device,
    num_workers: int = 0,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 200,
    resume: bool = False,
    progress: bool = True,
    log_every: int = 0,
    ignore_index: int = 255,
    time_budget_s: float | None = None,
    fit_inputs: Mapping[str, Any] | None = None,
) -> list[dict[str, float]]:
    """Step 4: ``cfg.steps`` optimizer steps of the sampled triplet hinge. Returns the history
    (one dict per step: step, loss, violating, margin, num_triplets, pixels). ``log_every``:
    also print one line every that many steps (for logs without a progress bar).
    ``time_budget_s``: stop after the step that passes this many seconds of this call, fewer
    steps than ``cfg.steps`` (the checkpoint records the step reached, so ``resume`` goes on).
    ``fit_inputs``: what else the run depends on (data, split, augmentation, base model: plain
    JSON values), recorded in the checkpoint; a resume with other values is refused."""
    from tqdm.auto import tqdm

    if time_budget_s is not None and not time_budget_s > 0:  # NaN: a budget never reached
        raise ConfigError(f"the time budget must be > 0 minutes, got {time_budget_s / 60:g}")

    if len(dataset) == 0:  # type: ignore[arg-type]
        raise DataError("the refiner's training dataset is empty; check --data and --split")
    opt = _make_optimizer(net, cfg)
    start, history = 0, []
    ckpt_path = Path(checkpoint) if checkpoint is not None else None
    if resume and ckpt_path is not None and ckpt_path.is_file():
        state = load_state(ckpt_path, TRAIN_FORMAT, "refiner training checkpoint")
        # the step count may grow on resume (train longer), and the inference options (which
        # the training never reads) may change; every other option must agree
        saved = type(cfg).from_dict(state["config"])
        changed = [
            f"{f.name} {getattr(saved, f.name)!r} -> {getattr(cfg, f.name)!r}"
            for f in dataclasses.fields(cfg)
            if f.name not in RESUMABLE_CHANGES and getattr(saved, f.name) != getattr(cfg, f.name)
        ]
        if list(state["class_names"]) != list(class_names):
            changed.append("the class names")
        if changed:
            raise CheckpointError(
                f"{ckpt_path} was written with other options ({'; '.join(changed)}); resume "
                "with the same options (--steps and the inference options --top-n, "
                "--gate-margin, --prior-weight, --min-prob, --p1-blur-sigma may change), or "
                "delete it to start over"
            )
        if int(state["step"]) > cfg.steps:
            raise CheckpointError(
                f"{ckpt_path} has trained {int(state['step'])} steps already, more than "
                f"--steps {cfg.steps}; resume with --steps {int(state['step'])} or more"
            )
        _require_same_inputs(ckpt_path, state.get("fit_inputs"), fit_inputs)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start, history = int(state["step"]), list(state["history"])
        log.info("resuming refiner training from step %d (%s)", start, ckpt_path)

    def save(step: int) -> None:
        if ckpt_path is None:
            return
        atomic_torch_save(
            {
                "format": TRAIN_FORMAT,
                "step": step,
                "model": net.state_dict(),
                "optimizer": opt.state_dict(),
                "config": cfg.to_dict(),
                "class_names": list(class_names),
                "history": history,
                "fit_inputs": None if fit_inputs is None else dict(fit_inputs),
            },
            ckpt_path,
        )

    meta_classes = getattr(getattr(dataset, "meta", None), "class_names", None)
    if meta_classes is not None and len(meta_classes) != len(class_names):  # before any step
        raise ConfigError(
            f"the dataset has {len(meta_classes)} classes and the refiner {len(class_names)} "
            "class names: pass the dataset's (class_names=dataset.meta.class_names)"
        )
    loader = torch.utils.data.DataLoader(
        _EpochView(dataset),
        batch_sampler=list(_batches(len(dataset), cfg.batch_size, cfg.seed, start, cfg.steps)),  # type: ignore[arg-type]
        num_workers=num_workers,
    )
    net.train()
    started = time.monotonic()
    reached = start
    bar = tqdm(loader, total=cfg.steps, initial=start, desc="refine fit", disable=not progress)
    # Ctrl-C / SIGTERM: the step under way finishes, its state is saved, then the fit stops
    # (it lost up to checkpoint_every - 1 steps); a second Ctrl-C stops at once
    with Interrupt() as interrupted:
        for step, (images, labels) in enumerate(bar, start=start):
            require_class_labels(labels, len(class_names), ignore_index, "the training images")
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            stats = triplet_step(
                net, opt, images.to(device), labels.to(device), cfg, gen, ignore_index
            )
            history.append({"step": step + 1, **stats})
            bar.set_postfix(
                loss=f"{stats['loss']:.3f}",
                viol=f"{stats['violating']:.2f}",
                margin=f"{stats['margin']:.2f}",
            )
            if log_every and (step + 1) % log_every == 0:
                bar.write(
                    f"[{step + 1}/{cfg.steps}] triplet loss {stats['loss']:.4f}, violating "
                    f"{100 * stats['violating']:.1f}%, margin {stats['margin']:.3f}"
                )
            reached = step + 1
            if reached % max(1, checkpoint_every) == 0:
                save(reached)
            if interrupted():
                break
            if time_budget_s is not None and time.monotonic() - started >= time_budget_s:
                if reached < cfg.steps:
                    log.warning(
                        "refiner time budget (%.1f min) reached at step %d of %d",
                        time_budget_s / 60,
                        reached,
                        cfg.steps,
                    )
                break
    bar.close()
    if reached > start:
        save(reached)
    if interrupted():
        log.info("refiner training interrupted at step %d; --resume continues it", reached)
        raise Terminated if interrupted.signum == signal.SIGTERM else KeyboardInterrupt
    net.eval()
    return history
