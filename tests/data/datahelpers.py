"""Helpers for tests/data: write tiny datasets (a few 16x24 pairs) into tmp_path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from dualseg.data import DatasetMeta

TINY = DatasetMeta(
    name="tiny",
    class_names=("a", "b", "c", "d"),
    palette=((200, 0, 0), (0, 200, 0), (0, 0, 200), (200, 200, 0)),
    source_ignore=(9,),
    void_colors=((0, 0, 0),),
)


def save(path: Path, array: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)
    return path


def random_pair(
    rng: np.random.Generator, size=(16, 24), classes=4
) -> tuple[np.ndarray, np.ndarray]:
    image = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
    label = rng.integers(0, classes, size, dtype=np.uint8)
    return image, label


def write_list_dataset(root: Path, n: int = 3, *, split: str = "train", size=(16, 24)) -> Path:
    """CamVid-style: ``split.txt`` with 'images/x.png labels/x.png' lines."""
    rng = np.random.default_rng(len(split) + n)
    lines = []
    for i in range(n):
        image, label = random_pair(rng, size)
        save(root / split / f"{i}.png", image)
        save(root / f"{split}annot" / f"{i}.png", label)
        lines.append(f"{split}/{i}.png {split}annot/{i}.png\n")
    (root / f"{split}.txt").write_text("".join(lines))
    return root
