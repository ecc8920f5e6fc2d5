"""The ADE20K preset and layout, and datasets mixed from several roots."""

from __future__ import annotations

import json

import numpy as np
import pytest
from datahelpers import TINY, random_pair, save, write_list_dataset

from dualseg.data import build_dataset, detect_layout, get_preset, read_label
from dualseg.errors import DataError


def _ade_tree(tmp_path):
    """ADEChallengeData2016/images|annotations/{training,validation} with raw labels 0..150."""
    rng = np.random.default_rng(5)
    ade = tmp_path / "ADEChallengeData2016"
    raw = {}
    for split, stems in (("training", ("ADE_train_00000001", "ADE_train_00000002")),
                         ("validation", ("ADE_val_00000001",))):  # fmt: skip
        for stem in stems:
            image, _ = random_pair(rng)
            save(ade / "images" / split / f"{stem}.jpg", image)
            label = rng.choice(np.array([0, 1, 2, 77, 150], np.uint8), size=image.shape[:2])
            raw[stem] = label
            save(ade / "annotations" / split / f"{stem}.png", label)
    return ade, raw


def test_ade20k_preset_has_150_classes_and_ignores_raw_zero():
    meta = get_preset("ade20k")
    assert meta.num_classes == 150 and len(set(meta.class_names)) == 150
    assert meta.class_names[:3] == ("wall", "building", "sky") and meta.class_names[-1] == "flag"
    assert len(set(meta.palette)) == 150 and meta.reduce_zero_label
    lut = meta.lookup_table()
    assert lut[0] == 255 and lut[1] == 0 and lut[150] == 149 and lut[255] == 255


def test_ade20k_layout_reads_the_challenge_tree(tmp_path):
    ade, raw = _ade_tree(tmp_path)
    for root in (tmp_path, ade):  # the ADEChallengeData2016 folder or its parent
        assert detect_layout(root) == "ade20k"
        train = build_dataset(root, split="train")  # preset from the layout
        assert train.meta.name == "ade20k" and len(train) == 2
        assert len(build_dataset(root, split="val")) == 1
        assert len(build_dataset(root, split="validation")) == 1  # ADE20K's own split name
    stem = "ADE_train_00000001"
    label = read_label(ade / "annotations" / "training" / f"{stem}.png", train.meta)
    expected = np.where(raw[stem] == 0, 255, raw[stem].astype(np.int64) - 1)
    assert np.array_equal(label, expected)  # 0 -> ignore, v -> v - 1
    assert set(np.unique(label).tolist()) == {255, 0, 1, 76, 149}
    _, tensor_label = train[0]
    assert set(tensor_label.unique().tolist()) <= {255, 0, 1, 76, 149}
    # a raw value past 150 names the raw range 1..150
    bad = raw[stem].copy()
    bad[0, 0] = 151
    save(ade / "annotations" / "training" / f"{stem}.png", bad)
    with pytest.raises(DataError, match=r"label values \[151\].*\(1\.\.150\)"):
        read_label(ade / "annotations" / "training" / f"{stem}.png", train.meta)
    # a split ADE20K lacks: the splits it has, in dualseg's names (as for every layout)
    with pytest.raises(DataError, match=r"has no split 'testing' \(splits found: train, val\)"):
        build_dataset(tmp_path, split="testing", layout="ade20k")


