"""Mistakes a user makes with ``predict`` and ``refine fit`` / ``refine apply``: one line
naming the value and the fix, nothing written over that should not be, no traceback (the
other commands: test_user_mistakes.py)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from cli_argv import first_image, fit_argv, md5

from dualseg.cli import main as cli_main
from dualseg.data import make_synthetic_dataset
from reliability_helpers import refused


def test_predict_never_writes_over_the_labels_of_a_dataset_at_out(files, capsys, tmp_path):
    data = make_synthetic_dataset(tmp_path / "d", n_train=1, n_val=1, size=(32, 48))
    label = sorted((data / "labels").iterdir())[0]
    before = md5(label)
    argv = ["predict", str(data / "images"), "-c", str(files["ckpt"]), "-o", str(data)]
    line = refused([*argv, "--overwrite", "--device", "cpu", "-q"], capsys)
    assert "a file of the dataset" in line and "not even with --overwrite" in line
    assert md5(label) == before
    # an images/ folder with labels/ that an earlier run wrote: that output may be replaced
    photos = tmp_path / "photos"
    (photos / "images").mkdir(parents=True)
    (photos / "images" / "x.png").write_bytes(sorted((data / "images").iterdir())[0].read_bytes())
    argv = ["predict", str(photos / "images"), "-c", str(files["ckpt"]), "-o", str(photos), "-q"]
    assert cli_main([*argv, "--device", "cpu"]) == 0
    assert cli_main([*argv, "--device", "cpu", "--overwrite"]) == 0
    # a plain images/ + labels/ pair, no meta.json or list file: its labels are ground truth
    plain = tmp_path / "plain"
    for sub in ("images", "labels"):
        (plain / sub).mkdir(parents=True)
        (plain / sub / "x.png").write_bytes(sorted((data / sub).iterdir())[0].read_bytes())
    before = md5(plain / "labels" / "x.png")
    argv = ["predict", str(plain / "images"), "-c", str(files["ckpt"]), "-o", str(plain)]
    line = refused([*argv, "--overwrite", "--device", "cpu", "-q"], capsys)
    assert "a file of the dataset" in line and md5(plain / "labels" / "x.png") == before


def test_refine_fit_never_writes_over_the_base_a_model_or_the_dataset(files, capsys) -> None:
    model = files["root"] / "other_model.pt"
    model.write_bytes(files["ckpt"].read_bytes())
    kept = {p: md5(p) for p in (files["ckpt"], model, files["data"] / "meta.json")}
    out = str(files["root"] / "r.pt")
    line = refused(fit_argv(files, "--out", str(files["ckpt"]), "--overwrite"), capsys)
    assert "--base model" in line
    line = refused(fit_argv(files, "--out", out, "--checkpoint", str(model), "--overwrite"), capsys)
    assert "model checkpoint: pass it as --base" in line
    meta = str(files["data"] / "meta.json")
    line = refused(fit_argv(files, "--out", meta, "--overwrite"), capsys)
    assert "a file of the dataset" in line
    assert {p: md5(p) for p in kept} == kept
    assert not Path(out).exists()
    text = files["root"] / "notes.txt"
    text.write_text("my notes")
    line = refused(fit_argv(files, "--out", str(text), "--overwrite"), capsys)
    assert "is not a method-B refiner" in line and text.read_text() == "my notes"


def test_a_refiner_training_state_is_named_as_such(files, capsys, tmp_path) -> None:
    state = tmp_path / "r.train.pt"
    torch.save({"format": "dualseg-refiner-train/1", "step": 1}, state)
    image = sorted((files["data"] / "images").iterdir())[0]
    line = refused(["predict", str(image), "-c", str(state), "-o", str(tmp_path / "o")], capsys)
    assert "training state of 'dualseg refine fit'" in line
    line = refused(
        ["refine", "apply", str(image), "-r", str(state), "-b", str(files["ckpt"]),
         "-o", str(tmp_path / "a")], capsys,
    )  # fmt: skip
    assert "training state of 'dualseg refine fit'" in line and "--resume" in line


def test_an_exported_segmentation_model_as_refiner_says_what_it_is(files, capsys, tmp_path):
    """It once said the refiner's .json sidecar was missing, as if this were a refiner."""
    exported = tmp_path / "model_ts.pt"
    argv = ["export", "-c", str(files["ckpt"]), "--format", "torchscript", "--out", str(exported)]
    assert cli_main([*argv, "--size", "32", "32"]) == 0
    capsys.readouterr()
    image = sorted((files["data"] / "images").iterdir())[0]
    line = refused(
        ["refine", "apply", str(image), "-r", str(exported), "-b", str(files["ckpt"]),
         "-o", str(tmp_path / "a")], capsys,
    )  # fmt: skip
    assert f"{exported} is an exported segmentation model" in line and "not a refiner" in line
    assert "sidecar" not in line and "dualseg refine fit" in line
    assert not (tmp_path / "a").exists()


