"""The CamVid benchmark's report: results.json merged with earlier calls' rows, results.md,
and the figures (per-class IoU, loss and learning curves, qualitative panels)."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from camvid_protocols import LABELS, VARIANTS

from dualseg.errors import ConfigError
from dualseg.io import atomic_write_bytes, atomic_write_text
from dualseg.viz import save_figure

# flags that change no model's figures: results.json may hold models evaluated under others
# (--crf adds a row beside a base's own, which stay as they were)
MERGE_FREE = ("models", "reuse", "train_only", "panels", "out", "crf")


def args_record(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as results.json keeps them (tuples as lists, as JSON reads them back)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()}


def evaluated_models(results: dict[str, Any]) -> set[str]:
    """The models with rows in ``results`` (row keys: ``name`` and ``name+B...``)."""
    return {key.split("+")[0] for rows in results.get("splits", {}).values() for key in rows}


def earlier_results(out: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``results.json`` in ``out`` when it holds models this call does not evaluate: their
    rows are kept beside this call's (one model per call into one ``--out``, as the ablation
    commands run). Refused (:class:`ConfigError`, before any work) when those models were
    evaluated under other flags than this call's, which would put rows of two settings in one
    table; ``None`` when there is nothing to keep."""
    path = out / "results.json"
    if not path.is_file():
        return None
    old = json.loads(path.read_text())
    others = sorted(evaluated_models(old) - set(args.models))
    if not others:
        return None  # this call evaluates all of them again
    theirs, ours = old.get("args", {}), args_record(args)
    for key, want in ours.items():
        if key not in MERGE_FREE and theirs.get(key) != want:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(
                f"{path} holds {', '.join(others)} evaluated with {flag} "
                f"{theirs.get(key)!r}, this call has {want!r}: rerun with that call's flags to "
                "add to its table, or use one --out per setting"
            )
    return old


def merge_results(results: dict[str, Any], old: dict[str, Any], models: list[str]) -> list[str]:
    """Into ``results``, the rows, training records and dev sweeps of the models in ``old``
    that this call did not evaluate (``models``), each model's own entries as they were; rows
    in the order of :data:`VARIANTS`. Returns the models kept from ``old``."""
    order = list(VARIANTS)
    kept = sorted(evaluated_models(old) - set(models), key=order.index)

    def model_of(key: str) -> str:
        return key.split("+")[0]

    for split, rows in results["splits"].items():
        earlier = {k: v for k, v in old["splits"].get(split, {}).items() if model_of(k) in kept}
        merged = {**earlier, **rows}
        results["splits"][split] = dict(
            sorted(merged.items(), key=lambda kv: order.index(model_of(kv[0])))
        )
    refined = {model_of(k) for rows in old["splits"].values() for k in rows if "+" in k}
    for key, record in old.get("train", {}).items():
        name = key.removeprefix("method_b_")
        shared = name == "all" and refined & set(kept)  # the one refiner of kept rows
        if name in kept or (shared and key not in results["train"]):
            results["train"][key] = record
    for sweeps in ("decision_sweep_dev", "crf_sweep_dev"):
        for name, sweep in old.get(sweeps, {}).items():
            if name in kept:
                results.setdefault(sweeps, {})[name] = sweep
    if kept:
        results["models_from_earlier_calls"] = kept
    return kept


def write_table(results: dict[str, Any], path: Path) -> str:
    lines = []
    for split, rows in results["splits"].items():
        lines += [
            f"**CamVid {split}** (full 360x480; {results['budget']})",
            "",
            "| model | mIoU | boundary F1 (3 px) | trimap mIoU (5 px) | pixel acc | ms / image "
            "| pixels fixed / broken |",
            "|---|---|---|---|---|---|---|",
        ]
        for _name, r in rows.items():
            ms = r.get("ms_per_image")
            c = r.get("refine")  # refined rows: changes from wrong to right / right to wrong
            moved = "" if c is None else f"{c['fixed']} / {c['broke']}"
            lines.append(
                f"| {r['label']} | {100 * r['miou']:.1f} | {100 * r['boundary_f1']:.1f} | "
                f"{100 * r['trimap_miou']:.1f} | {100 * r['pixel_acc']:.1f} | "
                f"{'' if ms is None else f'{ms:.0f}'} | "
                f"{moved} |"
            )
        lines.append("")
    text = "\n".join(lines)
    atomic_write_text(path, text + "\n")
    return text


