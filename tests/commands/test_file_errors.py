"""A wrong file given to a command: exit status 1 and one line that names the file and the fix.

A text file as a checkpoint, a refiner as ``--checkpoint``, a model checkpoint as ``--refiner``,
and a pickle that ``weights_only=True`` refuses (whose message must not suggest disabling it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from checkpoint_helpers import contract
from dualseg.cli import main as cli_main
from dualseg.engine.checkpoint import FORMAT, save_checkpoint
from dualseg.models import build_model
from dualseg.refine import BoundaryRefiner, EmbeddingNet, RefinerConfig
from reliability_helpers import refused

KWARGS = {"num_classes": 3, "output_stride": 16, "renet_hidden": 8}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("files")
    model = build_model("dualseg_mobilenet_v2", **KWARGS)
    ckpt = save_checkpoint(
        root / "model.pt",
        {
            "arch": "dualseg_mobilenet_v2",
            "model_kwargs": KWARGS,
            "model": model.state_dict(),
            "label_contract": contract(["class_0", "class_1", "class_2"]),
        },
    )
    net = EmbeddingNet(nn.Conv2d(3, 4, 1), nn.Identity(), 4)
    refiner = BoundaryRefiner(
        net, torch.eye(3, 4), torch.ones(3, dtype=torch.bool), class_names="abc",
        config=RefinerConfig(embed_dim=4),
    )  # fmt: skip
    text = root / "notes.txt"
    text.write_text("this is a text file, not a checkpoint\n" * 20)
    unsafe = root / "unsafe.pt"
    torch.save({"format": FORMAT, "args": argparse.Namespace(lr=0.1)}, unsafe)
    image = root / "image.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(image)
    return {
        "ckpt": ckpt,
        "refiner": refiner.save(root / "refiner.pt"),
        "text": text,
        "unsafe": unsafe,
        "image": image,
        "out": root / "out",
    }


def _predict(files, checkpoint: Path) -> list[str]:
    return ["predict", str(files["image"]), "--checkpoint", str(checkpoint),
            "--out", str(files["out"]), "--device", "cpu"]  # fmt: skip


def test_text_file_as_checkpoint(files, capsys) -> None:
    line = refused(_predict(files, files["text"]), capsys)
    assert str(files["text"]) in line and "not a PyTorch checkpoint file" in line


def test_refiner_as_checkpoint_says_pass_it_as_refiner(files, capsys) -> None:
    line = refused(_predict(files, files["refiner"]), capsys)
    assert str(files["refiner"]) in line and "method-B refiner" in line
    assert "pass it as --refiner" in line


def test_checkpoint_as_refiner_says_pass_it_as_checkpoint(files, capsys) -> None:
    argv = ["refine", "apply", "--refiner", str(files["ckpt"]), "--base", str(files["ckpt"]),
            str(files["image"]), "--out", str(files["out"]), "--device", "cpu"]  # fmt: skip
    line = refused(argv, capsys)
    assert str(files["ckpt"]) in line and "model checkpoint" in line
    assert "pass it as --checkpoint" in line


def test_unsafe_checkpoint_is_refused_without_suggesting_weights_only_false(files, capsys):
    line = refused(_predict(files, files["unsafe"]), capsys)
    assert str(files["unsafe"]) in line and "not a dualseg checkpoint" in line
    assert "argparse.Namespace" in line and "model.state_dict()" in line
    assert "weights_only=False" not in line and "likely succeed" not in line


def test_torchscript_export_as_checkpoint_says_what_it_is(files, tmp_path, capsys) -> None:
    import warnings

    from dualseg.export.export import export_model

    model = build_model("dualseg_mobilenet_v2", **KWARGS)
    exported = export_model(
        model, tmp_path / "m.pt", class_names=list("abc"), format="torchscript",
        example_size=(32, 32),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torch UserWarning about TorchScript archives
        line = refused(_predict(files, exported), capsys)
    assert str(exported) in line and "is a TorchScript export" in line
    assert "ExportedSegmenter" in line and "predict --onnx" in line
    assert "weights_only" not in line and "corrupt" not in line
    assert not files["out"].exists()


def test_plain_torchscript_module_as_checkpoint(files, tmp_path, capsys) -> None:
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(nn.Conv2d(3, 3, 1)), str(path))
    line = refused(_predict(files, path), capsys)
    assert "is a TorchScript module (torch.jit.save), not a checkpoint" in line
    assert "weights_only" not in line


def test_onnx_export_as_checkpoint_points_to_onnx(files, tmp_path, capsys) -> None:
    exported = tmp_path / "model.onnx"  # named as an export: never handed to torch.load
    exported.write_bytes(b"\x08\x07\x12\x07pytorch")
    line = refused(_predict(files, exported), capsys)
    assert str(exported) in line and "is an ONNX export" in line and "--onnx" in line
    assert "corrupt" not in line
    assert not files["out"].exists()


def test_export_takes_a_pretrained_folder(files, tmp_path) -> None:
    pytest.importorskip("onnxruntime")
    folder = tmp_path / "pretrained"
    assert cli_main(["export", "-c", str(files["ckpt"]), "--format", "pretrained",
                     "-o", str(folder)]) == 0  # fmt: skip
    out = tmp_path / "m.onnx"
    argv = ["export", "-c", str(folder), "--format", "onnx", "-o", str(out), "--size", "32", "32"]
    assert cli_main(argv) == 0
    from dualseg.export.runtime import read_export_info

    info = read_export_info(out)
    assert info["kind"] == "segmenter" and len(info["class_names"]) == KWARGS["num_classes"]
