"""Sliding window and TTA through the Python API and the commands (eval, predict, refine
apply), and eval's reports: confusion matrix, per-class chart, ms/image, percent tables."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

# the tiny random checkpoint of test_predict (8 synthetic classes)
from checkpoint_helpers import SYNTHETIC as META
from checkpoint_helpers import SYNTHETIC_KWARGS as KWARGS
from checkpoint_helpers import synthetic_contract, write_synthetic_checkpoint
from dualseg.cli import main as cli_main
from dualseg.data import build_dataset, build_eval_transform, make_synthetic_dataset
from dualseg.engine.evaluation import evaluate
from dualseg.engine.predict import Segmenter, load_model
from dualseg.imaging import normalize
from dualseg.models import build_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """test_predict's random network, perturbed more: it predicts several classes, so TTA and
    tiles change its labels (measured: flip TTA changes about half of them)."""
    torch.manual_seed(0)
    model = build_model("dualseg_mobilenet_v2", **KWARGS)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    path = tmp_path_factory.mktemp("ckpt") / "model.pt"
    return write_synthetic_checkpoint(path, model=model.state_dict())


@pytest.fixture(scope="module")
def seg(ckpt) -> Segmenter:
    return load_model(ckpt)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    """Synthetic labels under noise images: the random model then predicts several classes."""
    root = make_synthetic_dataset(
        tmp_path_factory.mktemp("syn"), n_train=1, n_val=2, size=(48, 64), seed=0
    )
    rng = np.random.default_rng(1)
    for path in sorted((Path(root) / "images").glob("val_*.png")):
        Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(path)
    return Path(root)


@pytest.fixture
def rgb() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)


def _flip_mean(seg: Segmenter, rgb: np.ndarray) -> np.ndarray:
    """What --tta-flip must give: the mean of the image's and the mirrored image's probs."""
    mirrored = seg.predict_proba(np.ascontiguousarray(rgb[:, ::-1]))[:, :, ::-1]
    return (seg.predict_proba(rgb) + mirrored) / 2


def test_segmenter_tta_flip_averages_probabilities(seg, rgb) -> None:
    probs = seg.predict_proba(rgb, tta_flip=True)
    np.testing.assert_allclose(probs, _flip_mean(seg, rgb), atol=1e-5)
    np.testing.assert_array_equal(seg.predict(rgb, tta_flip=True), probs.argmax(0))
    assert not np.allclose(probs, seg.predict_proba(rgb), atol=1e-4)  # TTA did something


def test_segmenter_slide_mode(seg, rgb) -> None:
    whole = seg.predict_proba(rgb)
    # a window larger than the image is one tile: exactly the whole image
    np.testing.assert_allclose(seg.predict_proba(rgb, mode="slide", window=(64, 64)), whole)
    tiled = seg.predict_proba(rgb, mode="slide", window=(32, 32), stride=(16, 16))
    assert tiled.shape == whole.shape
    np.testing.assert_allclose(tiled.sum(0), 1.0, atol=1e-5)
    assert not np.allclose(tiled, whole, atol=1e-3)  # the network saw 32x32 crops
    batch = seg.predict_batch([rgb, rgb], mode="slide", window=(32, 32), stride=(16, 16))
    np.testing.assert_array_equal(batch[1], tiled.argmax(0))


def test_eval_reports_confusion_matrix_figures_timing_in_percent(
    ckpt, synthetic, tmp_path, capsys
) -> None:
    out = tmp_path / "eval"
    assert cli_main(["eval", "-c", str(ckpt), "--data", str(synthetic), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    m = json.loads((out / "metrics.json").read_text())
    cm = np.array(m["confusion_matrix"])
    assert cm.shape == (8, 8) and (cm.sum(0) > 0).sum() > 1  # several classes predicted
    # rows are the ground truth: a row sums to that class's labelled pixels
    val = build_dataset(synthetic, split="val", preset="synthetic")
    gt = np.concatenate([val.load_pair(i)[1].ravel() for i in range(len(val))])
    np.testing.assert_array_equal(cm.sum(1), np.bincount(gt[gt != 255], minlength=8))
    iou = np.diag(cm) / (cm.sum(0) + cm.sum(1) - np.diag(cm)).clip(min=1)
    present = [v is not None for v in m["iou"]]
    np.testing.assert_allclose(np.array(m["iou"], float)[present], iou[present])
    assert 0 <= m["miou"] <= 1 and m["ms_per_image"] > 0 and m["batch_size"] == 1
    assert m["inference"] == {
        "mode": "whole",
        "window": None,
        "stride": None,
        "tta_scales": [1.0],
        "tta_flip": False,
    }
    for name in ("confusion_matrix.png", "per_class_iou.png"):
        assert Image.open(out / name).format == "PNG"
    # percent with one decimal in the printed table and means; the time next to them
    assert f"mIoU: {100 * m['miou']:.1f}  " in text
    assert re.search(r"inference: \d+\.\d ms/image \(median, batch 1\)", text)


def test_eval_tta_and_slide_options_reach_the_metrics(ckpt, synthetic, tmp_path) -> None:
    out = tmp_path / "tta"
    argv = ["eval", "-c", str(ckpt), "--data", str(synthetic), "--out", str(out)]
    argv += ["--tta-flip", "--tta-scales", "0.5", "1.0", "--mode", "slide", "--window", "32", "32"]
    assert cli_main(argv) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["inference"]["stride"] == [22, 22]  # 2/3 of the window, rounded up
    seg = load_model(ckpt)
    loader = torch.utils.data.DataLoader(
        build_dataset(synthetic, split="val", preset="synthetic", transform=build_eval_transform())
    )
    expected = evaluate(
        seg.model,
        loader,
        num_classes=8,
        mode="slide",
        window=(32, 32),
        tta_scales=(0.5, 1.0),
        tta_flip=True,
    )
    assert m["confusion_matrix"] == expected["confusion_matrix"]
    plain = evaluate(seg.model, loader, num_classes=8)
    assert plain["confusion_matrix"] != expected["confusion_matrix"]


class _Recorder:
    """A fake refiner that keeps the scores evaluate hands it."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def refine(self, images, probs, return_changed=True):
        self.seen.append(probs.clone())
        labels = probs.argmax(1)
        return labels, torch.zeros_like(labels, dtype=torch.bool)


