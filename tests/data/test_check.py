"""`dualseg data check`: every problem at once, plus a per-class pixel histogram."""

from __future__ import annotations

import json

import numpy as np
import pytest
from datahelpers import TINY, save

from dualseg.commands.data import main
from dualseg.data.check import check_dataset


def test_reports_every_problem_and_the_histogram(list_root, tmp_path, capsys):
    (list_root / "meta.json").write_text(json.dumps(TINY.to_dict()))
    (list_root / "train" / "0.png").unlink()  # missing listed file
    save(list_root / "trainannot" / "1.png", np.zeros((5, 5), np.uint8))  # size mismatch
    save(list_root / "trainannot" / "2.png", np.full((16, 24), 7, np.uint8))  # out of range
    val_img = list_root / "val" / "0.png"
    val_img.write_bytes(val_img.read_bytes()[:60])  # truncated
    save(list_root / "valannot" / "1.png", np.full((16, 24), 9, np.uint8))  # 9 -> ignore: fine

    out_json = tmp_path / "report.json"
    assert main(["check", str(list_root), "--json", str(out_json)]) == 1
    text = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    problems = report["problems"]
    assert len(problems) == 4, problems
    for needle in ("train/0.png", "trainannot/1.png", "trainannot/2.png", "val/0.png"):
        assert sum(needle in p for p in problems) == 1, needle
        assert needle in text
    assert report["pairs"] == {"train": 2, "val": 2}
    # histogram: the readable labels are trainannot/1 (5x5 zeros) and valannot/0, valannot/1
    hist = report["histogram"]
    assert hist["ignore"] == 16 * 24
    assert sum(hist.values()) == 25 + 2 * 16 * 24
    assert "(ignore)" in text and "4 problem(s)" in text


def test_clean_dataset_passes(list_root, capsys):
    report = check_dataset(list_root, preset=TINY)
    assert report.problems == [] and report.pairs == {"train": 3, "val": 2}
    assert report.histogram[:4].sum() == (3 + 2) * 16 * 24
    (list_root / "meta.json").write_text(json.dumps(TINY.to_dict()))
    assert main(["check", str(list_root), "--split", "val", "--layout", "list"]) == 0
    text = capsys.readouterr().out
    assert "no problems found" in text and "pairs: val 2" in text


def test_unusable_root_is_one_line_error_through_the_cli(tmp_path, capsys):
    from dualseg.cli import main as dualseg_main

    assert dualseg_main(["data", "check", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nope" in err and "not found" in err


def test_a_list_file_as_root_is_its_own_split(list_root, capsys):
    """data check data/val.txt once reported the val pairs as split 'train'."""
    (list_root / "meta.json").write_text(json.dumps(TINY.to_dict()))
    report = check_dataset(list_root / "val.txt")
    assert report.problems == [] and report.pairs == {"val": 2}
    assert set(report.split_histograms) == {"val"}
    assert main(["check", str(list_root / "val.txt"), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "pairs: val 2\n" in text


def test_a_class_named_ignore_keeps_its_count_in_the_json(list_root) -> None:
    from dataclasses import replace

    meta = replace(TINY, class_names=("a", "b", "c", "ignore"))
    report = check_dataset(list_root, preset=meta).to_dict()
    hist = report["histogram"]
    assert set(hist) == {"a", "b", "c", "ignore", "(ignore)"}
    assert sum(hist.values()) == (3 + 2) * 16 * 24


def test_a_val_split_sharing_images_with_train_is_said(list_root, capsys) -> None:
    """A leak nothing said: the val scores were on images trained on. data check counts it a
    problem; training goes on with a warning (a refusal would stop a deliberate setup)."""
    from dualseg.engine.options import DataConfig
    from dualseg.engine.preflight import check_training_data

    val = (list_root / "val.txt").read_text()
    first_train = (list_root / "train.txt").read_text().splitlines()[0]
    (list_root / "val.txt").write_text(val + first_train + "\n")
    report = check_dataset(list_root, preset=TINY)
    assert report.split_overlap and "split 'val' shares 1 of its 3 images with split 'train'" in (
        report.split_overlap
    )
    assert report.split_overlap in report.problems
    (list_root / "meta.json").write_text(json.dumps(TINY.to_dict()))
    data = DataConfig(root=str(list_root), layout="list")
    check_training_data(data)  # no refusal
    assert "warning: " in capsys.readouterr().err


def test_a_split_with_images_but_no_labels_folder_is_named(tmp_path, capsys) -> None:
    """images/{train,val} with labels/train only: data check found "no problems", eval said
    "no split 'val'; pass one of them as --split" (train), and train's hint sent to data check."""
    from dualseg.data import build_dataset
    from dualseg.data.check import require_trainable
    from dualseg.errors import DataError

    rng = np.random.default_rng(0)
    for split in ("train", "val", "test"):
        for i in range(2):
            image = rng.integers(0, 256, (8, 8, 3), np.uint8)
            save(tmp_path / "images" / split / f"{i}.png", image)
            if split == "train":
                label = rng.integers(0, 4, (8, 8), np.uint8)
                save(tmp_path / "labels" / split / f"{i}.png", label)
    said = f"{tmp_path / 'images' / 'val'} has no labels/val (or masks/val) beside it"
    report = check_dataset(tmp_path, preset=TINY)  # unlabelled test images: a test set, no word
    assert len(report.problems) == 1 and said in report.problems[0]
    checked = check_dataset(tmp_path, splits=("train", "val"), preset=TINY)
    assert len(checked.problems) == 1 and said in checked.problems[0]
    with pytest.raises(DataError, match="has no labels/val") as err:
        require_trainable(checked, "train")
    assert said in str(err.value)
    for layout in ("auto", "folder"):
        with pytest.raises(DataError, match="has no labels/val") as err:
            build_dataset(tmp_path, split="val", layout=layout, preset=TINY)
        assert said in str(err.value) and "--split" not in str(err.value)
    with pytest.raises(DataError, match="has no labels/val"):
        check_dataset(tmp_path, splits=("val",), preset=TINY)
