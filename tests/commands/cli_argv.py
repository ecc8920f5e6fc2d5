"""Command lines the mistake tests start from, on the ``files`` fixture (conftest.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_synthetic.yaml"


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def first_image(files: dict[str, Path]) -> Path:
    return files["data"] / "images" / "train_00000.png"


def train_argv(files: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """``dualseg train`` on TINY; ``--config X`` pairs in ``extra`` go right after TINY's (a
    flag before a --config that sets it again is refused)."""
    configs = [a for i, a in enumerate(extra) if "--config" in extra[max(i - 1, 0) : i + 1]]
    rest = [a for a in extra if a not in configs]
    return ["train", "--config", str(TINY), *configs, "--data.root", str(files["data"]),
            "--quiet", "--data.crop_size", "[32, 32]", "--train.out_dir", str(out),
            *rest]  # fmt: skip


def fit_argv(files: dict[str, Path], *extra: str) -> list[str]:
    return ["refine", "fit", "--data", str(files["data"]), "--base", str(files["ckpt"]),
            "--init-backbone", "none", "--steps", "1", "--device", "cpu", "-q", *extra]  # fmt: skip
