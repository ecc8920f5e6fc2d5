"""Fixtures of tests/data (helpers live in datahelpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from datahelpers import TINY, write_list_dataset

from dualseg.data import DatasetMeta


@pytest.fixture
def tiny_meta() -> DatasetMeta:
    return TINY


@pytest.fixture
def list_root(tmp_path: Path) -> Path:
    root = tmp_path / "ds"
    write_list_dataset(root, 3, split="train")
    write_list_dataset(root, 2, split="val")
    return root
