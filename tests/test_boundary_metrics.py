"""Tests of dualseg.metrics' boundary definitions: the boundary map, boundary F1 and the trimap
band, against hand-computed cases and loop / distance-transform references."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
import torch

from dualseg.metrics import (
    BoundaryMetrics,
    boundary_map,
    disk_offsets,
)
from metric_helpers import DEVICES, IGN, blobby, step_case, t

# --------------------------------------------------------------------------------------------
# Boundary extraction
# --------------------------------------------------------------------------------------------


def _boundary_reference(lab: np.ndarray) -> np.ndarray:
    """Loop version of the documented definition (4-neighbours, ignore and border excluded)."""
    h, w = lab.shape
    out = np.full((h, w), -1)
    for y in range(h):
        for x in range(w):
            if lab[y, x] == IGN:
                continue
            for dy, dx in ((-1, 0), (1, 0), (0, -1), (0, 1)):
                yy, xx = y + dy, x + dx
                if 0 <= yy < h and 0 <= xx < w and lab[yy, xx] not in (IGN, lab[y, x]):
                    out[y, x] = lab[y, x]
    return out


def test_boundary_map_hand_case_ignore_is_no_boundary() -> None:
    lab = t([[0, 0, 1], [0, IGN, 1], [0, 0, 0]])
    # (0,1)|(0,2) and (1,2)|(2,2) are class transitions; every transition into the ignore pixel
    # and the image border are not boundaries.
    expected = t([[-1, 0, 1], [-1, -1, 1], [-1, -1, 0]])
    assert torch.equal(boundary_map(lab), expected)


def test_boundary_map_matches_loop_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    lab = torch.randint(0, 4, (2, 12, 13), generator=gen)
    lab[torch.rand(lab.shape, generator=gen) < 0.2] = IGN
    got = boundary_map(lab)
    for i in range(2):
        np.testing.assert_array_equal(got[i].numpy(), _boundary_reference(lab[i].numpy()))


def test_disk_offsets() -> None:
    assert disk_offsets(0) == [(0, 0)]
    assert len(disk_offsets(1)) == 5
    assert len(disk_offsets(3)) == 29
    assert all(dy * dy + dx * dx <= 9 for dy, dx in disk_offsets(3))


# --------------------------------------------------------------------------------------------
# Boundary F1
# --------------------------------------------------------------------------------------------


def test_boundary_f1_identical_maps_is_one() -> None:
    gen = torch.Generator().manual_seed(4)
    target = blobby(gen, 2, 48, 48, 4, ignore_frac=0.05)
    pred = torch.where(target == IGN, 1, target)
    bm = BoundaryMetrics(4)
    bm.update(pred, target)
    r = bm.compute()
    assert r["boundary_f1"] == 1.0 and r["trimap_miou"] == 1.0
    present = ~torch.isnan(r["boundary_f1_per_class"])
    assert present.any() and torch.all(r["boundary_f1_per_class"][present] == 1.0)


def test_boundary_f1_hand_computed_step() -> None:
    pred, target = step_case()
    bm = BoundaryMetrics(2, tolerance=1)
    bm.update(pred, target)
    # GT boundary: class 0 at (r,3), class 1 at (r,4), r = 0..3 -> 4 px each.
    # Pred boundary, class 0: (0,3) (1,3) (2,4) (2,5) (3,5); class 1: (0,4) (1,4) (1,5) (2,6)
    # (3,6) -> 5 px each (the step adds the vertical transitions at (1|2, 4..5)).
    # t = 1: class 0 pred matched (0,3) (1,3) (2,4)->(2,3); (2,5), (3,5) are 2 px away: P = 3/5.
    # GT matched (0,3) (1,3) (2,3)<-(2,4); (3,3) is >= sqrt2 from every pred px: R = 3/4.
    # Class 1 is symmetric: P = 3/5, R = 3/4.  F1 = 2 * 0.6 * 0.75 / 1.35 = 2/3.
    assert bm.boundary_counts.tolist() == [[5, 5], [3, 3], [4, 4], [3, 3]]
    r = bm.compute()
    assert r["boundary_precision"].tolist() == [0.6, 0.6]
    assert r["boundary_recall"].tolist() == [0.75, 0.75]
    assert r["boundary_f1"] == pytest.approx(2 / 3)
    # t = 2 reaches the 2-px displacement: every boundary pixel matches.
    bm2 = BoundaryMetrics(2, tolerance=2)
    bm2.update(pred, target)
    assert bm2.compute()["boundary_f1"] == 1.0


@pytest.mark.parametrize("tol", [1, 3])
def test_boundary_f1_tolerance(tol: int) -> None:
    target = torch.zeros(1, 16, 20, dtype=torch.int64)
    target[..., 8:] = 1
    for shift in range(tol + 3):
        pred = torch.zeros_like(target)
        pred[..., 8 + shift :] = 1
        bm = BoundaryMetrics(2, tolerance=tol)
        bm.update(pred, target)
        f1 = bm.compute()["boundary_f1"]
        # Straight edge moved by `shift`: every boundary pixel is exactly `shift` away.
        assert f1 == (1.0 if shift <= tol else 0.0), (shift, f1)


def _f1_reference(pred: np.ndarray, target: np.ndarray, c: int, tol: int) -> np.ndarray:
    """Counts from exact Euclidean distance transforms (OpenCV) instead of disk offsets."""
    pred = np.where(target == IGN, IGN, pred)
    pb, gb = _boundary_reference(pred), _boundary_reference(target)
    counts = np.zeros((4, c), dtype=np.int64)
    for k in range(c):
        for row, (src, ref) in enumerate(((pb, gb), (gb, pb))):
            src_k, ref_k = src == k, ref == k
            counts[2 * row, k] = src_k.sum()
            if not ref_k.any():
                continue
            dist = cv2.distanceTransform(
                (~ref_k).astype(np.uint8), cv2.DIST_L2, cv2.DIST_MASK_PRECISE
            )
            counts[2 * row + 1, k] = (src_k & (dist <= tol + 1e-4)).sum()
    return counts


@pytest.mark.parametrize("device", DEVICES)
def test_boundary_counts_match_distance_transform_reference(device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    c, tol = 4, 3
    target = blobby(gen, 2, 32, 40, c, ignore_frac=0.03)
    pred = torch.roll(blobby(gen, 2, 32, 40, c), shifts=(1, 2), dims=(1, 2))
    pred = torch.where(torch.rand(pred.shape, generator=gen) < 0.5, target.clamp(max=c - 1), pred)
    bm = BoundaryMetrics(c, tolerance=tol)
    bm.update(pred.to(device), target.to(device))
    assert bm.state.device.type == device
    ref = sum(_f1_reference(pred[i].numpy(), target[i].numpy(), c, tol) for i in range(2))
    np.testing.assert_array_equal(bm.boundary_counts.cpu().numpy(), ref)
    assert 0 < bm.compute()["boundary_f1"] < 1


def test_boundary_transition_to_ignore_is_not_scored() -> None:
    # Classes 0 and 1 separated by an ignore stripe: no GT boundary; the prediction under the
    # stripe is arbitrary and creates no predicted boundary either.
    target = t([[0, 0, 0, IGN, IGN, 1, 1, 1]] * 4)
    pred = t([[0, 0, 0, 1, 0, 1, 1, 1]] * 4)
    bm = BoundaryMetrics(2)
    bm.update(pred, target)
    assert int(bm.state.sum()) == 0
    r = bm.compute()
    assert math.isnan(r["boundary_f1"]) and math.isnan(r["trimap_miou"])
    assert torch.isnan(r["boundary_f1_per_class"]).all()


def test_boundary_f1_one_sided_class_scores_zero() -> None:
    # Class 2 only in the prediction (a false blob): F1 0, counted in the mean.
    target = torch.zeros(1, 8, 8, dtype=torch.int64)
    target[..., 4:] = 1
    pred = target.clone()
    pred[0, 1:3, 1:3] = 2
    bm = BoundaryMetrics(3, tolerance=1)
    bm.update(pred, target)
    r = bm.compute()
    assert r["boundary_f1_per_class"][2] == 0.0
    assert math.isnan(r["boundary_recall"][2])
    assert r["boundary_f1_per_class"][1] == 1.0
    assert r["boundary_f1"] == pytest.approx(float(r["boundary_f1_per_class"].mean()))


# --------------------------------------------------------------------------------------------
# Trimap
# --------------------------------------------------------------------------------------------


def test_trimap_band_hand_computed() -> None:
    # GT edge between columns 5|6 -> boundary columns 5 and 6; width 2 -> band = columns 3..8.
    target = t([[0] * 6 + [1] * 6] * 3)
    pred = target.clone()
    pred[:, 0] = 1  # error outside the band: not counted
    pred[:, 7] = 0  # error inside the band
    bm = BoundaryMetrics(2, trimap_width=2)
    bm.update(pred, target)
    # In the band: class 0 at columns 3-5 all right (9 px); class 1 at columns 6-8, column 7
    # predicted 0 (3 px). IoU0 = 9 / (9 + 3), IoU1 = 6 / 9.
    assert bm.trimap_mat.tolist() == [[9, 0], [3, 6]]
    r = bm.compute()
    assert r["trimap_iou"].tolist() == pytest.approx([0.75, 2 / 3])
    assert r["trimap_miou"] == pytest.approx((0.75 + 2 / 3) / 2)
    # Width 0: the band is the boundary pixels themselves (columns 5 and 6).
    bm0 = BoundaryMetrics(2, trimap_width=0)
    bm0.update(pred, target)
    assert bm0.trimap_mat.tolist() == [[3, 0], [0, 3]]


def test_trimap_band_is_a_disk_and_skips_ignore() -> None:
    # One GT boundary pixel pair in the middle; band of width 2 around them is a union of disks.
    target = torch.zeros(1, 9, 9, dtype=torch.int64)
    target[0, 4, 4] = 1  # a single pixel of class 1: its 4 neighbours are class-0 boundary
    target[0, 4, 7] = IGN  # an ignore pixel inside the band is excluded
    bm = BoundaryMetrics(2, trimap_width=2)
    bm.update(target.clone().masked_fill(target == IGN, 0), target)
    gb = (boundary_map(target)[0] >= 0).numpy().astype(np.uint8)
    dist = cv2.distanceTransform(1 - gb, cv2.DIST_L2, cv2.DIST_MASK_PRECISE)
    expected_band = int(((dist <= 2 + 1e-4) & (target[0].numpy() != IGN)).sum())
    assert int(bm.trimap_mat.sum()) == expected_band
    assert bm.trimap_mat.tolist()[1] == [0, 1]


@pytest.mark.parametrize("radius", [0, 1, 2, 3, 5, 7])
def test_disk_dilation_matches_distance_transform(radius: int) -> None:
    from dualseg.metrics import _dilate

    mask = torch.rand(2, 23, 31, generator=torch.Generator().manual_seed(radius)) < 0.02
    mask[1, 0, 0] = mask[1, 22, 30] = True  # corners: the disk is clipped at the border
    got = _dilate(mask, radius)
    for i in range(2):
        dist = cv2.distanceTransform(
            (~mask[i].numpy()).astype(np.uint8), cv2.DIST_L2, cv2.DIST_MASK_PRECISE
        )
        np.testing.assert_array_equal(got[i].numpy(), dist <= radius + 1e-4)
