"""Tests of dualseg.metrics: hand-computed cases, torchmetrics agreement, boundary definitions."""

from __future__ import annotations

import json
import math

import cv2
import numpy as np
import pytest
import torch

from dualseg.metrics import (
    BoundaryMetrics,
    ChangeScorer,
    ConfusionMatrix,
    boundary_map,
    change_counts,
    disk_offsets,
    format_table,
    to_jsonable,
)

IGN = 255
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def t(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def blobby(gen: torch.Generator, b: int, h: int, w: int, c: int, ignore_frac: float = 0.0):
    """Random piecewise-constant label maps (coarse grid upsampled) with some ignore pixels."""
    coarse = torch.randint(0, c, (b, 1, h // 8, w // 8), generator=gen).float()
    lab = torch.nn.functional.interpolate(coarse, size=(h, w), mode="nearest")[:, 0].long()
    if ignore_frac:
        lab[torch.rand(lab.shape, generator=gen) < ignore_frac] = IGN
    return lab


# --------------------------------------------------------------------------------------------
# ConfusionMatrix
# --------------------------------------------------------------------------------------------


def test_confusion_matrix_hand_computed() -> None:
    # Valid pixels (gt, pred): (0,0) (0,1) (1,1) (1,1) (2,1); the ignore pixel's prediction 3
    # is dropped, so class 3 is absent from both sides.
    target = t([[0, 0, 1], [1, 2, IGN]])
    pred = t([[0, 1, 1], [1, 1, 3]])
    cm = ConfusionMatrix(4)
    cm.update(pred, target)
    expected = t([[1, 1, 0, 0], [0, 2, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
    assert torch.equal(cm.mat, expected)
    r = cm.compute()
    # IoU: c0 = 1/(2+1-1), c1 = 2/(2+4-2), c2 = 0/(1+0-0), c3 absent -> NaN.
    assert r["iou"][:3].tolist() == [0.5, 0.5, 0.0]
    assert math.isnan(r["iou"][3])
    assert r["miou"] == pytest.approx(1 / 3)
    assert r["pixel_acc"] == pytest.approx(3 / 5)
    # class accuracy 1/2, 2/2, 0/1, NaN
    assert r["class_acc"][:3].tolist() == [0.5, 1.0, 0.0]
    assert math.isnan(r["class_acc"][3])
    assert r["mean_acc"] == pytest.approx(0.5)
    # fwIoU = 2/5 * 0.5 + 2/5 * 0.5 + 1/5 * 0
    assert r["fwiou"] == pytest.approx(0.4)
    assert isinstance(r["miou"], float) and r["iou"].dtype == torch.float64


def test_confusion_matrix_predicted_only_class_counts_in_miou() -> None:
    # Class 2 appears only in the prediction: IoU 0 (not NaN), accuracy NaN (no GT pixels).
    cm = ConfusionMatrix(3)
    cm.update(t([[0, 2]]), t([[0, 0]]))
    r = cm.compute()
    assert r["iou"][0] == 0.5 and r["iou"][2] == 0.0 and math.isnan(r["iou"][1])
    assert r["miou"] == pytest.approx(0.25)
    assert math.isnan(r["class_acc"][2]) and r["mean_acc"] == pytest.approx(0.5)


def test_confusion_matrix_empty_and_all_ignore() -> None:
    cm = ConfusionMatrix(3)
    cm.update(t([[IGN, IGN]]), t([[IGN, IGN]]))
    r = cm.compute()
    assert int(cm.mat.sum()) == 0
    assert all(math.isnan(r[k]) for k in ("miou", "pixel_acc", "mean_acc", "fwiou"))


def test_confusion_matrix_streams_and_resets() -> None:
    gen = torch.Generator().manual_seed(1)
    target = blobby(gen, 4, 32, 32, 5, ignore_frac=0.1)
    pred = torch.randint(0, 5, target.shape, generator=gen)
    whole, parts = ConfusionMatrix(5), ConfusionMatrix(5)
    whole.update(pred, target)
    for i in range(4):
        parts.update(pred[i], target[i].to(torch.uint8))  # any int dtype, any shape
    assert torch.equal(whole.mat, parts.mat)
    assert int(whole.mat.sum()) == int((target != IGN).sum())
    whole.reset()
    assert int(whole.mat.sum()) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("device", DEVICES)
def test_confusion_matrix_agrees_with_torchmetrics(seed: int, device: str) -> None:
    from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex

    gen = torch.Generator().manual_seed(seed)
    c = 6
    target = torch.randint(0, c, (3, 40, 48), generator=gen)
    target[torch.rand(target.shape, generator=gen) < 0.15] = IGN
    pred = torch.where(torch.rand(target.shape, generator=gen) < 0.6, target.clamp(max=c - 1), 0)
    pred = torch.where(pred == IGN, 0, pred)
    pred[torch.rand(target.shape, generator=gen) < 0.2] = 3
    cm = ConfusionMatrix(c)
    for b in range(3):  # streamed batch by batch
        cm.update(pred[b : b + 1].to(device), target[b : b + 1].to(device))
    assert cm.mat.device.type == device
    r = cm.compute()

    iou = MulticlassJaccardIndex(num_classes=c, average=None, ignore_index=IGN)(pred, target)
    miou = MulticlassJaccardIndex(num_classes=c, average="macro", ignore_index=IGN)(pred, target)
    acc = MulticlassAccuracy(num_classes=c, average="micro", ignore_index=IGN)(pred, target)
    macc = MulticlassAccuracy(num_classes=c, average="macro", ignore_index=IGN)(pred, target)
    torch.testing.assert_close(r["iou"].float(), iou.float())
    assert r["miou"] == pytest.approx(float(miou), abs=1e-6)
    assert r["pixel_acc"] == pytest.approx(float(acc), abs=1e-6)
    assert r["mean_acc"] == pytest.approx(float(macc), abs=1e-6)


def test_confusion_matrix_rejects_bad_input() -> None:
    cm = ConfusionMatrix(3)
    with pytest.raises(ValueError, match=r"ground-truth values \[7\]"):
        cm.update(t([[0, 1]]), t([[0, 7]]))
    with pytest.raises(ValueError, match=r"predicted values \[3\]"):
        cm.update(t([[0, 3]]), t([[0, 1]]))
    with pytest.raises(ValueError, match="shapes differ"):
        cm.update(t([[0, 1]]), t([[0, 1, 1]]))
    with pytest.raises(TypeError, match="argmax"):
        cm.update(torch.zeros(1, 3, 2, 2), t([[0, 1], [1, 0]]))
    # An out-of-range prediction under an ignore pixel is fine (it is not scored).
    cm.update(t([[0, 9]]), t([[0, IGN]]))
    assert int(cm.mat.sum()) == 1


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


def _step_case() -> tuple[torch.Tensor, torch.Tensor]:
    # GT: edge between columns 3|4 in every row. Prediction: the same in rows 0-1, moved to
    # columns 5|6 in rows 2-3.
    target = t([[0, 0, 0, 0, 1, 1, 1, 1]] * 4)
    pred = t([[0, 0, 0, 0, 1, 1, 1, 1]] * 2 + [[0, 0, 0, 0, 0, 0, 1, 1]] * 2)
    return pred, target


def test_boundary_f1_hand_computed_step() -> None:
    pred, target = _step_case()
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


# --------------------------------------------------------------------------------------------
# Distributed reduction, reporting
# --------------------------------------------------------------------------------------------


def test_state_of_two_halves_sums_to_whole() -> None:
    gen = torch.Generator().manual_seed(6)
    target = blobby(gen, 4, 32, 32, 5, ignore_frac=0.05)
    pred = blobby(gen, 4, 32, 32, 5)
    whole_b, whole_c = BoundaryMetrics(5), ConfusionMatrix(5)
    whole_b.update(pred, target)
    whole_c.update(pred, target)
    halves = [(BoundaryMetrics(5), ConfusionMatrix(5)) for _ in range(2)]
    for (b, c), sl in zip(halves, (slice(0, 2), slice(2, 4))):
        b.update(pred[sl], target[sl])
        c.update(pred[sl], target[sl])
    # What dist.all_reduce(SUM) does across two ranks:
    summed_b, summed_c = BoundaryMetrics(5), ConfusionMatrix(5)
    summed_b.state = halves[0][0].state + halves[1][0].state
    summed_c.mat = halves[0][1].mat + halves[1][1].mat
    assert torch.equal(summed_b.state, whole_b.state)
    assert torch.equal(summed_c.mat, whole_c.mat)
    assert summed_b.compute()["boundary_f1"] == whole_b.compute()["boundary_f1"]
    assert summed_c.compute()["miou"] == whole_c.compute()["miou"]
    assert whole_b.state.dtype == torch.int64 and whole_b.state.dim() == 1


@pytest.mark.parametrize(
    ("tol", "width", "classes", "ignore", "shape"),
    [(0, 0, 5, IGN, (2, 48, 64)), (1, 5, 5, IGN, (2, 48, 64)), (3, 5, 5, -1, (2, 48, 64)),
     (4, 2, 300, 1000, (1, 48, 64)), (3, 5, 3, -1, (1, 1, 7)), (2, 9, 3, IGN, (1, 8, 8))],
)  # fmt: skip
def test_change_scorer_equals_whole_updates(tol, width, classes, ignore, shape) -> None:
    """The sweep's incremental counts are exactly the whole-map updates, at every tolerance,
    for sparse and dense relabellings, with ignore pixels (holding any value) and batches."""
    gen = torch.Generator().manual_seed(tol * 10 + width)
    b, h, w = shape
    coarse = torch.randint(0, classes, (2, b, 1, max(h // 8, 1), max(w // 8, 1)), generator=gen)
    target, base = (torch.nn.functional.interpolate(x.float(), size=(h, w))[:, 0].long()
                    for x in coarse)  # fmt: skip
    ignored = torch.rand(shape, generator=gen) < 0.05
    target[ignored] = ignore
    base[ignored] = torch.randint(-5, 2000, (int(ignored.sum()),), generator=gen)  # unscored
    scorer = ChangeScorer(base, target, classes, ignore_index=ignore, tolerance=tol,
                          trimap_width=width)  # fmt: skip
    for frac in (0.0, 0.02, 0.3, 1.0):
        new = base.clone()
        where = (torch.rand(shape, generator=gen) < frac) & ~ignored
        new[where] = torch.randint(0, classes, (int(where.sum()),), generator=gen)
        conf = ConfusionMatrix(classes, ignore_index=ignore)
        bnd = BoundaryMetrics(classes, tolerance=tol, trimap_width=width, ignore_index=ignore)
        conf.update(new, target)
        bnd.update(new, target)
        mat, state, counts = scorer.scores(new)
        assert torch.equal(mat, conf.mat)
        assert torch.equal(state, bnd.state)
        assert torch.equal(counts, change_counts(new, base, target, ignore))


def test_change_scorer_refuses_what_update_refuses() -> None:
    base = torch.zeros(1, 4, 4, dtype=torch.long)
    scorer = ChangeScorer(base, base.clone(), 2)
    assert torch.equal(scorer.scores(base[0])[0], ChangeScorer(base[0], base[0], 2).scores(base)[0])
    with pytest.raises(ValueError, match="outside"):
        scorer.scores(base + 2)
    with pytest.raises(ValueError, match="shape"):
        scorer.scores(base[:, :2])
    with pytest.raises(ValueError, match="integer"):
        scorer.scores(base.float())


def test_all_reduce_in_single_process_group(tmp_path) -> None:
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        bm, cm = BoundaryMetrics(2), ConfusionMatrix(2)
        pred, target = _step_case()
        bm.update(pred, target)
        cm.update(pred, target)
        before_b, before_c = bm.state.clone(), cm.mat.clone()
        bm.all_reduce()
        cm.all_reduce()
        assert torch.equal(bm.state, before_b) and torch.equal(cm.mat, before_c)
    finally:
        dist.destroy_process_group()


def test_results_are_json_dumpable_and_tabulated() -> None:
    cm, bm = ConfusionMatrix(3), BoundaryMetrics(3)
    pred, target = _step_case()
    cm.update(pred, target)
    bm.update(pred, target)
    results = {**cm.compute(), **bm.compute()}
    data = to_jsonable(results)
    text = json.dumps(data, allow_nan=False)  # NaN became null: strict JSON
    assert json.loads(text)["iou"][2] is None
    assert isinstance(data["miou"], float) and len(data["boundary_f1_per_class"]) == 3
    assert to_jsonable({"a": np.array([0.5, np.nan]), "b": {"c": np.float64("nan")}}) == {
        "a": [0.5, None],
        "b": {"c": None},
    }

    table = format_table(["road", "sky", "car"], results)
    lines = table.splitlines()
    assert lines[0].split("|")[1].strip() == "class"
    assert [h.strip() for h in lines[0].split("|")[2:-1]] == ["IoU", "Acc", "BF1", "Trimap IoU"]
    car = next(line for line in lines if line.startswith("| car"))
    assert car.count("-") == 4  # class absent everywhere
    road = next(line for line in lines if line.startswith("| road"))
    assert f"{100 * float(results['iou'][0]):.1f}" in road  # percent, one decimal
    assert f"mIoU: {100 * results['miou']:.1f} " in lines[-1] + " "
    # Lists (as the engine passes them) work too; a wrong number of names is an error.
    assert format_table(["a", "b", "c"], data).count("|") == table.count("|")
    with pytest.raises(ValueError, match="class names"):
        format_table(["road"], results)


def test_boundary_rejects_bad_input() -> None:
    bm = BoundaryMetrics(2)
    with pytest.raises(ValueError, match="ground-truth values"):
        bm.update(t([[0, 5]]), t([[0, 5]]))
    with pytest.raises(ValueError, match=r"\[B, H, W\]"):
        bm.update(
            torch.zeros(1, 1, 2, 2, dtype=torch.int64), torch.zeros(1, 1, 2, 2, dtype=torch.int64)
        )
    with pytest.raises(ValueError, match="tolerance"):
        BoundaryMetrics(2, tolerance=-1)


def test_docstring_examples() -> None:
    import doctest

    import dualseg.metrics

    result = doctest.testmod(dualseg.metrics)
    assert result.attempted >= 3 and result.failed == 0


def test_change_counts_counts_fixed_and_broken_on_labelled_pixels_only() -> None:
    labels = torch.tensor([[[0, 1, 2, 3], [9, 9, 1, 1]]])  # 9: unlabelled here
    pred = torch.tensor([[[0, 0, 2, 2], [0, 1, 1, 0]]])
    new = torch.tensor([[[1, 1, 2, 1], [5, 5, 1, 1]]])
    # labelled 6; changed at 4 of them (cols 0, 1, 3 of row 0; col 3 of row 1): fixed 2
    # (row 0 col 1, row 1 col 3), broken 1 (row 0 col 0), wrong to wrong 1 (row 0 col 3)
    assert change_counts(new, pred, labels, ignore_index=9).tolist() == [6, 4, 2, 1]
    assert change_counts(pred, pred, labels, ignore_index=9).tolist() == [6, 0, 0, 0]


def test_neighbour_transitions_is_one_code_for_numpy_and_torch() -> None:
    from dualseg.metrics import neighbour_transitions

    rng = np.random.default_rng(0)
    lab = rng.integers(0, 3, (2, 9, 11)).astype(np.int64)
    valid = rng.random((2, 9, 11)) > 0.2
    for v in (None, valid):
        out_np = neighbour_transitions(lab, v)
        out_t = neighbour_transitions(
            torch.from_numpy(lab), None if v is None else torch.from_numpy(v)
        )
        assert isinstance(out_np, np.ndarray) and out_t.dtype == torch.bool
        np.testing.assert_array_equal(out_np, out_t.numpy())
    # brute force: a pixel is marked iff one of its 4 neighbours differs
    expect = np.zeros_like(valid)
    for b, y, x in np.ndindex(lab.shape):
        for dy, dx in ((0, 1), (0, -1), (1, 0), (-1, 0)):
            yy, xx = y + dy, x + dx
            if 0 <= yy < 9 and 0 <= xx < 11 and lab[b, yy, xx] != lab[b, y, x]:
                expect[b, y, x] = True
    np.testing.assert_array_equal(neighbour_transitions(lab), expect)


@pytest.mark.parametrize(("tol", "width"), [(-1, 5), (3, -2)])
def test_boundary_metrics_refuse_negative_widths_as_a_config_error(tol: int, width: int) -> None:
    from dualseg.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--boundary-tolerance, --trimap-width"):
        BoundaryMetrics(3, tolerance=tol, trimap_width=width)


def test_an_ignore_index_that_is_a_class_id_is_refused_and_one_outside_works() -> None:
    # 300 classes with the default ignore 255 would drop class 255's ground truth silently
    with pytest.raises(ValueError, match="ignore_index 255 is also a class id of 300"):
        ConfusionMatrix(300)
    with pytest.raises(ValueError, match="ignore_index 0 is also a class id"):
        BoundaryMetrics(3, ignore_index=0)
    cm = ConfusionMatrix(300, ignore_index=-1)
    cm.update(torch.tensor([[255, 255, 10, -1]]), torch.tensor([[255, 255, 10, -1]]))
    assert int(cm.mat.sum()) == 3 and cm.compute()["miou"] == 1.0


def test_numpy_label_maps_score_as_tensors_do() -> None:
    rng = np.random.default_rng(0)
    pred, gt = rng.integers(0, 3, (2, 9, 11)), rng.integers(0, 3, (2, 9, 11))
    gt[0, 0, :4] = IGN
    for make in (lambda: ConfusionMatrix(3), lambda: BoundaryMetrics(3, tolerance=1)):
        metric, ref = make(), make()
        metric.update(pred.astype(np.uint8), gt.astype(np.uint8))  # as Segmenter.predict gives
        ref.update(torch.from_numpy(pred), torch.from_numpy(gt))
        assert to_jsonable(metric.compute()) == to_jsonable(ref.compute())
    with pytest.raises(TypeError, match="label map tensor or numpy array, got list"):
        ConfusionMatrix(3).update([[0, 1]], t([[0, 1]]))
    with pytest.raises(TypeError, match=r"num_classes must be an int, got 3\.0"):
        ConfusionMatrix(3.0)


def test_an_ignore_index_outside_the_label_dtype_is_not_read_as_another_value() -> None:
    # uint8 labels and ignore -1: the check read -1 as 255, the counts as -1, and the 255
    # pixels were dropped without a word; every integer dtype now scores as int64 does
    gt = torch.tensor([[0, 1, 255, 2]])
    pred = torch.tensor([[0, 1, 1, 2]])
    for dtype in (torch.uint8, torch.int16, torch.int64):
        with pytest.raises(ValueError, match=r"ground-truth values \[255\]"):
            ConfusionMatrix(3, ignore_index=-1).update(pred.to(dtype), gt.to(dtype))
    cm = ConfusionMatrix(3, ignore_index=-1)
    cm.update(pred.to(torch.int8), torch.tensor([[0, 1, -1, 2]], dtype=torch.int8))
    assert int(cm.mat.sum()) == 3


def test_a_fractional_boundary_tolerance_is_refused_not_cut() -> None:
    from dualseg.errors import ConfigError

    with pytest.raises(ConfigError, match=r"whole pixels, got 2\.5"):
        BoundaryMetrics(3, tolerance=2.5)
    assert BoundaryMetrics(3, tolerance=2.0).tolerance == 2


def test_numpy_class_counts_wide_unsigned_and_read_only_label_maps_score() -> None:
    """np.int64 class counts (a dataset's ``len(classes)`` from numpy), uint16/uint32 label
    maps (16-bit PNGs) and read-only arrays (np.load with mmap) score as int64 tensors do."""
    import warnings

    gt = np.array([[0, 1, 2, 2]])
    pred = np.array([[0, 1, 1, 2]])
    ref = ConfusionMatrix(3)
    ref.update(torch.from_numpy(pred), torch.from_numpy(gt))
    for dtype in (np.uint16, np.uint32, np.uint8):
        p, g = pred.astype(dtype), gt.astype(dtype)
        p.flags.writeable = g.flags.writeable = False
        cm = ConfusionMatrix(np.int64(3))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's non-writable array warning
            cm.update(p, g)
        assert torch.equal(cm.mat, ref.mat) and cm.num_classes == 3
    assert type(BoundaryMetrics(np.int32(3)).num_classes) is int


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "3", True])
def test_a_tolerance_that_is_no_number_is_one_config_error(bad: object) -> None:
    from dualseg.errors import ConfigError

    with pytest.raises(ConfigError, match="whole pixels"):
        BoundaryMetrics(3, tolerance=bad)