def test_predict_onnx_with_a_checkpoint_does_not_call_it_torchscript(files, capsys, tmp_path):
    image = sorted((files["data"] / "images").iterdir())[0]
    line = refused(
        ["predict", str(image), "--onnx", str(files["ckpt"]), "-o", str(tmp_path / "o")], capsys
    )
    assert "TorchScript file" not in line and "-c" in line


def test_refine_fit_refuses_bad_optimizer_values_and_intervals(files, capsys) -> None:
    from dualseg.errors import ConfigError
    from dualseg.refine.refiner import RefinerConfig

    for bad in ({"weight_decay": -1.0}, {"momentum": -1.0}, {"seed": -1}, {"lr": math.inf}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            RefinerConfig(**bad)
    out = files["root"] / "rf" / "r.pt"
    for flag in (["--checkpoint-every", "0"], ["--proto-images", "-5"], ["--log-every", "-3"]):
        argv = ["refine", "fit", "--data", str(files["data"]), "--out", str(out), *flag]
        with pytest.raises(SystemExit) as exc:
            cli_main(argv)
        assert exc.value.code == 1 and flag[0] in capsys.readouterr().err
    assert not out.parent.exists()


def test_refine_fit_refuses_weights_it_would_not_read(files, capsys, tmp_path) -> None:
    """--init-backbone none with --weights FILE once fitted from random weights, FILE unread."""
    weights = tmp_path / "backbone.pth"
    weights.write_bytes(b"never read")
    out = tmp_path / "r.pt"
    line = refused(fit_argv(files, "--weights", str(weights), "--out", str(out)), capsys)
    assert f"--weights {weights} and --init-backbone none conflict" in line
    assert "drop --weights" in line
    assert not out.exists() and not out.with_suffix(".train.pt").exists()


def test_refine_fit_refuses_an_embedding_too_wide_to_build(files, capsys, tmp_path) -> None:
    """--embed-dim 100000 once ran out of memory building the ASPP head: a traceback."""
    from dualseg.errors import ConfigError
    from dualseg.refine.refiner import RefinerConfig

    with pytest.raises(ConfigError, match=r"embed_dim must be in 1\.\.4096, got 4097"):
        RefinerConfig(embed_dim=4097)
    assert RefinerConfig(embed_dim=4096).embed_dim == 4096
    out = tmp_path / "r.pt"
    line = refused(fit_argv(files, "--embed-dim", "100000", "--out", str(out)), capsys)
    assert "--embed-dim must be in 1..4096, got 100000" in line  # the flag, as given
    line = refused(fit_argv(files, "--margin", "-1", "--out", str(out)), capsys)
    assert "--margin must be >= 0, got -1.0" in line
    assert not out.exists() and not out.with_suffix(".train.pt").exists()


@pytest.mark.parametrize("minutes", ["nan", "-1"])
def test_refine_fit_refuses_a_time_budget_that_is_not_positive(files, capsys, minutes) -> None:
    """NaN passed "<= 0" and was never reached: a fit of all --steps, the budget ignored."""
    out = files["root"] / f"budget_{minutes}.pt"
    line = refused(fit_argv(files, "--time-budget", minutes, "--out", str(out)), capsys)
    assert f"the time budget must be > 0 minutes, got {minutes}" in line
    assert not out.exists() and not out.with_suffix(".train.pt").exists()


def test_predict_refuses_an_empty_input_or_out(files, capsys, tmp_path, monkeypatch) -> None:
    """An unset shell variable: "" as an input segmented the whole current folder, as --out it
    wrote labels/, color/ and overlay/ there."""
    monkeypatch.chdir(tmp_path)
    ckpt = str(files["ckpt"])
    line = refused(["predict", "", "-c", ckpt, "-o", str(tmp_path / "o")], capsys)
    assert "an input is an empty path; name an image file, a folder or a glob" in line
    line = refused(["predict", str(first_image(files)), "-c", ckpt, "-o", " "], capsys)
    assert "--out is empty; name a folder" in line
    assert list(tmp_path.iterdir()) == []


def test_predict_reads_the_folders_a_glob_matches_and_every_readable_suffix(files, tmp_path):
    """A quoted 'in/*' dropped in/sub/ (the shell's expansion keeps it), and a folder scan
    dropped .ppm / .gif files the readers open."""
    from PIL import Image

    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    shutil.copy(first_image(files), src / "a.png")
    Image.open(first_image(files)).save(src / "sub" / "b.ppm")
    out = tmp_path / "o"
    assert (
        cli_main(["predict", str(src / "*"), "-c", str(files["ckpt"]), "-o", str(out), "-q"]) == 0
    )
    labels = sorted(p.relative_to(out / "labels").as_posix() for p in (out / "labels").rglob("*"))
    assert labels == ["a.png", "sub", "sub/b.png"]


def test_predict_refuses_a_blocked_output_slot_before_writing_anything(files, capsys, tmp_path):
    ckpt, image = str(files["ckpt"]), str(first_image(files))
    out = tmp_path / "o"
    (out / "labels" / "train_00000.png").mkdir(parents=True)  # a folder where a file goes
    line = refused(["predict", image, "-c", ckpt, "-o", str(out), "--overwrite"], capsys)
    assert "labels/train_00000.png is a folder where an output file goes" in line
    assert sorted(p.name for p in out.iterdir()) == ["labels"]
    out = tmp_path / "o2"
    out.mkdir()
    (out / "color").write_text("x")  # a file where a folder goes
    line = refused(["predict", image, "-c", ckpt, "-o", str(out)], capsys)
    assert "o2/color is a file where an output folder goes" in line
    assert sorted(p.name for p in out.iterdir()) == ["color"]


def test_predict_data_that_does_not_exist_says_so(files, capsys, tmp_path) -> None:
    argv = ["predict", str(first_image(files)), "-c", str(files["ckpt"]), "-o", str(tmp_path / "o")]
    line = refused([*argv, "--data", str(tmp_path / "nowhere")], capsys)
    assert "nowhere: no such file or folder" in line


def test_refine_fit_refuses_a_crop_too_small_for_a_boundary(files, capsys) -> None:
    """A 1x1 crop ran every step, drew no triplet, then blamed the labels."""
    out = files["root"] / "tiny_crop.pt"
    line = refused(fit_argv(files, "--crop-size", "4", "4", "--out", str(out)), capsys)
    assert "--crop-size 4 4 is too small to hold a class boundary" in line
    assert not out.exists()


def test_refine_fit_refuses_a_batch_of_one_crop_before_any_step(files, capsys) -> None:
    """--batch-size 1 ended the first step in a BatchNorm traceback ("Expected more than 1
    value per channel when training")."""
    out = files["root"] / "batch_one.pt"
    line = refused(fit_argv(files, "--batch-size", "1", "--out", str(out)), capsys)
    assert "--batch-size must be >= 2" in line and "2 or more" in line
    assert not out.exists() and not out.with_suffix(".train.pt").exists()
