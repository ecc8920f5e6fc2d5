"""ONNX export of method A's network: parity with PyTorch, metadata, static/probs exports."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from export_case import ARCH, CLASS_NAMES, PALETTE

from dualseg.errors import CheckpointError, ConfigError
from dualseg.export.export import export_model
from dualseg.export.runtime import read_export_info


def _run(path, x: torch.Tensor) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"image": x.numpy()})[0]


@pytest.mark.parametrize(
    "shape", [(1, 3, 64, 64), (2, 3, 64, 96), (1, 3, 50, 70), (1, 3, 8, 72), (1, 3, 40, 5)]
)
def test_dynamic_onnx_matches_pytorch(onnx_dynamic, torch_model, shape):
    # 50x70 is not a multiple of the output stride: the export's own padding must be traced;
    # 8x72 and 40x5 give feature maps of one row or column (the coordinate channels' centre)
    model, _ = torch_model
    x = torch.randn(*shape)
    with torch.no_grad():
        ref = model(x).numpy()
    got = _run(onnx_dynamic, x)
    assert got.shape == ref.shape == (shape[0], 3, *shape[2:])
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_onnx_carries_metadata_and_opset(onnx_dynamic):
    info = read_export_info(onnx_dynamic)
    assert info["class_names"] == CLASS_NAMES and info["palette"] == PALETTE
    assert info["arch"] == ARCH and info["model_kwargs"]["num_classes"] == 3
    assert info["mean"] == pytest.approx([0.485, 0.456, 0.406])
    assert info["std"] == pytest.approx([0.229, 0.224, 0.225])
    assert info["output"] == "logits" and info["dynamic"] is True
    proto = onnx.load(str(onnx_dynamic))
    props = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(props["dualseg.class_names"]) == CLASS_NAMES
    assert max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) >= 17
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ["batch", "", "height", "width"]
    assert "GRU" in {n.op_type for n in proto.graph.node}  # the ReNet sweeps stay recurrent


def test_static_probs_export(onnx_static, torch_model):
    model, _ = torch_model
    info = read_export_info(onnx_static)
    assert info["input_size"] == [48, 80] and info["output"] == "probs"
    x = torch.randn(1, 3, 48, 80)
    with torch.no_grad():
        ref = model(x).softmax(1).numpy()
    np.testing.assert_allclose(_run(onnx_static, x), ref, atol=1e-4, rtol=0)
    with pytest.raises(Exception, match=r"(?i)dimension|shape"):
        _run(onnx_static, torch.randn(1, 3, 64, 64))  # static: other sizes are refused


def test_export_options_are_checked(torch_model, tmp_path):
    model, meta = torch_model
    kw = dict(class_names=meta.class_names, palette=meta.palette)
    with pytest.raises(ConfigError, match="opset"):
        export_model(model, tmp_path / "a.onnx", opset=16, **kw)
    with pytest.raises(ConfigError, match="dynamic"):
        export_model(model, tmp_path / "a.onnx", exporter="dynamo", dynamic=True, **kw)
    with pytest.raises(ConfigError, match="output"):
        export_model(model, tmp_path / "a.onnx", output="labels", **kw)
    with pytest.raises(ConfigError, match="format"):
        export_model(model, tmp_path / "a.onnx", format="tflite", **kw)
    assert not (tmp_path / "a.onnx").exists()


def test_foreign_onnx_is_rejected(tmp_path):
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    path = tmp_path / "foreign.onnx"
    onnx.save(onnx.helper.make_model(graph), str(path))
    with pytest.raises(CheckpointError, match="no dualseg export metadata"):
        read_export_info(path)
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(CheckpointError, match="not a readable ONNX model"):
        read_export_info(tmp_path / "junk.onnx")


def test_an_export_without_a_palette_predicts_in_default_colours(torch_model, tmp_path):
    """export_model(palette=None): the export stores distinct default colours, and a file that
    holds none (written so before) is read with them, not an empty palette that breaks
    predict and serve."""
    from dualseg.export.runtime import ExportedSegmenter
    from dualseg.viz import colorize, default_palette

    model, meta = torch_model
    path = export_model(model, tmp_path / "nopal.onnx", class_names=meta.class_names)
    n = len(meta.class_names)
    assert read_export_info(path)["palette"] == [list(c) for c in default_palette(n)]
    seg = ExportedSegmenter(path)
    assert len(seg.meta.palette) == n
    labels = seg.predict(np.zeros((40, 56, 3), np.uint8))
    assert colorize(labels, seg.meta.palette).shape == (40, 56, 3)

    import onnx

    old = onnx.load(str(path))  # as such a file was written before: an empty palette
    for entry in old.metadata_props:
        if entry.key == "dualseg.palette":
            entry.value = "[]"
    onnx.save(old, str(tmp_path / "old.onnx"))
    assert read_export_info(tmp_path / "old.onnx")["palette"] == []
    assert ExportedSegmenter(tmp_path / "old.onnx").meta.palette == tuple(default_palette(n))


def test_predict_with_a_static_export_says_it_resizes(onnx_static, onnx_dynamic, tmp_path, capsys):
    from PIL import Image

    from dualseg.cli import main

    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((30, 50, 3), np.uint8)).save(image)
    for model, noted in ((onnx_static, True), (onnx_dynamic, False)):
        out = tmp_path / f"out_{noted}"
        assert main(["predict", str(image), "--onnx", str(model), "-o", str(out), "-q"]) == 0
        err = capsys.readouterr().err
        assert ("is a static export at 48x80: every image is resized" in err) is noted, err