def test_evaluate_gives_the_refiner_the_tta_averaged_scores(seg, rgb) -> None:
    x = torch.from_numpy(normalize([rgb]))
    rec = _Recorder()
    m = evaluate(
        seg.model,
        [(x, torch.zeros(1, 40, 56, dtype=torch.long))],
        num_classes=8,
        refiner=rec,
        tta_flip=True,
    )
    (scores,) = rec.seen  # the logits (TTA: log of the mean probabilities), as the base's
    np.testing.assert_allclose(scores[0].softmax(0).numpy(), _flip_mean(seg, rgb), atol=1e-5)
    assert m["refine"]["ms_per_image"] >= 0 and m["refine"]["changed"] == 0


def _tiny_refiner(path: Path) -> Path:
    from dualseg.refine import BoundaryRefiner, RefinerConfig
    from dualseg.refine.embedding import build_embedding_net

    torch.manual_seed(0)
    cfg = RefinerConfig(embed_dim=8, output_stride=16, aspp_rates=(2, 3), top_n=3, radius=3)
    net = build_embedding_net(cfg.backbone, embed_dim=8, output_stride=16, aspp_rates=(2, 3))
    protos = torch.randn(8, 8)
    refiner = BoundaryRefiner(
        net, protos, torch.ones(8, dtype=torch.bool), class_names=META.class_names, config=cfg
    )
    return refiner.save(path)


