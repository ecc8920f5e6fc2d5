"""Tests of dualseg.metrics: the confusion matrix (hand-computed, against torchmetrics), its
reduction and reporting (the boundary definitions: test_boundary_metrics.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dualseg.metrics import (
    BoundaryMetrics,
    ChangeScorer,
    ConfusionMatrix,
    change_counts,
    format_table,
    to_jsonable,
)
from metric_helpers import DEVICES, IGN, blobby, step_case, t

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
        pred, target = step_case()
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
    pred, target = step_case()
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
