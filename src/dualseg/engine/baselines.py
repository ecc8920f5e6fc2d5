"""Trivial baselines the demo scores beside the trained model: models that ignore the image."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dualseg.data.readers import read_label


class PriorModel(nn.Module):
    """A 'model' that ignores the image: fixed class scores per position, resized to the input."""

    def __init__(self, scores: Tensor) -> None:  # [C, h, w]
        super().__init__()
        self.register_buffer("scores", scores.float())

    def forward(self, x: Tensor) -> Tensor:
        s = F.interpolate(self.scores[None], size=x.shape[-2:], mode="nearest")
        return s.expand(x.shape[0], -1, -1, -1)


def baseline_models(
    label_paths: list[Path], meta: Any, *, label_format: str = "index", grid: int = 64
) -> dict[str, PriorModel]:
    """``{"most_frequent_class", "majority_per_position"}`` baselines from training labels
    (of any size: counted on a ``grid`` x ``grid`` map of relative positions)."""
    c = meta.num_classes
    counts = torch.zeros(c + 1, grid, grid, dtype=torch.float64)  # last bin: ignore
    for path in label_paths:
        lab = torch.from_numpy(read_label(path, meta, label_format=label_format).astype(np.int64))
        lab = F.interpolate(lab[None, None].float(), size=(grid, grid), mode="nearest")[0, 0]
        lab = lab.long().clamp(max=c)  # 255 -> c
        counts += F.one_hot(lab, c + 1).permute(2, 0, 1)
    counts = counts[:c]  # fit's data scan refused labels without a labelled pixel
    per_position = F.one_hot(counts.argmax(0), c).permute(2, 0, 1)
    most_frequent = F.one_hot(counts.sum((1, 2)).argmax(), c).view(c, 1, 1)
    return {
        "most_frequent_class": PriorModel(most_frequent),
        "majority_per_position": PriorModel(per_position),
    }