def test_refine_apply_refines_the_tta_scores(ckpt, seg, rgb, tmp_path, capsys) -> None:
    from dualseg.refine import BoundaryRefiner

    refiner_path = _tiny_refiner(tmp_path / "refiner.pt")
    image = tmp_path / "in.png"
    Image.fromarray(rgb).save(image)
    out = tmp_path / "out"
    argv = ["refine", "apply", "-r", str(refiner_path), "--base", str(ckpt), str(image)]
    assert cli_main([*argv, "--out", str(out), "--device", "cpu", "--tta-flip"]) == 0
    got = np.asarray(Image.open(out / "labels" / "in.png"))
    refiner = BoundaryRefiner.load(refiner_path)
    expected = refiner.refine(rgb, _flip_mean(seg, rgb))
    assert (got == expected).mean() > 0.999  # float near-ties aside, the same labels
    # saved probabilities cannot be re-augmented: one clear line instead
    probs_dir = tmp_path / "probs"
    assert cli_main(["predict", "-c", str(ckpt), str(image), "-o", str(probs_dir), "--probs"]) == 0
    bad = ["refine", "apply", "-r", str(refiner_path), "--base", str(probs_dir), str(image)]
    said = f"--base {probs_dir} holds saved probabilities: pass a checkpoint"
    assert cli_main([*bad, "--out", str(tmp_path / "o2"), "--tta-flip"]) == 1
    assert said in capsys.readouterr().err
    # dense CRF as well: the maps were averaged with their own mirror image, without a word
    pytest.importorskip("pydensecrf.densecrf")
    crf = ["refine", "apply", "--crf", "--base", str(probs_dir), str(image), "--out"]
    for flags in (["--tta-flip"], ["--mode", "slide", "--window", "16", "16"]):
        assert cli_main([*crf, str(tmp_path / "o3"), *flags]) == 1
        assert said in capsys.readouterr().err and not (tmp_path / "o3").exists()


def test_predict_tta_probs_and_onnx_refusal(ckpt, seg, rgb, tmp_path, capsys) -> None:
    image = tmp_path / "in.png"
    Image.fromarray(rgb).save(image)
    out = tmp_path / "pred"
    argv = ["predict", "-c", str(ckpt), str(image), "-o", str(out), "--probs", "--tta-flip"]
    assert cli_main(argv) == 0
    with np.load(out / "probs" / "in.npz") as z:
        np.testing.assert_allclose(z["probs"].astype(np.float32), _flip_mean(seg, rgb), atol=2e-3)
    label = np.asarray(Image.open(out / "labels" / "in.png"))
    assert (label == _flip_mean(seg, rgb).argmax(0)).mean() > 0.999
    capsys.readouterr()
    onnx = ["predict", "--onnx", str(tmp_path / "m.onnx"), str(image), "-o", str(out)]
    assert cli_main([*onnx, "--mode", "slide"]) == 1
    assert "need --checkpoint" in capsys.readouterr().err
    assert cli_main([*argv, "--mode", "slide", "--stride", "600", "600"]) == 1
    assert "--stride 600 600 is larger than --window 512 512" in capsys.readouterr().err
    assert cli_main([*argv, "--window", "32", "32"]) == 1  # tiles, but whole mode
    assert "add --mode slide" in capsys.readouterr().err


def test_pointwise_model_slide_equals_whole_through_evaluate() -> None:
    torch.manual_seed(0)
    model = nn.Conv2d(3, 4, 1)
    x = torch.randn(2, 3, 48, 48)
    y = torch.randint(0, 4, (2, 48, 48))
    whole = evaluate(model, [(x, y)], num_classes=4)
    slide = evaluate(model, [(x, y)], num_classes=4, mode="slide", window=(16, 16))
    assert slide["confusion_matrix"] == whole["confusion_matrix"]


