"""The small dataset and checkpoint the command-line mistake tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoint_helpers import write_synthetic_checkpoint
from dualseg.data import make_synthetic_dataset


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mistakes")
    data = make_synthetic_dataset(root / "data", n_train=2, n_val=2, size=(32, 48))
    return {"root": root, "data": data, "ckpt": write_synthetic_checkpoint(root / "model.pt")}
