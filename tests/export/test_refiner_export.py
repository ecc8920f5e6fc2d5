"""Method B exported: embedding model + JSON sidecar reproduce BoundaryRefiner.refine."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dualseg.cli import main
from dualseg.errors import CheckpointError
from dualseg.export.runtime import load_exported_refiner
from dualseg.refine import BoundaryRefiner, RefinerConfig, build_embedding_net


@pytest.fixture(scope="module")
def refiner(tmp_path_factory):
    torch.manual_seed(0)
    cfg = RefinerConfig(embed_dim=16, input_scale=0.5, radius=3, top_n=2)
    net = build_embedding_net(
        cfg.backbone,
        embed_dim=cfg.embed_dim,
        output_stride=cfg.output_stride,
        aspp_rates=cfg.aspp_rates,
    )
    protos = torch.randn(3, cfg.embed_dim) * 0.1
    present = torch.tensor([True, True, False])  # class 2 has no prototype: never chosen
    r = BoundaryRefiner(net, protos, present, class_names=["a", "b", "c"], config=cfg)
    path = tmp_path_factory.mktemp("refiner") / "refiner.pt"
    r.save(path)
    return BoundaryRefiner.load(path), path


def _case(seed: int = 0):
    """An image and base-model probabilities with three vertical stripes (boundaries)."""
    rng = np.random.default_rng(seed)
    h, w = 40, 56
    label = np.zeros((h, w), np.int64)
    label[:, 20:] = 1
    label[:, 38:] = 2
    logits = rng.normal(0, 1.0, (3, h, w)).astype(np.float32)
    np.put_along_axis(logits, label[None], 3.0, axis=0)
    probs = np.exp(logits) / np.exp(logits).sum(0, keepdims=True)
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    return image, probs


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_exported_refiner_matches_boundary_refiner(refiner, tmp_path, fmt):
    ref, path = refiner
    out = tmp_path / f"emb.{'onnx' if fmt == 'onnx' else 'pt'}"
    assert main(["export", "--refiner", str(path), "--format", fmt, "--out", str(out),
                 "--dynamic"]) == 0  # fmt: skip
    sidecar = json.loads((tmp_path / "emb.json").read_text())
    assert sidecar["class_names"] == ["a", "b", "c"] and sidecar["config"]["top_n"] == 2
    exported = load_exported_refiner(out)
    image, probs = _case()
    want, want_changed = ref.refine(image, probs, return_changed=True)
    got, got_changed = exported.refine(image, probs, return_changed=True)
    assert want_changed.sum() > 0  # the case exercises P5
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_changed, want_changed)
    # batch form with tensors, as 'refine apply' calls it: tensors out
    x = torch.from_numpy((image / 255.0 - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225])
    x = x.permute(2, 0, 1)[None].float()
    p = torch.from_numpy(probs)[None]
    t_want = ref.refine(x, p)
    t_got = exported.refine(x, p)
    assert isinstance(t_got, torch.Tensor) and t_got.dtype == torch.int64
    torch.testing.assert_close(t_got, t_want)
    # batch form with numpy arrays: both answer numpy, alike
    n_want, n_changed = ref.refine(x.numpy(), p.numpy(), return_changed=True)
    n_got = exported.refine(x.numpy(), p.numpy())
    assert isinstance(n_want, np.ndarray) and isinstance(n_changed, np.ndarray)
    np.testing.assert_array_equal(n_want, t_want.numpy())
    np.testing.assert_array_equal(n_got, n_want)


def test_missing_sidecar_and_class_mismatch(refiner, tmp_path):
    _, path = refiner
    out = tmp_path / "emb.onnx"
    assert main(["export", "--refiner", str(path), "--out", str(out), "--no-verify"]) == 0
    exported = load_exported_refiner(tmp_path / "emb.json")  # the sidecar works as well
    with pytest.raises(CheckpointError, match="fit for 3"):
        exported.check_classes(None, 5)
    sidecar = json.loads((tmp_path / "emb.json").read_text())
    sidecar["config"]["blocked_switches"] = [[0, 7]]  # a class the refiner does not have
    (tmp_path / "bad.json").write_text(json.dumps(sidecar))
    with pytest.raises(CheckpointError, match=r"bad.json: blocked switch 0:7 .*re-export"):
        load_exported_refiner(tmp_path / "bad.json")
    (tmp_path / "emb.json").unlink()
    with pytest.raises(CheckpointError, match="sidecar not found"):
        load_exported_refiner(out)
    # the refiner file itself: said what it is and how to open it, not "sidecar not found"
    with pytest.raises(CheckpointError, match=r"is a PyTorch file, not an exported refiner"):
        load_exported_refiner(path)


def test_load_refiner_opens_both_kinds_and_overrides_apply(refiner, tmp_path):
    import dataclasses

    from dualseg.export.runtime import ExportedRefiner, load_refiner

    _, path = refiner
    assert isinstance(load_refiner(path), BoundaryRefiner)
    ts = tmp_path / "emb.pt"
    assert main(["export", "--refiner", str(path), "--format", "torchscript", "--out", str(ts),
                 "--no-verify"]) == 0  # fmt: skip
    exported = load_refiner(ts)
    assert isinstance(exported, ExportedRefiner)
    # 'refine apply --top-n/--radius' replace fields of the config, as for BoundaryRefiner
    ref = load_refiner(path)
    image, probs = _case(1)
    for r in (exported, ref):
        r.config = dataclasses.replace(r.config, radius=1, top_n=3, blocked_switches=((0, 1),))
    got, got_changed = exported.refine(image, probs, return_changed=True)
    want, want_changed = ref.refine(image, probs, return_changed=True)
    np.testing.assert_array_equal(got, want)
    assert 0 < got_changed.sum() == want_changed.sum()


def test_refine_apply_accepts_the_exported_pair(refiner, tmp_path):
    """'dualseg refine apply --refiner emb.onnx' gives the labels of the original refiner."""
    from PIL import Image

    ref, path = refiner
    onnx = tmp_path / "emb.onnx"
    args = ["export", "--refiner", str(path), "--format", "onnx", "--out", str(onnx)]
    assert main([*args, "--dynamic", "--no-verify"]) == 0
    image, probs = _case(2)
    Image.fromarray(image).save(tmp_path / "im.png")
    base = tmp_path / "base"
    base.mkdir()
    np.savez_compressed(
        base / "im.npz", probs=probs.astype(np.float16), class_names=np.array(["a", "b", "c"])
    )
    out = tmp_path / "out"
    apply = ["refine", "apply", str(tmp_path / "im.png"), "--refiner", str(onnx)]
    assert main([*apply, "--base", str(base), "--out", str(out), "--device", "cpu"]) == 0
    got = np.asarray(Image.open(out / "labels" / "im.png"))
    want = ref.refine(image, probs.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(got, want)


def test_eval_scores_the_exported_refiner_as_the_fitted_one(refiner, tmp_path):
    """``eval --refiner emb.onnx``: the scores of the refiner it was exported from."""
    from PIL import Image

    _, path = refiner
    onnx = tmp_path / "emb.onnx"
    args = ["export", "--refiner", str(path), "--format", "onnx", "--out", str(onnx)]
    assert main([*args, "--dynamic", "--no-verify"]) == 0
    data = tmp_path / "data"
    for sub in ("images", "labels"):
        (data / sub).mkdir(parents=True)
    image, probs = _case(4)
    Image.fromarray(image).save(data / "images" / "a.png")
    Image.fromarray(probs.argmax(0).astype(np.uint8)).save(data / "labels" / "a.png")
    (data / "val.txt").write_text("images/a.png labels/a.png\n")
    meta = {
        "name": "abc",
        "class_names": ["a", "b", "c"],
        "palette": [[0, 0, 0], [9, 9, 9], [99] * 3],
    }
    (data / "meta.json").write_text(json.dumps(meta))
    np.save(tmp_path / "logits.npy", np.log(probs)[None])
    (tmp_path / "stripes.py").write_text(
        "import numpy as np, torch\n"
        f"LOGITS = torch.from_numpy(np.load({str(tmp_path / 'logits.npy')!r}))\n"
        "class Fixed(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return LOGITS.expand(x.shape[0], -1, -1, -1)\n"
        "model = Fixed()\n"
    )
    scores = []
    for name, ref in (("fitted", path), ("exported", onnx)):
        argv = ["eval", "-c", f"{tmp_path / 'stripes.py'}:model", "--data", str(data)]
        argv += ["--refiner", str(ref), "--out", str(tmp_path / name), "--quiet"]
        assert main([*argv, "--device", "cpu"]) == 0
        scores.append(json.loads((tmp_path / name / "metrics.json").read_text()))
    fitted, exported = scores
    assert fitted["refine"]["changed"] > 0
    assert exported["refine"] | {"ms_per_image": 0} == fitted["refine"] | {"ms_per_image": 0}
    assert exported["refined"]["confusion_matrix"] == fitted["refined"]["confusion_matrix"]


def test_static_refiner_export_runs_on_other_sizes(refiner, tmp_path):
    """A static export (no --dynamic) resizes other image sizes to its own and still refines
    only near-boundary pixels, to labels among the Top-N."""
    _, path = refiner
    onnx = tmp_path / "static.onnx"
    args = ["export", "--refiner", str(path), "--format", "onnx", "--out", str(onnx)]
    assert main([*args, "--size", "32", "32", "--no-verify"]) == 0
    image, probs = _case(3)  # 40x56, not 32x32
    labels, changed = load_exported_refiner(onnx).refine(image, probs, return_changed=True)
    assert labels.shape == probs.shape[1:]
    top2 = np.argsort(-probs, axis=0)[:2]
    assert ((labels[None] == top2).any(0)).all()
    assert not changed[:, :10].any()  # far from the stripes' borders (x = 20, 38): untouched
    # a static TorchScript export runs at its size too (it ran at full size: other answers)
    ts = tmp_path / "static_ts.pt"
    args = ["export", "--refiner", str(path), "--format", "torchscript", "--out", str(ts)]
    assert main([*args, "--size", "32", "32", "--no-verify"]) == 0
    exported = load_exported_refiner(ts)
    assert exported.runner.static_hw == (32, 32)
    np.testing.assert_array_equal(exported.refine(image, probs), labels)


def test_exported_refiner_batch_form_checks_its_images_as_boundary_refiner(refiner, tmp_path):
    """Raw 0-255 pixels in the batch form were read as normalized images, silently."""
    from dualseg.errors import DataError

    _, path = refiner
    out = tmp_path / "emb.onnx"
    assert main(["export", "--refiner", str(path), "--out", str(out), "--dynamic"]) == 0
    exported = load_exported_refiner(out)
    image, probs = _case()
    raw = torch.from_numpy(image).permute(2, 0, 1)[None]  # uint8 [1,3,H,W]
    p = torch.from_numpy(probs)[None]
    for batch in (raw, raw.numpy()):
        with pytest.raises(DataError, match="normalized float images, got"):
            exported.refine(batch, p)
    with pytest.raises(DataError, match=r"\[B,3,H,W\]"):
        exported.refine(torch.zeros(1, 4, 40, 56), p)
    with pytest.warns(UserWarning, match="looks like RGB before ImageNet normalization"):
        exported.refine(raw.float() / 255, p)


def test_the_export_keeps_the_calibration_and_its_notes(refiner, tmp_path):
    """The fit's held-out check (gate 0: refinement did not help) and the base it was chosen
    for travel with the export: its note and the other-base warning were lost there."""
    import dataclasses

    from dualseg.refine.base import other_calibration_base

    ref, _ = refiner
    calibrated = BoundaryRefiner(
        ref.net, ref.prototypes, ref.present, class_names=ref.class_names,
        config=dataclasses.replace(ref.config, gate_margin=0.0), palette=[[1, 2, 3]] * 3,
    )  # fmt: skip
    calibrated.calibration = {"split": "dev", "images": 4, "metric": "miou", "rows": [],
                              "base_fingerprint": "another-base"}  # fmt: skip
    path = calibrated.save(tmp_path / "calibrated.pt")
    out = tmp_path / "emb.onnx"
    assert main(["export", "--refiner", str(path), "--out", str(out), "--no-verify"]) == 0
    exported = load_exported_refiner(out)
    assert exported.calibration == calibrated.calibration
    assert exported.palette == ((1, 2, 3),) * 3  # as BoundaryRefiner.palette
    assert exported.calibration_note() == calibrated.calibration_note() is not None
    assert other_calibration_base(exported, torch.nn.Linear(2, 2))


def test_export_refiner_leaves_the_callers_refiner_as_it_was(refiner, tmp_path):
    from dualseg.export.export import export_refiner

    ref, _ = refiner
    ref.net.train()  # the export runs in eval mode: the caller's mode comes back
    try:
        export_refiner(ref, tmp_path / "emb.onnx")
        assert ref.net.training and ref.device.type == "cpu"
    finally:
        ref.net.eval()