def test_eval_of_mixed_size_images_in_one_batch_says_use_batch_size_1(
    ckpt, tmp_path, capsys
) -> None:
    root = make_synthetic_dataset(tmp_path / "syn", n_train=1, n_val=2, size=(32, 48), seed=0)
    for sub in ("images", "labels"):  # the second validation image is twice as large
        path = Path(root) / sub / "val_00001.png"
        Image.open(path).resize((96, 64), Image.NEAREST).save(path)
    args = ["eval", "-c", str(ckpt), "--data", str(root), "--out", str(tmp_path / "eval")]
    assert cli_main([*args, "--batch-size", "2"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "48x32 and 96x64 px" in err and "use --batch-size 1" in err
    assert not (tmp_path / "eval").exists()
    assert cli_main([*args, "--batch-size", "1", "--quiet"]) == 0  # one at a time: fine


def test_eval_reads_labels_as_the_checkpoint_was_trained(synthetic, tmp_path, capsys) -> None:
    """A model trained with --data.label_map / --data.ignore_index is scored on the classes it
    learnt: eval takes both from the checkpoint unless a flag says otherwise, with a note."""
    import shutil

    root = tmp_path / "raw"
    shutil.copytree(synthetic, root)
    truth = []
    for path in sorted((root / "labels").glob("val_*.png")):
        label = np.array(Image.open(path))
        truth.append(label.copy())
        label[label == 2] = 200  # class 2 stored as raw 200, as training mapped it
        Image.fromarray(label).save(path)
    gt = np.concatenate([t.ravel() for t in truth])
    assert (gt == 2).any() and (gt == 7).any()
    ckpt = write_synthetic_checkpoint(
        tmp_path / "mapped.pt",
        config={"data": {"preset": "synthetic", "label_map": "200:2", "ignore_index": 7}},
        label_contract=synthetic_contract({200: 2}, ignore_value=7),
    )
    out = tmp_path / "eval"
    argv = ["eval", "-c", str(ckpt), "--data", str(root), "--out", str(out), "--quiet"]
    assert cli_main(argv) == 0
    assert "data.label_map 200:2, data.ignore_index 7" in capsys.readouterr().err
    rows = np.array(json.loads((out / "metrics.json").read_text())["confusion_matrix"]).sum(1)
    assert rows[2] == (gt == 2).sum()  # raw 200 scored as class 2
    assert rows[7] == 0  # raw 7 ignored, as in training
    # a flag wins: without the map, raw 200 is no class of the model's, one line
    assert cli_main([*argv, "--overwrite", "--label-map", "none", "--ignore-index", "auto"]) == 1
    assert "200" in capsys.readouterr().err


def test_overwrite_leaves_no_earlier_output_beside_the_new_ones(ckpt, synthetic, tmp_path) -> None:
    """--overwrite replaces a run: what the new run does not write (predict's probs without
    --probs, eval's refined confusion matrix without --refiner) goes, not another model's."""
    image = next((synthetic / "images").glob("val_*.png"))
    out = tmp_path / "pred"
    base = ["predict", str(image), "-c", str(ckpt), "-o", str(out), "--quiet"]
    assert cli_main([*base, "--probs"]) == 0
    assert (out / "probs" / f"{image.stem}.npz").exists()
    assert cli_main([*base, "--overwrite"]) == 0
    assert not (out / "probs" / f"{image.stem}.npz").exists()
    before = (out / "labels" / f"{image.stem}.png").exists()
    broken = tmp_path / "in" / image.name  # the same name, now unreadable: skipped
    broken.parent.mkdir()
    broken.write_bytes(b"not a png")
    assert before and cli_main([*base[:1], str(broken), *base[2:], "--overwrite"]) == 1
    assert not [
        p for f in ("labels", "color", "overlay") for p in (out / f).glob(f"{image.stem}.*")
    ]
    ev = tmp_path / "eval"
    argv = ["eval", "-c", str(ckpt), "--data", str(synthetic), "--out", str(ev), "--quiet"]
    assert cli_main([*argv, "--refiner", str(_tiny_refiner(tmp_path / "r.pt"))]) == 0
    assert (ev / "confusion_matrix_refined.png").exists()
    assert cli_main([*argv, "--overwrite"]) == 0
    assert not (ev / "confusion_matrix_refined.png").exists()
    assert (ev / "confusion_matrix.png").exists() and (ev / "per_class_iou.png").exists()


class _TieBreaker:
    """A fake refiner that relabels nothing but, like the real one, takes its base labels from
    the probabilities: at an exact tie its argmax is the first class."""

    def refine(self, images, probs, return_changed=True):
        labels = probs.argmax(1)
        return labels, torch.zeros_like(labels, dtype=torch.bool)


def test_where_the_refiner_relabels_nothing_the_scored_base_labels_are_kept() -> None:
    class Tie(nn.Module):  # logits 1e-8 apart: argmax class 1, softmax ties them at class 0
        def forward(self, x):
            logits = torch.zeros(x.shape[0], 2, *x.shape[-2:])
            logits[:, 1] = 1e-8
            return logits

    labels = torch.ones(1, 8, 8, dtype=torch.long)
    m = evaluate(Tie(), [(torch.zeros(1, 3, 8, 8), labels)], num_classes=2, refiner=_TieBreaker())
    assert m["miou"] == 1.0 and m["refined"]["miou"] == 1.0
    assert m["refine"]["changed"] == 0


def test_eval_finds_the_calibration_images_by_content_under_any_split_name(
    ckpt, synthetic, tmp_path, capsys
) -> None:
    from dualseg.io import file_digest
    from dualseg.refine import BoundaryRefiner

    val = sorted(Path(p) for p, _ in build_dataset(synthetic, split="val").samples)
    copy = tmp_path / "copy.png"  # one val image under another name and folder
    copy.write_bytes(val[0].read_bytes())
    refiner = BoundaryRefiner.load(_tiny_refiner(tmp_path / "r.pt"))
    refiner.calibration = {
        "split": "dev",
        "images": 2,
        "metric": "miou",
        "rows": [],
        "image_digests": [file_digest(copy), "0" * 16],
    }
    path = refiner.save(tmp_path / "calibrated.pt")
    argv = ["eval", "-c", str(ckpt), "--data", str(synthetic), "--refiner", str(path), "--quiet"]
    assert cli_main([*argv, "--out", str(tmp_path / "ev")]) == 0
    said = f"chosen on 1 of the {len(val)} images evaluated here (its calibration split, dev)"
    assert said in capsys.readouterr().err
    # a calibration on other images: nothing to say, whatever the split is called
    refiner.calibration = {**refiner.calibration, "split": "val", "image_digests": ["0" * 16]}
    path = refiner.save(tmp_path / "elsewhere.pt")
    argv = ["eval", "-c", str(ckpt), "--data", str(synthetic), "--refiner", str(path), "--quiet"]
    assert cli_main([*argv, "--out", str(tmp_path / "ev2")]) == 0
    assert "optimistic" not in capsys.readouterr().err


def test_eval_says_when_a_model_predicts_one_class_everywhere(synthetic, tmp_path, capsys):
    """A model collapsed to one class was reported as a result: its mIoU beside nothing to
    read it against. eval prints the majority-class baseline and warns."""
    torch.manual_seed(0)
    model = build_model("dualseg_mobilenet_v2", **KWARGS)
    state = model.state_dict()
    with torch.no_grad():  # every class-score layer: zero weights, class 1 biased up
        for key, t in state.items():
            if t.dim() >= 1 and t.shape[0] == META.num_classes and key.endswith(("weight", "bias")):
                t.zero_()
                if key.endswith("bias"):
                    t[1] = 10.0
    ckpt = write_synthetic_checkpoint(tmp_path / "one.pt", model=state)
    out = tmp_path / "e"
    argv = ["eval", "-c", str(ckpt), "--data", str(synthetic), "-o", str(out), "-q",
            "--device", "cpu"]  # fmt: skip
    assert cli_main(argv) == 0
    captured = capsys.readouterr()
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0 < metrics["majority_baseline_miou"] < 1
    assert "majority-class baseline" in captured.out
    assert "warning: the model predicts one class" in captured.err
    assert "100.0% of the labelled pixels" in captured.err
