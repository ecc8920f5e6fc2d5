"""Near-boundary mask (method B step 2 / P4)."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from dualseg.refine import near_boundary_mask


@pytest.mark.parametrize("method", ["canny", "neighbour"])
def test_band_along_whole_border_of_adjacent_labels(method: str) -> None:
    # labels 3 | 4: a gradient of 4 grey levels, which Canny with usual thresholds misses
    label = np.full((64, 64), 3, dtype=np.uint8)
    label[:, 32:] = 4
    assert not cv2.Canny(label, 100, 200).any()  # the naive reading finds nothing
    label[:5, :5] = 255  # ignore pixels far from the border
    label[40:44, 28:36] = 255  # ignore pixels on the border
    radius = 5
    mask = near_boundary_mask(torch.from_numpy(label)[None], radius=radius)
    assert mask.dtype == torch.bool and mask.shape == (1, 64, 64)
    mask = mask[0].numpy()
    assert not mask[label == 255].any()
    # every row away from the ignore patches (a void border is a boundary too) holds one band
    # of 2r+2 px, symmetric about the border
    expected = np.zeros(64, dtype=bool)
    expected[32 - radius - 1 : 32 + radius + 1] = True
    rows = [y for y in range(11, 64) if not 34 <= y < 50]
    assert (mask[rows] == expected).all()
    assert near_boundary_mask(label, radius=0).sum(1)[rows].tolist() == [2] * len(rows)


def test_every_transition_found_whatever_the_values() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):  # blocky maps with many labels: thin stripes, corners, junctions
        small = rng.integers(0, 60, size=rng.integers(3, 24, size=2)).astype(np.uint8)
        label = cv2.resize(small, (48, 48), interpolation=cv2.INTER_NEAREST)
        mask = near_boundary_mask(label, radius=0, ignore_index=None)
        assert mask[:, 1:][label[:, 1:] != label[:, :-1]].all()
        assert mask[:, :-1][label[:, 1:] != label[:, :-1]].all()
        assert mask[1:][label[1:] != label[:-1]].all()
        assert not mask[
            1:-1, 1:-1
        ][  # and nothing inside uniform 3x3 neighbourhoods
            (cv2.dilate(label, np.ones((3, 3))) == cv2.erode(label, np.ones((3, 3))))[1:-1, 1:-1]
        ].any()
    assert not near_boundary_mask(np.zeros((8, 8), np.int64)).any()


def test_rank_coding_equals_sorting_for_every_label_kind() -> None:
    from dualseg.metrics import neighbour_transitions
    from dualseg.refine.boundary import semantic_boundary

    rng = np.random.default_rng(1)
    cases = [
        rng.integers(0, 12, (40, 50)).astype(np.uint8),
        np.where(rng.random((40, 50)) < 0.2, 255, rng.integers(3, 9, (40, 50))).astype(np.int64),
        rng.integers(-5, 5, (30, 30)).astype(np.int32),  # negative: the sorting path
        rng.integers(0, 2**20, (30, 30)).astype(np.int64),  # huge values: the sorting path
        rng.integers(0, 300, (40, 50)).astype(np.int64),  # > 256 labels: no grey codes
        np.full((8, 8), 7, dtype=np.uint8),
    ]
    for label in cases:
        values, inverse = np.unique(label, return_inverse=True)
        edges = semantic_boundary(label, method="canny_only")
        if len(values) < 2:
            assert not edges.any()
            continue
        if len(values) > 256:  # no 8-bit coding: the transitions
            assert np.array_equal(edges, neighbour_transitions(label))
            continue
        step = 255 // (len(values) - 1)  # ranks spread evenly over 0..255
        codes = (inverse.reshape(label.shape) * step).astype(np.uint8)
        assert np.array_equal(edges, cv2.Canny(codes, 1, 1, L2gradient=True) > 0)
