"""One bound on seeds, checked the same way everywhere a seed is given (augment_defaults)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualseg.augment_defaults import SEED_LIMIT, seed_error
from dualseg.data.augment import augment_dataset
from dualseg.engine.config import load_config
from dualseg.engine.options import validate
from dualseg.errors import ConfigError, DataError
from dualseg.refine.refiner import RefinerConfig

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_synthetic.yaml"


def test_seed_error_names_the_option_and_the_exact_range() -> None:
    assert seed_error(0, "--seed") is None
    assert seed_error(SEED_LIMIT - 1, "--seed") is None
    assert seed_error(SEED_LIMIT, "--seed") == "--seed must be in 0..4294967295, got 4294967296"
    assert seed_error(-1, "train.seed") == "train.seed must be in 0..4294967295, got -1"


@pytest.mark.parametrize("seed", [-1, SEED_LIMIT])
def test_every_seed_option_refuses_the_same_values(seed: int, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^train\.seed must be in 0\.\.4294967295"):
        validate(load_config(TINY, train={"seed": seed}))
    with pytest.raises(ConfigError, match=r"^seed must be in 0\.\.4294967295"):
        RefinerConfig(seed=seed)
    dst = tmp_path / "aug"
    with pytest.raises(DataError, match=r"^--seed must be in 0\.\.4294967295"):
        augment_dataset(tmp_path / "missing", dst, count=1, seed=seed)
    assert not dst.exists()  # refused before anything is read or written


def test_the_largest_seed_is_accepted() -> None:
    validate(load_config(TINY, train={"seed": SEED_LIMIT - 1}))
    assert RefinerConfig(seed=SEED_LIMIT - 1).seed == SEED_LIMIT - 1
