"""A plain folder of images and masks, onboarded without guessing (issue 39): layouts by their
common names, classes inferred into meta.json, a held-out split by file name, 12-bit images,
a label map that leaves one class."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from datahelpers import save
from PIL import Image

from dualseg.commands.data import main
from dualseg.data import build_dataset, detect_layout, load_meta_file
from dualseg.errors import DataError

SIZE = (64, 64)


def write_masks(root, n=3, *, images="image", labels="label", split=""):
    """ISBI-like pairs: grey images, 0/255 masks."""
    rng = np.random.default_rng(n)
    for i in range(n):
        image = rng.integers(0, 256, SIZE, np.uint8)
        mask = np.where(rng.random(SIZE) < 0.3, 0, 255).astype(np.uint8)
        save(root / images / split / f"{i}.png", image)
        save(root / labels / split / f"{i}.png", mask)
    return root


@pytest.mark.parametrize(
    ("images", "labels", "split"),
    [
        ("image", "label", ""),
        ("images", "masks", ""),
        ("img", "ann", ""),
        ("imgs", "annotations", ""),
        ("JPEGImages", "SegmentationClass", ""),
        ("image", "mask", "train"),
    ],
)
def test_common_pair_folder_names_are_recognised_and_named(tmp_path, capsys, images, labels, split):
    write_masks(tmp_path, images=images, labels=labels, split=split)
    assert detect_layout(tmp_path) == "folder"
    assert main(["check", str(tmp_path), "--write-meta", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"read {images}/{split + '/' if split else ''}" in out
    assert labels in out


def test_split_subfolders_first_are_recognised(tmp_path):
    for split in ("train", "val"):
        write_masks(tmp_path / split, 2, images="img", labels="mask")
    (tmp_path / "meta.json").write_text(json.dumps(_binary_meta()))
    assert len(build_dataset(tmp_path, split="val")) == 2


def _binary_meta():
    return {
        "name": "b",
        "class_names": ["a", "b"],
        "palette": [[0, 0, 0], [9, 9, 9]],
        "ignore_index": None,
        "label_map": {"255": 1},
    }


def test_unknown_layout_names_the_folders_seen_and_folder_layout_no_layout_hint(tmp_path):
    write_masks(tmp_path, images="pictures", labels="truth")
    with pytest.raises(DataError, match="cannot tell") as err:
        detect_layout(tmp_path)
    assert "pictures/" in str(err.value) and "truth/" in str(err.value)
    with pytest.raises(DataError) as err:
        build_dataset(tmp_path, layout="folder", preset="voc")
    message = str(err.value)
    assert "pictures/" in message and "or pass --layout" not in message and "\n" not in message


def test_write_meta_infers_0_255_masks_as_two_classes(tmp_path, capsys):
    write_masks(tmp_path)
    with pytest.raises(DataError) as err:
        build_dataset(tmp_path)
    assert "label_map" in str(err.value) and "data check" in str(err.value)
    assert "--write-meta" in str(err.value)
    assert main(["check", str(tmp_path), "--write-meta"]) == 0
    written = json.loads((tmp_path / "meta.json").read_text())
    assert written["class_names"] == ["background", "foreground"]
    assert written["label_map"] == {"0": 0, "255": 1} and len(written["palette"]) == 2
    meta = load_meta_file(tmp_path / "meta.json")  # the reader reads what it writes
    ds = build_dataset(tmp_path)
    assert ds.meta == meta and set(ds[0][1].unique().tolist()) == {0, 1}
    capsys.readouterr()
    from dualseg.cli import main as dualseg_main

    assert dualseg_main(["data", "check", str(tmp_path), "--write-meta"]) == 1  # no overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert main(["check", str(tmp_path), "--write-meta", "--overwrite"]) == 0


def test_data_check_without_meta_names_the_pairs_it_found_first(tmp_path, capsys):
    from dualseg.cli import main as dualseg_main

    write_masks(tmp_path / "train", 3, images="img", labels="mask")
    write_masks(tmp_path / "val", 2, images="img", labels="mask")
    assert dualseg_main(["data", "check", str(tmp_path), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    found = "found the folder layout (train 3 pairs in train/img/ + train/mask/, val 2 pairs in "
    assert found in err and err.index(found) < err.index("--write-meta")


def test_write_meta_keeps_0_to_k_values_and_255_as_ignore(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(2):
        save(tmp_path / "images" / f"{i}.png", rng.integers(0, 256, (*SIZE, 3), np.uint8))
        label = rng.choice(np.array([0, 1, 2, 255], np.uint8), SIZE)
        save(tmp_path / "labels" / f"{i}.png", label)
    assert main(["check", str(tmp_path), "--write-meta", "--quiet"]) == 0
    meta = load_meta_file(tmp_path / "meta.json")
    assert meta.class_names == ("class_0", "class_1", "class_2")
    assert meta.label_map == () and meta.ignore_value == 255


def test_val_fraction_holds_out_a_reproducible_split_by_file_name(tmp_path):
    write_masks(tmp_path, 10)
    (tmp_path / "meta.json").write_text(json.dumps(_binary_meta()))
    train = build_dataset(tmp_path, split="train", val_fraction=0.2)
    val = build_dataset(tmp_path, split="val", val_fraction=0.2)
    names = lambda ds: {p[0].name for p in ds.samples}  # noqa: E731
    assert len(val) == 2 and len(train) == 8 and not names(train) & names(val)
    assert names(build_dataset(tmp_path, split="val", val_fraction=0.2)) == names(val)
    assert len(build_dataset(tmp_path, split="val")) == 10  # 0: the folder as it is
    write_masks(tmp_path / "val", 2)  # a val split of its own: no second one is made up
    with pytest.raises(DataError, match="val split of its own"):
        build_dataset(tmp_path, split="val", val_fraction=0.2)


def test_data_check_reports_the_image_value_range_and_12_bit_depth(tmp_path, capsys):
    write_masks(tmp_path, 2)
    for i in range(2):  # 12-bit microscopy data in 16-bit PNGs
        Image.fromarray(np.full(SIZE, 300 + 1000 * i, np.uint16)).save(
            tmp_path / "image" / f"{i}.png"
        )
    (tmp_path / "meta.json").write_text(json.dumps(_binary_meta()))
    out_json = tmp_path / "report.json"
    assert main(["check", str(tmp_path), "--json", str(out_json), "--quiet"]) == 0
    assert "train images: uint16 values 300..1300, read as 12-bit" in capsys.readouterr().out
    values = json.loads(out_json.read_text())["image_values"]["train"]
    assert (values["min"], values["max"], values["bit_depth"]) == (300, 1300, [12])


def test_a_label_map_that_leaves_one_class_warns(tmp_path, capsys):
    write_masks(tmp_path, 2)
    meta = {**_binary_meta(), "label_map": {}, "ignore_index": 255}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="leaves one class"):
        build_dataset(tmp_path, label_map={255: 0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_dataset(tmp_path, label_map={255: 1})  # the usual fix: two classes, no word
    main(["check", str(tmp_path), "--label-map", "255:0", "--quiet"])
    assert "warning: --label-map 255:0 leaves one class" in capsys.readouterr().out


def test_build_dataset_takes_an_explicit_bit_depth(tmp_path):
    write_masks(tmp_path, 2)
    for i in range(2):
        values = np.full(SIZE, 2000, np.uint16)  # 16-bit data that happens to be dark
        Image.fromarray(values).save(tmp_path / "image" / f"{i}.png")
    (tmp_path / "meta.json").write_text(json.dumps(_binary_meta()))
    detected = build_dataset(tmp_path).load_pair(0)[0]
    told = build_dataset(tmp_path, bit_depth=16).load_pair(0)[0]
    assert detected.max() == 125 and told.max() == 8  # 2000/4095 vs 2000/65535 of 255
