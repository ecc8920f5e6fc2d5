"""Shared fixtures. Tests run on CPU, single-threaded torch, tiny sizes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Keep the suite predictable on 2 shared cores: one intra-op thread per test process.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
CAMVID = Path(os.environ.get("DUALSEG_CAMVID", REPO.parent / "shared" / "data" / "camvid"))


@pytest.fixture
def camvid_root() -> Path:
    """The real CamVid folder beside the checkout; tests using it skip when it is absent."""
    if not (CAMVID / "val.txt").is_file():
        pytest.skip(f"CamVid not found at {CAMVID} (set DUALSEG_CAMVID to its folder)")
    return CAMVID


@pytest.fixture(scope="module")
def camvid():
    """benchmarks/camvid.py, imported as a module."""
    from benchmark_helpers import load_benchmark

    return load_benchmark("camvid")


@pytest.fixture(autouse=True)
def _seed() -> None:
    np.random.seed(0)
    torch.manual_seed(0)
