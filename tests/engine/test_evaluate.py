"""evaluate(): streaming metrics over a loader, refiner side by side, DDP reduction path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dualseg.engine.evaluation import evaluate, format_metrics
from dualseg.metrics import BoundaryMetrics, ConfusionMatrix

C = 4


class LabelEcho(nn.Module):
    """Reads the label hidden in channel 0 of the 'image' and returns confident logits for it."""

    def __init__(self, scale: int = 1) -> None:
        super().__init__()
        self.scale = scale  # >1: return logits at lower resolution (evaluate must upsample)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lab = x[:, 0].round().long().clamp(0, C - 1)
        logits = F.one_hot(lab, C).permute(0, 3, 1, 2).float() * 10
        if self.scale > 1:
            logits = logits[..., :: self.scale, :: self.scale]
        return logits


def _batches(n: int = 3, b: int = 2, size: int = 32, seed: int = 0):
    """(image, label) batches: labels = blocks of classes with ignore pixels, image encodes them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        coarse = torch.randint(0, C, (b, size // 8, size // 8), generator=g)
        label = coarse.repeat_interleave(8, 1).repeat_interleave(8, 2)
        label[:, :2, :2] = 255
        image = torch.zeros(b, 3, size, size)
        image[:, 0] = label.clamp(max=C - 1).float()
        out.append((image, label))
    return out


def test_perfect_model_scores_one() -> None:
    m = evaluate(LabelEcho(), _batches(), num_classes=C)
    assert m["miou"] == pytest.approx(1.0)
    assert m["pixel_acc"] == pytest.approx(1.0)
    assert m["boundary_f1"] == pytest.approx(1.0)
    assert m["trimap_miou"] == pytest.approx(1.0)
    assert m["num_images"] == 6
    assert len(m["iou"]) == C and "refined" not in m


def test_matches_metrics_computed_directly_and_restores_train_mode() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, C, 1))
    model.train()
    batches = _batches(seed=3)
    for image, _ in batches:
        image.add_(torch.randn_like(image))
    m = evaluate(model, batches, num_classes=C, boundary_tolerance=2, trimap_width=3)
    assert model.training  # validation inside training gives the model back in train mode

    model.eval()
    cm, bm = ConfusionMatrix(C), BoundaryMetrics(C, tolerance=2, trimap_width=3)
    with torch.no_grad():
        for image, label in batches:
            pred = model(image).argmax(1)
            cm.update(pred, label)
            bm.update(pred, label)
    ref = {**cm.compute(), **bm.compute()}
    assert m["miou"] == pytest.approx(ref["miou"])
    assert m["boundary_f1"] == pytest.approx(ref["boundary_f1"])
    assert m["trimap_miou"] == pytest.approx(ref["trimap_miou"])
    np.testing.assert_allclose(m["iou"], ref["iou"].numpy())


def test_low_resolution_logits_are_resized_to_label_size() -> None:
    m = evaluate(LabelEcho(scale=2), _batches(), num_classes=C)
    # 8-px blocks survive 2x nearest-ish sampling + bilinear upsampling almost everywhere
    assert m["pixel_acc"] > 0.8


class TopLeftZero:
    """A fake method-B refiner: relabels the top-left 8x8 corner as class 0."""

    def refine(self, images, probs, return_changed=True):
        labels = probs.argmax(1)
        new = labels.clone()
        new[:, :8, :8] = 0
        return new, new != labels


def test_refiner_reported_side_by_side_with_fixed_and_broke_counts() -> None:
    batches = _batches()
    m = evaluate(LabelEcho(), batches, num_classes=C, refiner=TopLeftZero())
    labels = torch.cat([lab for _, lab in batches])
    corner = labels[:, :8, :8]
    valid = corner != 255
    # the base model is perfect, so every change breaks a right pixel and none fixes one
    expected_changed = int((valid & (corner != 0)).sum())
    r = m["refine"]
    assert r["changed"] == expected_changed > 0
    assert r["broke"] == expected_changed and r["fixed"] == 0
    assert r["pixels"] == int((labels != 255).sum())
    assert r["changed_fraction"] == pytest.approx(expected_changed / r["pixels"])
    assert m["miou"] == pytest.approx(1.0)
    assert m["refined"]["miou"] < 1.0
    text = format_metrics(m, ["a", "b", "c", "d"])
    assert "refined" in text and f"{expected_changed} of" in text


