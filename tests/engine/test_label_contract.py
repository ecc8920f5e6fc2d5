"""The label contract travels with the model: stored by train, save_pretrained and export, used
by eval / predict unless a flag says otherwise; training images evaluated are said; pixels of
16-bit images are read at inference as training read them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tests.checkpoint_helpers import write_synthetic_checkpoint

from dualseg.cli import main as cli_main
from dualseg.data import DatasetMeta
from dualseg.data.contract import LabelContract, content_digests, count_seen, digests_to_hex
from dualseg.engine.checkpoint import contract_of, load_checkpoint, save_checkpoint
from dualseg.engine.config import load_config
from dualseg.engine.predict import load_model
from dualseg.engine.pretrained import save_pretrained_from_checkpoint
from dualseg.engine.train import fit
from dualseg.errors import CheckpointError

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_synthetic.yaml"
BINARY = {
    "name": "cells",
    "class_names": ["membrane", "cell"],
    "palette": [[0, 0, 0], [255, 255, 255]],
}
MAPPED = {**BINARY, "ignore_index": None, "label_map": {"0": 0, "255": 1}}


def _binary_root(root: Path, *, wide: bool = False, n: int = 4) -> Path:
    """``n`` 64x64 grey images with 0/255 masks (ISBI's convention), listed in train.txt /
    val.txt (the last image is val); ``wide``: 12-bit images stored in 16-bit PNGs."""
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    lines: dict[str, list[str]] = {"train": [], "val": []}
    for i in range(n):
        mask = np.zeros((64, 64), np.uint8)
        mask[:, 16 + 4 * i : 48] = 255
        grey = np.where(mask > 0, 180, 60) + rng.integers(0, 20, mask.shape)
        if wide:  # 12-bit values in a 16-bit PNG
            Image.fromarray((grey * 16).astype(np.uint16)).save(root / "images" / f"{i}.png")
        else:
            Image.fromarray(grey.astype(np.uint8)).save(root / "images" / f"{i}.png")
        Image.fromarray(mask).save(root / "labels" / f"{i}.png")
        lines["val" if i == n - 1 else "train"].append(f"images/{i}.png labels/{i}.png")
    for split, rows in lines.items():
        (root / f"{split}.txt").write_text("\n".join(rows) + "\n")
    return root


def _train(root: Path, out: Path, **data) -> Path:
    cfg = load_config(
        TINY,
        data={"root": str(root), "preset": None, "crop_size": [32, 32], **data},
        train={"out_dir": str(out), "max_iters": 1, "val_every": 0},
    )
    fit(cfg)
    return out / "last.pt"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A model trained on 0/255 masks with meta.json's label_map {0: 0, 255: 1}."""
    base = tmp_path_factory.mktemp("contract")
    root = _binary_root(base / "isbi")
    (root / "meta.json").write_text(json.dumps(MAPPED))
    return root, _train(root, base / "run")


# --------------------------------------------------------------------------- the object
def test_the_contract_round_trips_and_says_its_differences_side_by_side() -> None:
    mapped = LabelContract(DatasetMeta.from_dict(MAPPED), bit_depth=12)
    assert LabelContract.from_dict(json.loads(json.dumps(mapped.to_dict()))) == mapped
    plain = LabelContract(DatasetMeta.from_dict(BINARY))
    diff = mapped.differences(plain)
    assert [d.split(":")[0] for d in diff] == ["label values", "bit depth"]
    assert "model [classes 0..1, ignore none, label_map 0:0,255:1]" in diff[0]
    assert "data [classes 0..1, ignore 255]" in diff[0]
    assert mapped.differences(mapped) == []


def test_a_checkpoint_without_a_valid_contract_is_refused(tmp_path: Path) -> None:
    bare = write_synthetic_checkpoint(tmp_path / "m.pt", label_contract=None)
    with pytest.raises(CheckpointError, match=r"m\.pt stores no label contract; train the model"):
        load_model(bare)
    bad = write_synthetic_checkpoint(tmp_path / "bad.pt", label_contract={**MAPPED, "bit_depth": 3})
    with pytest.raises(CheckpointError, match=r"label contract is invalid \(bit_depth 3"):
        load_model(bad)


# --------------------------------------------------------------------------- stored everywhere
def test_train_stores_the_resolved_contract_and_the_training_images(trained, tmp_path) -> None:
    root, last = trained
    ckpt = load_checkpoint(last)
    contract = contract_of(ckpt)
    assert dict(contract.meta.label_map) == {0: 0, 255: 1}
    assert contract.meta.ignore_value is None and contract.label_format == "index"
    train_images = [root / "images" / f"{i}.png" for i in range(3)]
    assert sorted(ckpt["train_images"].tolist()) == sorted(content_digests(train_images).tolist())
    assert ckpt["train_images"].dtype == torch.int64  # 8 bytes an image
    # the pretrained folder keeps it, and the model loaded from it reads so
    folder = save_pretrained_from_checkpoint(last, tmp_path / "folder")
    stored = json.loads((folder / "config.json").read_text())["label_contract"]
    assert stored["label_map"] == {"0": 0, "255": 1}
    assert load_model(folder).contract == contract
    again = load_model(folder).save_pretrained(tmp_path / "again")
    assert json.loads((again / "config.json").read_text())["label_contract"] == stored


def test_export_stores_the_contract(trained, tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    from dualseg.export.export import export_checkpoint
    from dualseg.export.runners import read_export_info

    _, last = trained
    for fmt, name in (("onnx", "m.onnx"), ("torchscript", "m.ts")):
        export_checkpoint(last, tmp_path / name, format=fmt)
        info = read_export_info(tmp_path / name)
        assert info["label_contract"]["label_map"] == {"0": 0, "255": 1}


def test_train_records_data_bit_depth(tmp_path: Path) -> None:
    root = _binary_root(tmp_path / "wide", wide=True)
    (root / "meta.json").write_text(json.dumps(MAPPED))
    ckpt = load_checkpoint(_train(root, tmp_path / "run", bit_depth=16))
    assert contract_of(ckpt).bit_depth == 16
    assert ckpt["config"]["data"]["bit_depth"] == 16


# --------------------------------------------------------------------------- eval uses it
def _eval(ckpt: Path, root: Path, out: Path, *flags: str) -> int:
    argv = ["eval", "-c", str(ckpt), "--data", str(root), "--out", str(out), "--quiet"]
    return cli_main([*argv, *flags])


def test_eval_refuses_a_dataset_that_reads_labels_otherwise(trained, tmp_path, capsys) -> None:
    """The issue's case: a meta.json without the label_map training used scored 78% of the
    pixels as ignore, silently (mIoU 13.9 for 44.7)."""
    root, last = trained
    other = tmp_path / "other"
    shutil.copytree(root, other)
    (other / "meta.json").write_text(json.dumps(BINARY))
    capsys.readouterr()
    assert _eval(last, other, tmp_path / "e") == 1
    err = capsys.readouterr().err
    assert "label values: model [classes 0..1, ignore none, label_map 0:0,255:1]" in err
    assert "data [classes 0..1, ignore 255]" in err and "meta.json" in err
    assert not (tmp_path / "e" / "metrics.json").exists()
    # a flag says how to read it: accepted
    assert _eval(last, other, tmp_path / "e", "--label-map", "255:1") == 0


def test_eval_reads_an_undescribed_dataset_with_the_models_contract(trained, tmp_path) -> None:
    root, last = trained
    bare = tmp_path / "bare"
    shutil.copytree(root, bare)
    (bare / "meta.json").unlink()
    assert _eval(last, bare, tmp_path / "e") == 0
    rows = np.array(json.loads((tmp_path / "e" / "metrics.json").read_text())["confusion_matrix"])
    mask = np.array(Image.open(root / "labels" / "3.png"))
    assert rows.sum(1).tolist() == [(mask == 0).sum(), (mask == 255).sum()]  # none ignored


def test_eval_warns_when_it_scores_training_images(trained, tmp_path, capsys) -> None:
    root, last = trained
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    (copy / "val.txt").write_text("images/0.png labels/0.png\nimages/3.png labels/3.png\n")
    capsys.readouterr()
    assert _eval(last, copy, tmp_path / "e") == 0
    assert "1 of the 2 images evaluated here were training images" in capsys.readouterr().err
    assert _eval(last, root, tmp_path / "f") == 0
    assert "training images" not in capsys.readouterr().err


def test_eval_of_a_pretrained_folder_warns_on_its_training_images(trained, tmp_path, capsys):
    root, last = trained
    folder = save_pretrained_from_checkpoint(last, tmp_path / "folder")
    stored = json.loads((folder / "config.json").read_text())["train_images"]
    assert sorted(stored) == sorted(digests_to_hex(load_checkpoint(last)["train_images"]))
    again = load_model(folder).save_pretrained(tmp_path / "again")  # kept through Python
    assert json.loads((again / "config.json").read_text())["train_images"] == stored
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    (copy / "val.txt").write_text("images/0.png labels/0.png\nimages/3.png labels/3.png\n")
    capsys.readouterr()
    assert _eval(folder, copy, tmp_path / "e") == 0
    assert "1 of the 2 images evaluated here were training images" in capsys.readouterr().err
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "train_images": ["xyz"]}))
    assert _eval(folder, copy, tmp_path / "f") == 1
    err = capsys.readouterr().err
    assert "config.json: train_images: expected a list of 16-digit hex" in err


