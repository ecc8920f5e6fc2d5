"""OnnxSegmenter: the engine Segmenter's interface through onnxruntime, without torch."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

from dualseg.errors import CheckpointError
from dualseg.export.runtime import OnnxSegmenter


def _images():
    rng = np.random.default_rng(0)
    return [
        rng.integers(0, 256, (50, 70, 3), dtype=np.uint8),
        rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
        rng.integers(0, 256, (50, 70, 3), dtype=np.uint8),
    ]


def test_onnx_segmenter_matches_engine_segmenter(onnx_dynamic, torch_model):
    from dualseg.engine.predict import Segmenter

    model, meta = torch_model
    ref, seg = Segmenter(model, meta), OnnxSegmenter(onnx_dynamic)
    assert seg.meta.class_names == meta.class_names and seg.meta.palette == meta.palette
    assert seg.num_classes == 3 and seg.class_names == meta.class_names
    images = _images()
    got = seg.predict_batch(images, batch_size=2, return_probs=True)
    want = ref.predict_batch(images, batch_size=2, return_probs=True)
    for (g_lab, g_prob), (w_lab, w_prob) in zip(got, want):
        assert g_lab.dtype == np.uint8 and g_lab.shape == w_lab.shape
        np.testing.assert_allclose(g_prob, w_prob, atol=1e-4)
        assert (g_lab == w_lab).mean() > 0.999  # argmax may flip only at exact ties
    np.testing.assert_array_equal(seg.predict(images[1]), got[1][0])


def test_onnx_predict_does_not_import_torch(onnx_dynamic, tmp_path):
    image = tmp_path / "x.png"
    Image.fromarray(_images()[0]).save(image)
    code = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        from dualseg.export.runtime import OnnxSegmenter
        seg = OnnxSegmenter({str(onnx_dynamic)!r})
        labels = seg.predict({str(image)!r})
        probs = seg.predict_proba(np.zeros((40, 48, 3), np.uint8))
        assert labels.shape == (50, 70) and probs.shape == (3, 40, 48)
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_static_export_resizes_in_and_out(onnx_static, torch_model):
    from dualseg.engine.predict import Segmenter

    model, meta = torch_model
    seg = OnnxSegmenter(onnx_static)
    image = np.random.default_rng(1).integers(0, 256, (48, 80, 3), dtype=np.uint8)
    # at the exported size nothing is resized, so it must match PyTorch
    np.testing.assert_allclose(
        seg.predict_proba(image), Segmenter(model, meta).predict_proba(image), atol=1e-4
    )
    probs = seg.predict_proba(_images()[0])  # another size: resized in, scores resized back
    assert probs.shape == (3, 50, 70)
    np.testing.assert_allclose(probs.sum(0), 1.0, atol=1e-5)


def test_wrong_files_are_clear_errors(tmp_path, onnx_dynamic):
    with pytest.raises(CheckpointError, match="not found"):
        OnnxSegmenter(tmp_path / "missing.onnx")
    with pytest.raises(CheckpointError, match="not a readable ONNX model"):
        (tmp_path / "bad.onnx").write_bytes(b"\x00garbage")
        OnnxSegmenter(tmp_path / "bad.onnx")


def test_dualseg_predict_onnx(onnx_dynamic, tmp_path):
    """'dualseg predict --onnx F' runs the exported model through onnxruntime."""
    from dualseg.cli import main

    src = tmp_path / "in"
    src.mkdir()
    for i, a in enumerate(_images()):
        Image.fromarray(a).save(src / f"im{i}.png")
    out = tmp_path / "out"
    args = ["predict", str(src), "--onnx", str(onnx_dynamic), "--out", str(out), "--probs"]
    assert main(args) == 0
    label = np.asarray(Image.open(out / "labels" / "im0.png"))
    np.testing.assert_array_equal(label, OnnxSegmenter(onnx_dynamic).predict(_images()[0]))
    assert (out / "color" / "im1.png").is_file() and (out / "probs" / "im2.npz").is_file()


def test_dualseg_predict_runs_a_torchscript_export_too(checkpoint, onnx_dynamic, tmp_path):
    """--onnx refused a TorchScript export with a message naming a Python class."""
    from dualseg.cli import main

    ts = tmp_path / "tiny.pt"
    assert main(["export", "-c", str(checkpoint), "--format", "torchscript", "--out", str(ts),
                 "--dynamic", "--no-verify"]) == 0  # fmt: skip
    image = tmp_path / "im.png"
    Image.fromarray(_images()[0]).save(image)
    assert main(["predict", str(image), "--onnx", str(ts), "--out", str(tmp_path / "o"), "-q"]) == 0
    label = np.asarray(Image.open(tmp_path / "o" / "labels" / "im.png"))
    assert (label == OnnxSegmenter(onnx_dynamic).predict(_images()[0])).mean() > 0.999


def _with_metadata(source, target, **changes):
    """A copy of an exported ONNX file with some ``dualseg.*`` metadata replaced (a raw JSON
    text) or removed (None)."""
    import onnx

    model = onnx.load(str(source))
    props = {p.key: p.value for p in model.metadata_props}
    for key, text in changes.items():
        if text is None:
            props.pop(f"dualseg.{key}")
        else:
            props[f"dualseg.{key}"] = text
    del model.metadata_props[:]
    for key, value in props.items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(target))
    return target


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"class_names": None}, "class_names must be a non-empty list of class names"),
        ({"class_names": '"skyroad"'}, "class_names must be a non-empty list"),
        ({"mean": None}, "mean must be three numbers"),
        ({"mean": "[0.5]"}, "mean must be three numbers"),
        ({"std": "[0.2, 0.0, 0.2]"}, "std must be three positive numbers"),
        ({"output": '"foo"'}, "output must be 'logits' or 'probs'"),
        ({"palette": "[[1, 2]]"}, "palette must be a list of [r, g, b] colours"),
        ({"ignore_index": '"abc"'}, "ignore_index must be an integer"),
        ({"mean": "[0.5, "}, "dualseg.mean is not valid JSON"),
    ],
)
def test_damaged_metadata_is_one_error_naming_the_entry(onnx_dynamic, tmp_path, changes, said):
    bad = _with_metadata(onnx_dynamic, tmp_path / "bad.onnx", **changes)
    with pytest.raises(CheckpointError, match=re.escape(said)) as err:
        OnnxSegmenter(bad)
    assert str(bad) in str(err.value) and "re-export" in str(err.value)


def test_class_names_that_do_not_match_the_outputs_are_refused_before_any_output(
    onnx_dynamic, tmp_path, capsys
):
    from dualseg.cli import main

    bad = _with_metadata(onnx_dynamic, tmp_path / "two.onnx", class_names='["a", "b"]')
    with pytest.raises(CheckpointError, match=r"outputs scores of shape \(1, \d+, 50, 70\) but"):
        OnnxSegmenter(bad).predict(_images()[0])
    image = tmp_path / "in.png"
    Image.fromarray(_images()[0]).save(image)
    out = tmp_path / "out"
    assert main(["predict", "--onnx", str(bad), str(image), "-o", str(out), "-q"]) == 1
    assert "names 2 classes; re-export" in capsys.readouterr().err
    assert not any(p.is_file() for p in out.rglob("*"))  # no label PNG without its colour one


def test_a_model_with_low_resolution_dict_output_predicts_at_the_image_size(tmp_path):
    """A torchvision-style model (``{"out": logits}``) whose logits come at a quarter of the
    input: the exports returned labels at the logits' size (12x16 for a 48x64 image)."""
    import torch

    from dualseg.data.presets import DatasetMeta
    from dualseg.engine.predict import Segmenter
    from dualseg.export.export import export_model
    from dualseg.export.runtime import ExportedSegmenter

    class LowRes(torch.nn.Module):
        num_classes = 3

        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 3, 4, stride=4)

        def forward(self, x):
            return {"out": self.conv(x), "aux": self.conv(x)}

    torch.manual_seed(0)
    model = LowRes().eval()
    names = ("a", "b", "c")
    meta = DatasetMeta(name="t", class_names=names, palette=((0, 0, 0), (9, 9, 9), (99, 9, 9)))
    images = _images()
    want = Segmenter(model, meta).predict_batch(images, return_probs=True)
    for name in ("low.onnx", "low.pt"):
        export_model(model, tmp_path / name, class_names=names, dynamic=True)
        got = ExportedSegmenter(tmp_path / name).predict_batch(images, return_probs=True)
        for (g_lab, g_prob), (w_lab, w_prob), image in zip(got, want, images):
            assert g_lab.shape == image.shape[:2] == w_lab.shape
            np.testing.assert_allclose(g_prob, w_prob, atol=1e-4)
