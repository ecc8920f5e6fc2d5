"""Helpers of the reliability tests: tiny datasets and checkpoints written into tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dualseg.data import DatasetMeta

BINARY = DatasetMeta(
    name="binary", class_names=("background", "object"), palette=((0, 0, 0), (255, 255, 255))
)
FOUR = DatasetMeta(
    name="four",
    class_names=("a", "b", "c", "d"),
    palette=((200, 0, 0), (0, 200, 0), (0, 0, 200), (200, 200, 0)),
)


def save(path: Path, array: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)
    return path


def write_dataset(
    root: Path,
    labels: dict[str, list[np.ndarray]],
    *,
    meta: DatasetMeta | dict | None = None,
) -> Path:
    """A list-layout dataset: ``{split: [label arrays]}`` with random 32x32 images."""
    rng = np.random.default_rng(0)
    for split, arrays in labels.items():
        lines = []
        for i, label in enumerate(arrays):
            image = rng.integers(0, 256, (*label.shape[:2], 3), dtype=np.uint8)
            save(root / split / f"{i}.png", image)
            save(root / f"{split}annot" / f"{i}.png", label)
            lines.append(f"{split}/{i}.png {split}annot/{i}.png\n")
        (root / f"{split}.txt").write_text("".join(lines))
    if meta is not None:
        d = meta.to_dict() if isinstance(meta, DatasetMeta) else meta
        (root / "meta.json").write_text(json.dumps(d))
    return root


def binary_masks(n: int, size: int = 32) -> list[np.ndarray]:
    """0/255 masks: a white square on black (the usual binary-dataset format)."""
    out = []
    for i in range(n):
        mask = np.zeros((size, size), np.uint8)
        mask[4 + i : 20 + i, 6:22] = 255
        out.append(mask)
    return out


def class_maps(n: int, classes: int, size: int = 32) -> list[np.ndarray]:
    """Label maps with vertical stripes of classes 0..classes-1."""
    stripe = (np.arange(size) * classes // size).astype(np.uint8)
    return [np.broadcast_to(stripe, (size, size)).copy() for _ in range(n)]


def write_checkpoint(path: Path, class_names: tuple[str, ...]) -> Path:
    """An untrained tiny dual-branch checkpoint predicting ``class_names``."""
    from checkpoint_helpers import contract
    from dualseg.engine.checkpoint import save_checkpoint
    from dualseg.models import build_model

    kwargs = {"num_classes": len(class_names), "renet_hidden": 8}
    model = build_model("dualseg_mobilenet_v2", weights=None, **kwargs)
    save_checkpoint(
        path,
        {
            "arch": "dualseg_mobilenet_v2",
            "model_kwargs": kwargs,
            "model": model.state_dict(),
            "class_names": list(class_names),
            "label_contract": contract(class_names),
        },
    )
    return path


def tree(root: Path) -> list[str]:
    """Every path under ``root`` (to assert that nothing was written)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one stderr line a refused command printed: no traceback, no second line."""
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``dualseg argv``, expect exit status 1 (returned, or argparse's exit while the
    line is parsed), and return its one stderr line."""
    from dualseg.cli import main

    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 1
    return one_line(capsys)
