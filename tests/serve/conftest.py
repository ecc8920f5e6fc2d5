"""Fixtures of the serve tests: fake segmenter and refiner (see serve_fakes.py)."""

from __future__ import annotations

import pytest
from serve_fakes import BrightnessSegmenter, TopRowRefiner


@pytest.fixture
def segmenter() -> BrightnessSegmenter:
    return BrightnessSegmenter()


@pytest.fixture
def refiner() -> TopRowRefiner:
    return TopRowRefiner()
