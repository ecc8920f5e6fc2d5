"""Label maps the metric tests share."""

from __future__ import annotations

import torch

IGN = 255
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def t(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def blobby(gen: torch.Generator, b: int, h: int, w: int, c: int, ignore_frac: float = 0.0):
    """Random piecewise-constant label maps (coarse grid upsampled) with some ignore pixels."""
    coarse = torch.randint(0, c, (b, 1, h // 8, w // 8), generator=gen).float()
    lab = torch.nn.functional.interpolate(coarse, size=(h, w), mode="nearest")[:, 0].long()
    if ignore_frac:
        lab[torch.rand(lab.shape, generator=gen) < ignore_frac] = IGN
    return lab


def step_case() -> tuple[torch.Tensor, torch.Tensor]:
    # GT: edge between columns 3|4 in every row. Prediction: the same in rows 0-1, moved to
    # columns 5|6 in rows 2-3.
    target = t([[0, 0, 0, 0, 1, 1, 1, 1]] * 4)
    pred = t([[0, 0, 0, 0, 1, 1, 1, 1]] * 2 + [[0, 0, 0, 0, 0, 0, 1, 1]] * 2)
    return pred, target