def save_bar_chart(results: dict[str, Any], class_names: list[str], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = results["splits"]["val"]
    fig = Figure(figsize=(12, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    width = 0.8 / len(rows)
    x = np.arange(len(class_names))
    for i, (_, r) in enumerate(rows.items()):
        iou = np.array([np.nan if v is None else v for v in r["iou"]], dtype=float)
        ax.bar(x + i * width, 100 * np.nan_to_num(iou), width, label=r["label"])
    ax.set_xticks(x + 0.4 - width / 2, class_names, rotation=30, ha="right")
    ax.set_ylabel("IoU (%)")
    ax.set_title("CamVid val: per-class IoU")
    ax.legend(fontsize=7, ncols=2)
    save_figure(fig, path)


def save_curves(out: Path, names: list[str], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name in names:
        log = out / "runs" / name / "metrics.jsonl"
        if not log.exists():
            continue
        recs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        pts = [(r["iteration"], r["loss"]) for r in recs if "loss" in r and "iteration" in r]
        if pts:
            it, loss = zip(*pts)
            ax.plot(it, loss, label=LABELS[name])
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss L = L1 + L2")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def save_learning_curves(
    train: dict[str, Any],
    path: Path,
    *,
    time_label: str = "training wall-clock minutes (2-core CPU)",
    title: str = "Learning curves (plateau protocol)",
) -> None:
    """Dev mIoU against iterations and against training minutes, every model in one figure.

    A record with ``"time_axis": False`` is drawn against iterations only (its minutes are not
    comparable, e.g. a run paused part of the time). ``time_label``: what the minutes of the
    records' dev curves are."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curves = [(name, rec) for name, rec in train.items() if rec.get("dev_curve")]
    fig = Figure(figsize=(13, 4.6) if len(curves) > 8 else (11, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    by_iter, by_time = fig.subplots(1, 2, sharey=True)
    colours = colormaps["tab20"].colors if len(curves) > 10 else [f"C{i}" for i in range(10)]
    for i, (name, rec) in enumerate(curves):
        it, minutes, miou = zip(*rec["dev_curve"])
        # 10 or 20 colours, then dashed: no two runs drawn alike
        style = {
            "color": colours[i % len(colours)],
            "linestyle": "-" if i < len(colours) else "--",
            "marker": ".",
        }
        label = LABELS.get(name, name)
        by_iter.plot(it, [100 * v for v in miou], label=label, **style)
        if rec.get("time_axis", True):
            by_time.plot(minutes, [100 * v for v in miou], label=label, **style)
    by_iter.set_xlabel("iteration")
    by_time.set_xlabel(time_label)
    by_iter.set_ylabel("dev mIoU (%) — dev: held out of CamVid train")
    if len(curves) > 8:
        fig.legend(*by_iter.get_legend_handles_labels(), loc="outside right", fontsize=7)
    else:
        by_iter.legend(fontsize=7)
    by_iter.grid(alpha=0.3)
    by_time.grid(alpha=0.3)
    fig.suptitle(title)
    buf = io.BytesIO()  # not save_figure: its tight layout would undo the constrained one
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())


def save_panels(
    models: dict[str, Any],
    refiner: Any,
    loader: Any,
    meta: Any,
    n: int,
    out: Path,
    device: torch.device,
) -> list[str]:
    from dualseg.viz import colorize, denormalize, save_panel

    written = []
    picks = set(np.linspace(0, len(loader.dataset) - 1, n).astype(int).tolist())
    with torch.inference_mode():
        for i, (x, y) in enumerate(loader):
            if i not in picks:
                continue
            x = x.to(device)
            images = [denormalize(x[0].cpu()), colorize(y[0].numpy(), meta.palette)]
            titles = ["image", "ground truth"]
            for name, title in (("peer", "peer (DeepLabV3)"), ("dualseg", "method A")):
                if name in models:
                    images.append(
                        colorize(models[name](x).argmax(1)[0].cpu().numpy(), meta.palette)
                    )
                    titles.append(title)
            if refiner is not None and "dualseg" in models:
                probs = models["dualseg"](x).softmax(1)
                images.append(colorize(refiner.refine(x, probs)[0].cpu().numpy(), meta.palette))
                titles.append("method A + B")
            path = out / f"panel_{len(written)}.png"
            save_panel(path, images, titles, class_names=meta.class_names, palette=meta.palette)
            written.append(path.name)
    return written