def test_refiner_that_fixes_errors_counts_fixes() -> None:
    class Wrong(nn.Module):  # predicts class 0 everywhere
        def forward(self, x):
            out = torch.zeros(x.shape[0], C, *x.shape[-2:])
            out[:, 0] = 1
            return out

    class Oracle:  # relabels with the truth hidden in the image
        def refine(self, images, probs, return_changed=True):
            new = images[:, 0].round().long()
            return new, new != probs.argmax(1)

    batches = _batches()
    m = evaluate(Wrong(), batches, num_classes=C, refiner=Oracle())
    labels = torch.cat([lab for _, lab in batches])
    wrong = int(((labels != 255) & (labels != 0)).sum())
    assert m["refine"]["fixed"] == wrong and m["refine"]["broke"] == 0
    assert m["refined"]["miou"] == pytest.approx(1.0)
    assert m["miou"] < 0.5


def test_distributed_path_with_single_rank_group(tmp_path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        m = evaluate(
            LabelEcho(), _batches(), num_classes=C, distributed=True, refiner=TopLeftZero()
        )
    finally:
        dist.destroy_process_group()
    assert m["miou"] == pytest.approx(1.0) and m["num_images"] == 6
    assert m["refine"]["changed"] > 0


def test_absent_class_is_nan_not_zero() -> None:
    batches = []
    for img, lab in _batches():
        lab = torch.where(lab == 3, 2, lab)  # class 3 never appears (ignore pixels kept)
        img[:, 0] = lab.clamp(max=C - 1).float()
        batches.append((img, lab))
    m = evaluate(LabelEcho(), batches, num_classes=C)
    assert math.isnan(m["iou"][3]) and m["miou"] == pytest.approx(1.0)


def test_loss_is_the_mean_cross_entropy_over_labelled_pixels() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 4, 5)
    labels = torch.randint(0, 3, (2, 4, 5))
    labels[0, 0] = 255

    class Fixed(torch.nn.Module):
        def forward(self, x):
            return logits[: x.shape[0]]

    result = evaluate(Fixed(), [(torch.zeros(2, 3, 4, 5), labels)], num_classes=3)
    expected = F.cross_entropy(logits, labels, ignore_index=255)  # mean over labelled pixels
    assert result["loss"] == pytest.approx(expected.item(), rel=1e-6)


def test_the_readmes_dualseg_engine_evaluate_calls_the_function() -> None:
    """``import dualseg`` then ``dualseg.engine.evaluate(model, loader, ...)``: once the module
    of that name was imported (here, and by fit), the package attribute was the module and
    the call a TypeError; and ``dualseg.engine`` needed an import of its own."""
    import dualseg
    import dualseg.engine.train

    m = dualseg.engine.evaluate(LabelEcho(), _batches(), num_classes=C)
    assert m["miou"] == pytest.approx(1.0)
    from dualseg.engine import evaluate as again

    assert again(LabelEcho(), _batches(), num_classes=C)["num_images"] == 6
    assert dualseg.data.build_dataset is not None and callable(dualseg.engine.fit)


def test_majority_baseline_and_one_class_warning() -> None:
    """The score of predicting the most frequent class everywhere, from the ground-truth
    counts; a model predicting one class on nearly every pixel is said to."""
    from dualseg.engine.evaluation import majority_baseline_miou, sanity_warnings

    cm = [[70, 0, 0], [20, 0, 0], [10, 0, 0]]  # every pixel predicted as class 0
    assert majority_baseline_miou(cm) == pytest.approx(0.7 / 3)
    metrics = {"confusion_matrix": cm, "miou": 0.7 / 3, "majority_baseline_miou": 0.7 / 3}
    warnings = sanity_warnings(metrics, ["a", "b", "c"])
    assert len(warnings) == 2 and "not above the majority-class baseline" in warnings[0]
    assert "'a', on 100.0%" in warnings[1]
    good = [[60, 5, 5], [2, 18, 0], [1, 0, 9]]
    assert (
        sanity_warnings(
            {
                "confusion_matrix": good,
                "miou": 0.8,
                "majority_baseline_miou": majority_baseline_miou(good),
            },
            ["a", "b", "c"],
        )
        == []
    )
