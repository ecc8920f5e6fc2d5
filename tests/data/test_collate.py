"""SameSizeCollate: torch's default collate for same-size samples, one DataError line else."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from dualseg.data.collate import SameSizeCollate
from dualseg.errors import DataError


def _sample(h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(3, h, w), torch.zeros(h, w, dtype=torch.long)


def test_same_size_samples_collate_as_torch_does() -> None:
    batch = [_sample(4, 6), _sample(4, 6)]
    images, labels = SameSizeCollate()(batch)
    assert images.shape == (2, 3, 4, 6) and labels.shape == (2, 4, 6)


def test_mixed_sizes_name_both_sizes_and_the_hint() -> None:
    collate = SameSizeCollate("set --data.val_batch_size 1")
    with pytest.raises(DataError) as info:
        collate([_sample(4, 6), _sample(4, 6), _sample(8, 5)])
    message = str(info.value)
    assert "two images of one batch differ in size (6x4 and 5x8 px)" in message
    assert message.endswith("; set --data.val_batch_size 1") and "\n" not in message


def test_a_dataloader_with_mixed_sizes_raises_the_data_error() -> None:
    data = [_sample(4, 6), _sample(5, 6)]
    loader = DataLoader(data, batch_size=2, collate_fn=SameSizeCollate("use --batch-size 1"))
    with pytest.raises(DataError, match="use --batch-size 1"):
        next(iter(loader))
    assert [
        tuple(x.shape) for x, _ in DataLoader(data, batch_size=1, collate_fn=SameSizeCollate())
    ] == [
        (1, 3, 4, 6),
        (1, 3, 5, 6),
    ]


def test_it_pickles_for_spawned_workers() -> None:
    collate = pickle.loads(pickle.dumps(SameSizeCollate("hint")))
    assert collate.hint == "hint"
