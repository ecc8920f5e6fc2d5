"""Segmenter / load_model, ``dualseg predict`` and ``dualseg eval`` on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import dualseg
from checkpoint_helpers import SYNTHETIC as META
from checkpoint_helpers import SYNTHETIC_KWARGS as KWARGS
from checkpoint_helpers import contract, write_synthetic_checkpoint
from dualseg.cli import main as cli_main
from dualseg.data import make_synthetic_dataset
from dualseg.engine.outputs import PROBS_KEYS, collect_images
from dualseg.engine.predict import Segmenter, as_rgb_array, load_model
from dualseg.errors import CheckpointError, DataError


@pytest.fixture
def rgb() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)  # odd size on purpose


def test_load_model_is_the_public_api(ckpt, seg) -> None:
    assert dualseg.load_model is load_model
    assert seg.meta.class_names == META.class_names
    assert seg.num_classes == 8 and seg.device == torch.device("cpu")
    assert not seg.model.training


def test_a_model_in_train_mode_predicts_as_in_eval_mode_and_keeps_its_mode(ckpt, rgb) -> None:
    model = load_model(ckpt).model
    ref = Segmenter(model, META).predict_proba(rgb)
    model.train()  # a model being fine-tuned: BatchNorm would use, and learn, the batch's stats
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    assert stats
    seg = Segmenter(model, META)
    np.testing.assert_array_equal(seg.predict_proba(rgb), ref)
    assert model.training  # given back in its own mode
    # each submodule in its own: BatchNorm frozen for fine-tuning stays frozen
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    norms[0].eval()
    seg.predict(rgb)
    assert model.training and not norms[0].training and norms[1].training
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in stats.items())


def test_predict_accepts_path_pil_numpy_tensor_at_original_size(seg, rgb, tmp_path) -> None:
    path = tmp_path / "im.png"
    Image.fromarray(rgb).save(path)
    ref = seg.predict(rgb)
    assert ref.shape == (37, 53) and ref.dtype == np.uint8 and ref.max() < 8
    chw_float = torch.from_numpy(rgb).permute(2, 0, 1).float() / 255
    for form in (
        str(path),
        path,
        Image.fromarray(rgb),
        torch.from_numpy(rgb),  # uint8 HWC
        torch.from_numpy(rgb).permute(2, 0, 1),  # uint8 CHW
        chw_float,
        chw_float[None],
    ):
        np.testing.assert_array_equal(seg.predict(form), ref)
    gray = seg.predict(rgb[:, :, 0])  # HxW gray -> 3 channels
    assert gray.shape == (37, 53)


def test_predict_proba_and_batch_of_mixed_sizes(seg, rgb) -> None:
    probs = seg.predict_proba(rgb)
    assert probs.shape == (8, 37, 53) and probs.dtype == np.float32
    np.testing.assert_allclose(probs.sum(0), 1.0, atol=1e-5)
    np.testing.assert_array_equal(probs.argmax(0), seg.predict(rgb))
    other = np.ascontiguousarray(rgb[:20, :31])
    batch = seg.predict_batch([rgb, other, rgb[::-1].copy()], batch_size=2, return_probs=True)
    assert [lab.shape for lab, _ in batch] == [(37, 53), (20, 31), (37, 53)]
    # grouping by size: each result equals the image segmented on its own
    np.testing.assert_array_equal(batch[1][0], seg.predict(other))
    np.testing.assert_allclose(batch[0][1], probs, atol=1e-5)


def test_bad_inputs_raise_clear_errors(seg, tmp_path) -> None:
    with pytest.raises(DataError, match="not found"):
        seg.predict(tmp_path / "missing.png")
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"bad\.png"):
        seg.predict(bad)
    with pytest.raises(DataError, match=r"\[0, 1\]"):
        seg.predict(torch.randn(3, 16, 16) * 3)  # a normalized tensor
    with pytest.raises(DataError, match="cannot segment"):
        seg.predict(42)
    with pytest.raises(DataError, match="uint8"):
        as_rgb_array(np.zeros((4, 4, 3), np.int32))


def test_corrupt_and_incompatible_checkpoints(ckpt, tmp_path) -> None:
    truncated = tmp_path / "cut.pt"
    truncated.write_bytes(ckpt.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_model(truncated)
    names, palette = [f"c{i}" for i in range(11)], [[i, i, i] for i in range(11)]
    eleven = {"class_names": names, "palette": palette, "label_contract": contract(names, palette)}
    wrong = write_synthetic_checkpoint(
        tmp_path / "wrong.pt", model_kwargs={**KWARGS, "num_classes": 11}, **eleven
    )  # weights of 8 classes, claims 11 (names and colours of 11)
    with pytest.raises(CheckpointError, match="does not match"):
        load_model(wrong)
    # names and colours of 8 for a model of 11: said before the weights are looked at
    short = write_synthetic_checkpoint(
        tmp_path / "short.pt", model_kwargs={**KWARGS, "num_classes": 11}
    )
    with pytest.raises(CheckpointError, match=r"8 class names .* a model of 11 classes"):
        load_model(short)
    assert cli_main(["predict", "--checkpoint", str(truncated), str(tmp_path), "-o", "x"]) == 1


def test_cli_predict_files_folders_globs(ckpt, rgb, tmp_path, capsys) -> None:
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    Image.fromarray(rgb).save(src / "a.png")
    Image.fromarray(rgb[:24, :40]).save(src / "sub" / "a.jpg")
    Image.fromarray(rgb[:30]).save(tmp_path / "b.png")
    out = tmp_path / "out"
    code = cli_main(
        [
            *("predict", "-c", str(ckpt), str(src), str(tmp_path / "b.*")),
            *("--out", str(out), "--probs", "--batch-size", "2"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    for name, size in (("a", (37, 53)), ("sub/a", (24, 40)), ("b", (30, 53))):
        label = np.asarray(Image.open(out / "labels" / f"{name}.png"))
        assert label.shape == size and label.max() < 8
        assert np.asarray(Image.open(out / "color" / f"{name}.png")).shape == (*size, 3)
        assert np.asarray(Image.open(out / "overlay" / f"{name}.png")).shape == (*size, 3)
        with np.load(out / "probs" / f"{name}.npz") as z:
            assert set(z.files) == set(PROBS_KEYS)
            assert z["probs"].shape == (8, *size)
            np.testing.assert_array_equal(z["probs"].astype(np.float32).argmax(0), label)
            assert list(z["class_names"]) == list(META.class_names)
    assert "segmented 3 image(s)" in capsys.readouterr().out


def test_collect_images_errors_and_name_clashes(tmp_path, rgb) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    for d in ("x", "y"):
        Image.fromarray(rgb).save(tmp_path / d / "im.png")
    found = collect_images([str(tmp_path / "x" / "im.png"), str(tmp_path / "y" / "im.png")])
    assert [n for _, n in found] == ["im", "im_1"]
    with pytest.raises(DataError, match=r"nope\.png.*no such file.*\*\.tif"):
        collect_images([str(tmp_path / "nope.png"), str(tmp_path / "*.tif")])


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    return make_synthetic_dataset(
        tmp_path_factory.mktemp("syn"), n_train=1, n_val=2, size=(48, 64), seed=0
    )


def test_cli_eval_writes_metrics_and_predictions(ckpt, synthetic, tmp_path, capsys) -> None:
    out, preds = tmp_path / "eval", tmp_path / "preds"
    code = cli_main(
        [
            *("eval", "-c", str(ckpt), "--data", str(synthetic), "--out", str(out)),
            *("--save-predictions", str(preds), "--batch-size", "2"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("miou", "iou", "pixel_acc", "boundary_f1", "trimap_miou", "class_names"):
        assert key in metrics
    assert metrics["num_images"] == 2 and len(metrics["iou"]) == 8
    assert 0.0 <= metrics["pixel_acc"] <= 1.0
    text = capsys.readouterr().out
    assert "mIoU" in text and "vegetation" in text and "boundary F1" in text
    assert sorted(p.name for p in (preds / "labels").iterdir()) == [
        "val_00000.png",
        "val_00001.png",
    ]
    assert (preds / "color" / "val_00000.png").is_file()


def test_cli_eval_class_count_mismatch(ckpt, synthetic, capsys, tmp_path) -> None:
    import shutil

    # the dataset's own meta.json names other classes than the preset: that comes first
    code = cli_main(["eval", "-c", str(ckpt), "--data", str(synthetic), "--preset", "camvid"])
    assert code == 1
    assert "--preset camvid has the classes" in capsys.readouterr().err
    bare = Path(shutil.copytree(synthetic, tmp_path / "bare"))
    (bare / "meta.json").unlink()  # no classes of its own: the preset's 11 against the 8
    code = cli_main(["eval", "-c", str(ckpt), "--data", str(bare), "--preset", "camvid"])
    assert code == 1
    assert "8 classes" in capsys.readouterr().err


def test_predict_batch_refuses_one_image_where_a_list_goes(seg, rgb, tmp_path) -> None:
    path = tmp_path / "x.png"
    Image.fromarray(rgb).save(path)
    one_tensor = torch.from_numpy(rgb).permute(2, 0, 1)
    for image in (rgb, str(path), path, Image.fromarray(rgb), one_tensor):
        with pytest.raises(DataError, match="takes a list of images"):
            seg.predict_batch(image)
    batch = np.stack([rgb, rgb])  # [B,H,W,3]: a batch, each image one item
    assert [m.shape for m in seg.predict_batch(batch)] == [rgb.shape[:2]] * 2


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.bool, torch.int64])
def test_integer_image_tensors_other_than_uint8_are_refused(rgb, dtype) -> None:
    t = torch.from_numpy(rgb).permute(2, 0, 1).to(dtype)  # a cast to uint8 would wrap
    with pytest.raises(DataError, match=f"must be uint8.*got {str(dtype).removeprefix('torch.')}"):
        as_rgb_array(t)


def test_a_tensor_that_reads_both_as_chw_and_hwc_is_refused() -> None:
    strip = np.random.default_rng(0).integers(0, 256, (3, 40, 3), dtype=np.uint8)  # 3 rows
    with pytest.raises(DataError, match=r"shape \(3, 40, 3\) reads both as \[C,H,W\]"):
        as_rgb_array(torch.from_numpy(strip))  # a 40x3 CHW picture, or this 3x40 strip?
    assert as_rgb_array(strip).shape == (3, 40, 3)  # numpy is HWC: no doubt, as suggested
    assert as_rgb_array(torch.from_numpy(strip).permute(2, 0, 1)[:, :, :4]).shape == (3, 4, 3)


def test_nan_images_are_refused(rgb) -> None:
    a = rgb.astype(np.float32) / 255
    a[0, 0, 0] = np.nan
    with pytest.raises(DataError, match="NaN"):
        as_rgb_array(a)
    with pytest.raises(DataError, match="NaN"):
        as_rgb_array(torch.from_numpy(a).permute(2, 0, 1))


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8", True])
def test_build_model_checks_num_classes(bad) -> None:
    from dualseg.errors import ConfigError
    from dualseg.models import build_model

    with pytest.raises(ConfigError, match="num_classes must be an int >= 1"):
        build_model("dualseg_mobilenet_v2", num_classes=bad, renet_hidden=8)


def test_save_pretrained_refuses_the_hub_and_a_file_as_a_parent(seg, tmp_path, monkeypatch):
    from dualseg.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="not the Hub"):
        seg.save_pretrained("hf://org/name")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="afile is a file"):
        seg.save_pretrained(tmp_path / "afile" / "sub")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_model_of_other_classes_than_its_meta_is_refused(rgb) -> None:
    """21 class scores under 8 names: labels 8..20 had no name, and the first error came from
    colouring them much later."""
    from dualseg.errors import ConfigError

    model = dualseg.build_model("deeplabv3_mobilenet_v2", num_classes=21, output_stride=16)
    with pytest.raises(ConfigError, match=r"predicts 21 classes and the meta names 8"):
        Segmenter(model, META)
    # a model that does not say how many classes: refused at its first output
    conv = torch.nn.Conv2d(3, 21, 1)
    with pytest.raises(ConfigError, match=r"returned 21 class scores and the meta names 8"):
        Segmenter(conv, META).predict(rgb)