def test_eval_max_megapixels_reads_images_above_the_limit(trained, tmp_path, monkeypatch, capsys):
    from PIL import Image as PILImage

    root, last = trained
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 1000)  # 64x64 is "too large" now
    capsys.readouterr()
    assert _eval(last, root, tmp_path / "e") == 1
    assert "--max-megapixels" in capsys.readouterr().err
    slide = ["--mode", "slide", "--window", "32", "32"]
    assert _eval(last, root, tmp_path / "e", *slide, "--max-megapixels", "0.01") == 0
    assert json.loads((tmp_path / "e" / "metrics.json").read_text())["num_images"] == 1


def test_count_seen_is_by_content(tmp_path: Path) -> None:
    a, b, c = (tmp_path / n for n in "abc")
    a.write_bytes(b"one")
    b.write_bytes(b"one")  # a copy under another name
    c.write_bytes(b"two")
    assert count_seen([b, c], content_digests([a])) == 1


# --------------------------------------------------------------------------- pixels
def _wide_model(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint whose contract says 16-bit, and a 12-bit image stored in a 16-bit PNG."""
    from tests.checkpoint_helpers import SYNTHETIC_KWARGS

    from dualseg.models import build_model

    torch.manual_seed(0)
    model = build_model("dualseg_mobilenet_v2", **SYNTHETIC_KWARGS)
    with torch.no_grad():  # weights jittered enough that the labels follow the brightness
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    ckpt = write_synthetic_checkpoint(tmp_path / "m.pt", model=model.state_dict())
    state = load_checkpoint(ckpt)
    contract = LabelContract(contract_of(state).meta, bit_depth=16)
    save_checkpoint(ckpt, {**state, "label_contract": contract.to_dict()})
    image = tmp_path / "wide.png"
    grey = np.linspace(0, 4095, 64 * 64).reshape(64, 64).astype(np.uint16)
    Image.fromarray(grey).save(image)
    return ckpt, image


def test_predict_reads_16_bit_images_as_the_model_was_trained(tmp_path: Path) -> None:
    from dualseg.imaging import read_image

    ckpt, image = _wide_model(tmp_path)
    seg = load_model(ckpt)
    as_trained = seg.predict(read_image(image, bit_depth=16))
    assert (seg.predict(image) == as_trained).all()
    out = tmp_path / "out"
    assert cli_main(["predict", str(image), "-c", str(ckpt), "-o", str(out), "--quiet"]) == 0
    assert (np.array(Image.open(out / "labels" / "wide.png")) == as_trained).all()
    detected = seg.predict(read_image(image))  # 12-bit, detected: other pixels
    assert (detected != as_trained).any()
    argv = ["predict", str(image), "-c", str(ckpt), "-o", str(out), "--quiet", "--overwrite"]
    assert cli_main([*argv, "--bit-depth", "12"]) == 0
    assert (np.array(Image.open(out / "labels" / "wide.png")) == detected).all()


def test_predict_max_megapixels_reads_images_above_the_limit(tmp_path, monkeypatch) -> None:
    from PIL import Image as PILImage

    ckpt = write_synthetic_checkpoint(tmp_path / "m.pt")
    image = tmp_path / "big.png"
    Image.fromarray(np.full((64, 96, 3), 90, np.uint8)).save(image)
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 1000)  # 64x96 is "too large" now
    argv = ["predict", str(image), "-c", str(ckpt), "-o", str(tmp_path / "o"), "--quiet"]
    assert cli_main(argv) == 1
    slide = ["--mode", "slide", "--window", "32", "32"]
    assert cli_main([*argv, *slide, "--max-megapixels", "0.01"]) == 0
    assert (tmp_path / "o" / "labels" / "big.png").exists()


def test_serve_reads_16_bit_uploads_as_the_model_was_trained(tmp_path, monkeypatch) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from dualseg.commands import serve as serve_command
    from dualseg.imaging import read_image

    ckpt, image = _wide_model(tmp_path)
    calls: dict = {}
    monkeypatch.setattr(serve_command, "run_server", lambda _, app, **kw: calls.update(app=app))
    monkeypatch.setattr(serve_command, "check_port", lambda host, port: None)
    assert cli_main(["serve", "--checkpoint", str(ckpt), "--device", "cpu"]) == 0
    png = image.read_bytes()
    body = TestClient(calls["app"]).post("/api/segment", files={"file": ("w.png", png)}).json()
    as_trained = load_model(ckpt).predict(read_image(image, bit_depth=16))
    assert body["class_pixels"] == np.bincount(as_trained.ravel(), minlength=8).tolist()


def test_predict_onnx_reads_16_bit_images_as_the_export_says(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    from dualseg.export.export import export_checkpoint

    ckpt, image = _wide_model(tmp_path)
    onnx = tmp_path / "m.onnx"
    export_checkpoint(ckpt, onnx)
    labels = {}
    for flags in ((), ("--bit-depth", "16"), ("--bit-depth", "12")):
        out = tmp_path / f"o{len(labels)}"
        assert (
            cli_main(["predict", str(image), "--onnx", str(onnx), "-o", str(out), "-q", *flags])
            == 0
        )
        labels[flags[1] if flags else "default"] = np.array(Image.open(out / "labels" / "wide.png"))
    assert (labels["default"] == labels["16"]).all() and (labels["default"] != labels["12"]).any()


def test_an_exported_segmenter_reads_image_files_at_its_bit_depth(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    from dualseg.export.export import export_checkpoint
    from dualseg.export.runtime import OnnxSegmenter
    from dualseg.imaging import read_image

    ckpt, image = _wide_model(tmp_path)
    export_checkpoint(ckpt, tmp_path / "m.onnx")
    seg = OnnxSegmenter(tmp_path / "m.onnx")
    assert seg.bit_depth == 16
    as_trained = seg.predict(read_image(image, bit_depth=16))
    assert (seg.predict(image) == as_trained).all()
    assert (seg.predict_batch([str(image)])[0] == as_trained).all()
    assert (seg.predict(read_image(image)) != as_trained).any()  # detected 12-bit: other pixels


def _low_16_bit_root(root: Path) -> Path:
    """A binary dataset whose images are 16-bit PNGs holding 8-bit values (0..255)."""
    _binary_root(root)
    for path in (root / "images").glob("*.png"):
        Image.fromarray(np.array(Image.open(path)).astype(np.uint16)).save(path)
    (root / "meta.json").write_text(json.dumps(MAPPED))
    return root


def test_data_bit_depth_8_reads_16_bit_files_of_8_bit_values(tmp_path: Path, capsys) -> None:
    root = _low_16_bit_root(tmp_path / "low")
    assert cli_main(["data", "check", str(root), "--quiet"]) == 1
    assert "pass --bit-depth 8" in capsys.readouterr().out
    assert cli_main(["data", "check", str(root), "--quiet", "--bit-depth", "8"]) == 0
    ckpt = load_checkpoint(_train(root, tmp_path / "run", bit_depth=8))  # the preflight passes
    assert contract_of(ckpt).bit_depth == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["predict", "x.png", "-c", "m.pt", "-o", "o", "--bit-depth", "20"], "8..16"),
        (["predict", "x.png", "-c", "m.pt", "-o", "o", "--max-megapixels", "0"], "positive"),
        (["eval", "-c", "m.pt", "--data", "d", "--bit-depth", "7"], "8..16"),
        (["eval", "-c", "m.pt", "--data", "d", "--max-megapixels", "-1"], "positive"),
        (["data", "check", "d", "--bit-depth", "17"], "8..16"),
        (["train", "--data.root", "d", "--data.bit_depth", "20"], "data.bit_depth must be 8..16"),
    ],
)
def test_bad_pixel_flags_are_one_line(argv, message, capsys) -> None:
    try:
        status = cli_main(argv)
    except SystemExit as stop:  # argparse's errors leave through SystemExit
        status = stop.code
    assert status == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_eval_split_val_is_the_share_training_held_out(tmp_path: Path, capsys) -> None:
    """``train --data.val_fraction 0.2`` then ``eval --split val`` on the same plain folder
    scored every image (training ones included) as "val"."""
    root = _binary_root(tmp_path / "plain", n=10)
    for f in ("train.txt", "val.txt"):
        (root / f).unlink()  # a plain image/label folder: no splits of its own
    (root / "meta.json").write_text(json.dumps(MAPPED))
    last = _train(root, tmp_path / "run", val_fraction=0.2)
    capsys.readouterr()
    assert _eval(last, root, tmp_path / "e", "--split", "val") == 0
    err = capsys.readouterr().err
    assert "held out of training (data.val_fraction)" in err and "training images" not in err
    assert json.loads((tmp_path / "e" / "metrics.json").read_text())["num_images"] == 2
