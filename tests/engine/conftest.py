"""Fixtures of the engine tests: a saved random synthetic-data network and its Segmenter."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoint_helpers import write_synthetic_checkpoint
from dualseg.engine.predict import Segmenter, load_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt") / "model.pt")


@pytest.fixture(scope="module")
def seg(ckpt: Path) -> Segmenter:
    return load_model(ckpt)
