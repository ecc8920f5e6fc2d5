"""Outputs never replace inputs, and an existing output is replaced only with ``--overwrite``.

``predict -o``, ``eval --save-predictions``, ``refine apply -o`` and ``data check --json``
refuse, before any work, an output file that exists (one line naming it and ``--overwrite``)
and, even with ``--overwrite``, one that is an input image or a file of the dataset. Also:
``eval --save-predictions`` keeps images that share a file name apart (``x``, ``x_1``), and
``predict`` run twice into a folder inside its input folder does not segment its own outputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from checkpoint_helpers import write_synthetic_checkpoint
from dualseg.cli import main as cli_main
from dualseg.data import make_synthetic_dataset
from reliability_helpers import refused


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("safety")
    data = make_synthetic_dataset(base / "data", n_train=1, n_val=2, size=(64, 64))
    return {"data": data, "ckpt": write_synthetic_checkpoint(base / "model.pt")}


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _eval(setup, data: Path, preds: Path, *extra: str) -> list[str]:
    return ["eval", "-c", str(setup["ckpt"]), "--data", str(data),
            "--out", str(preds.parent / "ev"),
            "--save-predictions", str(preds), "--device", "cpu", "--quiet", *extra]  # fmt: skip


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_eval_never_writes_over_the_ground_truth(setup, tmp_path, capsys, overwrite) -> None:
    data = setup["data"]
    before = _snapshot(data)
    line = refused(_eval(setup, data, data, *overwrite), capsys)
    assert "a file of the dataset" in line and "--overwrite" in line
    assert str(data / "labels") in line  # names the label file it would have replaced
    assert _snapshot(data) == before


def test_eval_overwrite_removes_an_earlier_refined_evaluations_predictions(setup, tmp_path):
    preds = tmp_path / "preds"
    stale = [preds / kind / "val_00000.png" for kind in ("refined_labels", "refined_color")]
    for path in stale:  # as a first evaluation with --refiner left them
        path.parent.mkdir(parents=True)
        path.write_bytes(b"another model's refined output")
    keep = preds / "refined_labels" / "notes.png"  # not a name this split writes: kept
    keep.write_bytes(b"mine")
    failing = _eval(setup, setup["data"], preds, "--overwrite")
    failing[2] = str(tmp_path / "no_such_checkpoint.pt")
    assert cli_main(failing) != 0  # a run that fails removes nothing
    assert all(p.read_bytes() == b"another model's refined output" for p in stale)
    assert cli_main(_eval(setup, setup["data"], preds, "--overwrite")) == 0
    assert (preds / "labels" / "val_00000.png").is_file()
    assert not any(p.exists() for p in stale) and keep.read_bytes() == b"mine"


def test_eval_with_a_preset_that_contradicts_the_datasets_meta_json_is_refused(
    setup, tmp_path, capsys
):
    data = Path(shutil.copytree(setup["data"], tmp_path / "reversed"))
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "class_names": meta["class_names"][::-1]}))
    out = tmp_path / "ev"
    argv = ["eval", "-c", str(setup["ckpt"]), "--data", str(data), "--split", "val",
            "--preset", "synthetic", "--out", str(out), "--device", "cpu", "--quiet"]  # fmt: skip
    line = refused(argv, capsys)  # it scored every class under another name, exit 0
    assert "--preset synthetic has the classes" in line and "meta.json says" in line
    assert not (out / "metrics.json").exists()


def _repeat_dataset(setup, root: Path) -> Path:
    """A list dataset whose val images a/x.png and b/x.png share a name."""
    src = setup["data"]
    pairs = [line.split() for line in (src / "val.txt").read_text().splitlines()]
    lines = []
    for sub, (img, lab) in zip("ab", pairs):
        for kind, f in (("img", img), ("lab", lab)):
            (root / sub / kind).mkdir(parents=True, exist_ok=True)
            shutil.copy(src / f, root / sub / kind / "x.png")
        lines.append(f"{sub}/img/x.png {sub}/lab/x.png\n")
    (root / "val.txt").write_text("".join(lines))
    shutil.copy(src / "meta.json", root / "meta.json")
    return root


def test_eval_predictions_keep_repeated_names_and_need_overwrite(setup, tmp_path, capsys) -> None:
    data = _repeat_dataset(setup, tmp_path / "rep")
    preds = tmp_path / "preds"
    assert cli_main(_eval(setup, data, preds)) == 0
    capsys.readouterr()
    assert sorted(p.name for p in (preds / "labels").iterdir()) == ["x.png", "x_1.png"]
    assert (preds / "labels" / "x.png").read_bytes() != b""
    # a second run is refused before any work, naming the first existing file and the flag
    (preds / "labels" / "x.png").write_bytes(b"mine")
    before = _snapshot(preds)
    line = refused(_eval(setup, data, preds), capsys)
    assert str(preds / "labels" / "x.png") in line and "--overwrite" in line
    assert _snapshot(preds) == before
    assert cli_main(_eval(setup, data, preds, "--overwrite")) == 0
    assert (preds / "labels" / "x.png").read_bytes() != b"mine"


def _predict(setup, inputs: list[Path], out: Path, *extra: str) -> list[str]:
    return ["predict", *map(str, inputs), "-c", str(setup["ckpt"]), "-o", str(out),
            "--device", "cpu", "--quiet", *extra]  # fmt: skip


def test_predict_twice_into_its_input_folder(setup, tmp_path, capsys) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    shutil.copy(next((setup["data"] / "images").iterdir()), photos / "x.png")
    out = photos / "pred"
    assert cli_main(_predict(setup, [photos], out)) == 0
    first = _snapshot(out)
    assert sorted(first) == ["color/x.png", "labels/x.png", "overlay/x.png"]
    line = refused(_predict(setup, [photos], out), capsys)
    assert str(out / "labels" / "x.png") in line and "--overwrite" in line
    assert _snapshot(out) == first
    # with --overwrite: the same outputs again, its own earlier outputs are not inputs
    assert cli_main(_predict(setup, [photos], out, "--overwrite")) == 0
    assert "segmented 1 image(s)" in capsys.readouterr().out
    assert sorted(_snapshot(out)) == sorted(first)


def test_an_earlier_output_among_the_inputs_is_not_segmented_and_is_said(
    setup, tmp_path, capsys
) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    shutil.copy(next((setup["data"] / "images").iterdir()), photos / "x.png")
    assert cli_main(_predict(setup, [photos], photos / "r1")) == 0
    capsys.readouterr()
    # a second run into another folder inside the inputs: r1's PNGs are not photos
    assert cli_main(_predict(setup, [photos], photos / "r2")) == 0
    err = capsys.readouterr().err
    assert "left out the outputs of an earlier run" in err and str(photos / "r1") in err
    assert sorted(_snapshot(photos / "r2")) == ["color/x.png", "labels/x.png", "overlay/x.png"]
    # --out's own folders named as the input: said to be outputs, not "no images"
    line = refused(_predict(setup, [photos / "r2" / "overlay"], photos / "r2"), capsys)
    assert "this command's outputs under --out, never inputs" in line


def test_predict_says_when_out_holds_outputs_of_other_images(setup, tmp_path, capsys) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    images = sorted((setup["data"] / "images").iterdir())[:2]
    for k, image in enumerate(images):
        shutil.copy(image, photos / f"x{k}.png")
    out = tmp_path / "out"
    assert cli_main(_predict(setup, [photos], out)) == 0
    (photos / "x1.png").unlink()
    capsys.readouterr()
    # x1's outputs (another model's, perhaps) stay beside x0's new ones: said, not removed
    assert cli_main(_predict(setup, [photos], out, "--overwrite")) == 0
    err = capsys.readouterr().err
    assert f"{out} also holds 3 output files of images this run does not segment" in err
    assert (out / "labels" / "x1.png").exists()
    assert cli_main(_predict(setup, [photos], tmp_path / "new")) == 0  # a fresh --out: nothing
    assert "also holds" not in capsys.readouterr().err


def test_predict_never_writes_over_an_input_or_the_dataset(setup, tmp_path, capsys) -> None:
    # an input image that is also an output path: refused even with --overwrite
    folder = tmp_path / "d"
    (folder / "labels").mkdir(parents=True)
    image = folder / "labels" / "x.png"
    shutil.copy(next((setup["data"] / "images").iterdir()), image)
    before = image.read_bytes()
    line = refused(_predict(setup, [image], folder, "--overwrite"), capsys)
    assert "an input image" in line and str(image) in line and "--overwrite" in line
    assert image.read_bytes() == before
    # --data ROOT -o ROOT on ROOT/images: the outputs would be ROOT's labels
    data = setup["data"]
    snap = _snapshot(data)
    line = refused(
        _predict(setup, [data / "images"], data, "--data", str(data), "--overwrite"), capsys
    )
    assert "a file of the dataset" in line and str(data / "labels") in line
    assert _snapshot(data) == snap


def test_refine_apply_checks_outputs_before_loading_anything(setup, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    image = tmp_path / "x.png"
    shutil.copy(next((setup["data"] / "images").iterdir()), image)
    (out / "changed").mkdir(parents=True)
    (out / "changed" / "x.png").write_bytes(b"earlier")
    # the refiner and base do not exist: the output check comes first
    argv = ["refine", "apply", str(image), "-r", str(tmp_path / "none.pt"),
            "-b", str(tmp_path / "none2.pt"), "-o", str(out), "--device", "cpu"]  # fmt: skip
    line = refused(argv, capsys)
    assert str(out / "changed" / "x.png") in line and "--overwrite" in line
    assert (out / "changed" / "x.png").read_bytes() == b"earlier"
    # an input image that is also an output path: refused even with --overwrite
    (tmp_path / "labels").mkdir()
    shutil.copy(image, tmp_path / "labels" / "x.png")
    argv = [argv[0], argv[1], str(tmp_path / "labels" / "x.png"), *argv[3:7], "-o",
            str(tmp_path), "--overwrite"]  # fmt: skip
    line = refused(argv, capsys)
    assert "an input image" in line and str(tmp_path / "labels" / "x.png") in line
    assert (tmp_path / "labels" / "x.png").read_bytes() == image.read_bytes()


def test_data_check_json_never_replaces_a_dataset_file(setup, tmp_path, capsys) -> None:
    data = setup["data"]
    snap = _snapshot(data)
    for target in ("train.txt", "meta.json"):
        line = refused(
            ["data", "check", str(data), "--json", str(data / target), "--overwrite"], capsys
        )
        assert str(data / target) in line and "a file of the dataset" in line
        assert "--overwrite" in line
    assert _snapshot(data) == snap
    report = tmp_path / "report.json"
    report.write_text("keep me")
    line = refused(["data", "check", str(data), "--json", str(report)], capsys)
    assert str(report) in line and "--overwrite" in line
    assert report.read_text() == "keep me"
    assert cli_main(["data", "check", str(data), "--json", str(report), "--overwrite"]) == 0
    assert json.loads(report.read_text())["root"] == str(data)


def test_output_names_never_take_another_files_name(tmp_path):
    """x.jpg and x.png share the name x; the suffix given to the second must not be x_1 when
    x_1.png is an input too, nor may two names differ only in case."""
    from dualseg.engine.outputs import unique_names

    files = [tmp_path / n for n in ("x.jpg", "x.png", "x_1.png", "X.bmp", "x.jpg")]
    names = [name for _, name in unique_names([(p, p.stem) for p in files])]
    assert names == ["x", "x_2", "x_1", "X_3", "x"]  # the repeated x.jpg keeps its name


def test_an_evaluation_stopped_by_an_unreadable_image_leaves_no_predictions(
    setup, tmp_path, capsys
) -> None:
    data = Path(shutil.copytree(setup["data"], tmp_path / "data"))
    images = sorted((data / "images").glob("val_*"))
    good = images[-1].read_bytes()
    images[-1].write_bytes(good[:200])  # the last image, cut short: found after the first
    preds = tmp_path / "preds"
    assert cli_main([*_eval(setup, data, preds), "--batch-size", "1"]) == 1
    err = capsys.readouterr().err
    assert "unreadable or truncated" in err and "removed the 2 prediction files" in err, err
    assert not preds.exists() or not any(preds.rglob("*.png"))
    images[-1].write_bytes(good)  # the corrected rerun needs no --overwrite
    assert cli_main([*_eval(setup, data, preds), "--batch-size", "1"]) == 0
