"""CoordChannels (claim 4): i, j scaled to [-1, 1], r = sqrt(i² + j²) from the scaled values."""

from __future__ import annotations

import math

import pytest
import torch

from dualseg.models import CoordChannels


def test_values_follow_the_claim_on_a_4x5_map() -> None:
    x = torch.randn(2, 7, 4, 5)
    out = CoordChannels()(x)
    assert out.shape == (2, 10, 4, 5)
    assert torch.equal(out[:, :7], x)  # features pass through untouched
    for e in range(4):
        for f in range(5):
            i = -1 + 2 * e / 3  # row index 0..3 scaled linearly to [-1, 1]
            j = -1 + 2 * f / 4  # column index 0..4 scaled linearly to [-1, 1]
            for b in range(2):
                assert out[b, 7, e, f].item() == pytest.approx(i, abs=1e-6)
                assert out[b, 8, e, f].item() == pytest.approx(j, abs=1e-6)
                assert out[b, 9, e, f].item() == pytest.approx(math.hypot(i, j), abs=1e-6)
    assert out[:, 9].max().item() == pytest.approx(math.sqrt(2), abs=1e-6)  # corners: r = √2
    assert out[:, 9].min().item() > 0  # an even-sized map has no centre pixel


@pytest.mark.parametrize("shape", [(1, 6), (6, 1), (1, 1)])
def test_single_row_or_column_gets_zero_not_nan(shape: tuple[int, int]) -> None:
    out = CoordChannels()(torch.zeros(1, 2, *shape))
    assert torch.isfinite(out).all()
    e, f = shape
    if e == 1:
        assert torch.equal(out[0, 2], torch.zeros(shape))
    if f == 1:
        assert torch.equal(out[0, 3], torch.zeros(shape))
    assert torch.allclose(out[0, 4], torch.sqrt(out[0, 2] ** 2 + out[0, 3] ** 2))
    if f > 1:
        assert out[0, 3, 0, 0] == -1 and out[0, 3, 0, -1] == 1


def test_index_radius_reading_uses_raw_indices() -> None:
    out = CoordChannels(radius="index")(torch.zeros(1, 1, 3, 4))
    assert out[0, 3, 2, 3].item() == pytest.approx(math.hypot(2, 3))
    with pytest.raises(ValueError, match="radius"):
        CoordChannels(radius="polar")


def test_centred_radius_reading_is_coordconvs_distance_from_the_centre() -> None:
    out = CoordChannels(radius="centred")(torch.zeros(1, 1, 3, 5))
    r = out[0, 3]
    assert r[1, 2].item() == 0.0  # the centre pixel of a 3x5 map
    assert r[0, 0].item() == pytest.approx(math.hypot(1, 2))  # corner: (1, 2) from the centre
    assert torch.allclose(r, r.flip(0)) and torch.allclose(r, r.flip(1))  # symmetric