def test_ade20k_preset_on_a_dataset_whose_meta_json_has_another_mapping_is_refused(tmp_path):
    """dualseg augment writes ADE20K's labels reduced (meta.json: name ade20k,
    reduce_zero_label false); --preset ade20k turned the reduction back on, shifting every class
    by one without a word."""
    from dualseg.commands.augment import main as augment

    ade, _ = _ade_tree(tmp_path)
    out = tmp_path / "aug"
    assert augment([str(ade), str(out), "--count", "2", "--crop-size", "12", "16"]) == 0
    written = json.loads((out / "meta.json").read_text())
    assert written["name"] == "ade20k" and written["reduce_zero_label"] is False
    with pytest.raises(
        DataError, match=r"--preset ade20k reads .*1..150, ignore 0, 255 but .*0..149"
    ):
        build_dataset(out, preset="ade20k")
    own = build_dataset(out)  # meta.json's mapping: the labels as written
    assert own.meta.name == "ade20k" and not own.meta.reduce_zero_label
    assert build_dataset(ade, preset="ade20k").meta.reduce_zero_label  # no meta.json: preset
    (out / "meta.json").write_text(json.dumps({**written, "reduce_zero_label": True}))
    assert build_dataset(out, preset="ade20k").meta.reduce_zero_label  # the same mapping
    # CamVid's raw 11 (ignore) is 255 in dualseg augment's labels: no value is read otherwise
    camvid = get_preset("camvid").to_dict()
    (out / "meta.json").write_text(json.dumps({**camvid, "source_ignore": []}))
    assert build_dataset(out, preset="camvid").meta.source_ignore == (11,)


def test_several_roots_are_concatenated(tmp_path):
    a = write_list_dataset(tmp_path / "a", n=3)
    b = write_list_dataset(tmp_path / "b", n=2)
    for root in (a, b):
        (root / "meta.json").write_text(json.dumps(TINY.to_dict()))
    mixed = build_dataset([a, b])
    assert len(mixed) == 5 and mixed.meta == TINY
    assert mixed.samples == build_dataset(a).samples + build_dataset(b).samples
    assert len(build_dataset([str(a)])) == 3


def test_roots_with_different_classes_are_refused_naming_both(tmp_path):
    a = write_list_dataset(tmp_path / "a", n=2)
    b = write_list_dataset(tmp_path / "b", n=2)
    (a / "meta.json").write_text(json.dumps(TINY.to_dict()))
    other = {**TINY.to_dict(), "class_names": ["a", "b", "c", "x"]}
    (b / "meta.json").write_text(json.dumps(other))
    with pytest.raises(DataError) as err:
        build_dataset([a, b])
    message = str(err.value)
    assert "cannot mix" in message and str(a) in message and str(b) in message
    assert "[a, b, c, d]" in message and "[a, b, c, x]" in message
    # same names but other raw ignore values: refused too (labels would be misread)
    (b / "meta.json").write_text(json.dumps({**TINY.to_dict(), "source_ignore": [7]}))
    with pytest.raises(DataError, match="label values:"):
        build_dataset([a, b])
    with pytest.raises(DataError, match="no dataset root"):
        build_dataset([])


def _colour_root(root, palette, void=((0, 0, 0),)):
    """A root of one colour-coded pair, all of class 0 drawn in ``palette[0]``."""
    meta = {**TINY.to_dict(), "palette": palette, "void_colors": [list(c) for c in void]}
    (root / "images").mkdir(parents=True)
    save(root / "images" / "x.png", np.zeros((4, 4, 3), np.uint8))
    save(root / "labels" / "x.png", np.full((4, 4, 3), palette[0], np.uint8))
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def test_colour_roots_with_other_palettes_are_refused_naming_both(tmp_path):
    """Decoded through the first root's palette, B's class-0 colour would read as class 1."""
    pal = [list(c) for c in TINY.palette]
    a = _colour_root(tmp_path / "a", pal)
    b = _colour_root(tmp_path / "b", [pal[1], pal[0], *pal[2:]])
    with pytest.raises(DataError, match="palette:") as err:
        build_dataset([a, b], label_format="color")
    assert str(a) in str(err.value) and str(b) in str(err.value)
    c = _colour_root(tmp_path / "c", pal, void=((9, 9, 9),))
    with pytest.raises(DataError, match="void colours:"):
        build_dataset([a, c], label_format="color")
    same = build_dataset([a, _colour_root(tmp_path / "d", pal)], label_format="color")
    assert [int(same.load_pair(i)[1].max()) for i in range(2)] == [0, 0]
