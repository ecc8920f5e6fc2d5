"""Every layout loads; every way a dataset can be wrong gives one DataError naming the file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from datahelpers import TINY, random_pair, save
from PIL import Image

from dualseg.data import (
    available_splits,
    build_dataset,
    build_train_transform,
    detect_layout,
    get_preset,
    read_image,
)
from dualseg.data.check import check_dataset
from dualseg.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from dualseg.errors import DataError


def _check_item(ds, n_classes):
    image, label = ds[0]
    assert image.dtype == torch.float32 and image.shape[0] == 3
    assert label.dtype == torch.int64 and label.shape == image.shape[1:]
    values = set(label.unique().tolist())
    assert values <= set(range(n_classes)) | {255}


def test_list_layout_from_folder_or_list_file(list_root):
    ds = build_dataset(list_root, split="train", preset=TINY)
    assert detect_layout(list_root) == "list" and len(ds) == 3
    _check_item(ds, 4)
    assert len(build_dataset(list_root / "val.txt", preset=TINY)) == 2
    # the first item is the ImageNet-normalized first image
    raw = read_image(ds.samples[0][0])
    mean, std = torch.tensor(IMAGENET_MEAN), torch.tensor(IMAGENET_STD)
    expected = (torch.from_numpy(raw).float() / 255 - mean) / std
    assert torch.allclose(ds[0][0], expected.permute(2, 0, 1), atol=1e-5)


@pytest.mark.parametrize("label_dir", ["labels", "masks"])
@pytest.mark.parametrize("arrangement", ["flat", "split_first", "split_inside"])
def test_folder_layout(tmp_path, label_dir, arrangement):
    rng = np.random.default_rng(1)
    base, sub = {
        "flat": (tmp_path, ""),
        "split_first": (tmp_path / "train", ""),
        "split_inside": (tmp_path, "train"),
    }[arrangement]
    for stem, suffix in (("a", ".png"), ("b", ".jpg"), ("c", ".bmp")):
        image, label = random_pair(rng)
        save(base / "images" / sub / f"{stem}{suffix}", image)
        save(base / label_dir / sub / f"{stem}.png", label)
    assert detect_layout(tmp_path) == "folder"
    ds = build_dataset(tmp_path, preset=TINY)
    assert [p[0].stem for p in ds.samples] == ["a", "b", "c"]
    _check_item(ds, 4)


def test_voc_layout(tmp_path):
    rng = np.random.default_rng(2)
    voc = tmp_path / "VOCdevkit" / "VOC2012"
    for stem in ("2007_000032", "2007_000033"):
        image, _ = random_pair(rng)
        save(voc / "JPEGImages" / f"{stem}.jpg", image)
        label = rng.choice(np.array([0, 5, 20, 255], np.uint8), size=image.shape[:2])
        save(voc / "SegmentationClass" / f"{stem}.png", label)
    (voc / "ImageSets" / "Segmentation").mkdir(parents=True)
    (voc / "ImageSets" / "Segmentation" / "val.txt").write_text("2007_000032\n2007_000033\n")
    ds = build_dataset(tmp_path / "VOCdevkit", split="val")  # preset from the layout
    assert ds.meta.name == "voc" and len(ds) == 2
    _check_item(ds, 21)
    assert set(ds[0][1].unique().tolist()) <= {0, 5, 20, 255}


def test_cityscapes_layout(tmp_path):
    rng = np.random.default_rng(3)
    for city, stem in (("aachen", "aachen_000000_000019"), ("bonn", "bonn_000001_000019")):
        image, _ = random_pair(rng)
        save(tmp_path / "leftImg8bit" / "train" / city / f"{stem}_leftImg8bit.png", image)
        label = rng.choice(np.array([0, 18, 255], np.uint8), size=image.shape[:2])
        save(tmp_path / "gtFine" / "train" / city / f"{stem}_gtFine_labelTrainIds.png", label)
    assert detect_layout(tmp_path) == "cityscapes"
    ds = build_dataset(tmp_path)
    assert ds.meta.name == "cityscapes" and ds.meta.num_classes == 19 and len(ds) == 2
    _check_item(ds, 19)


def test_meta_json_gives_classes_and_missing_preset_is_explained(list_root):
    with pytest.raises(DataError, match="preset"):
        build_dataset(list_root)
    (list_root / "meta.json").write_text(json.dumps(TINY.to_dict()))
    assert build_dataset(list_root).meta == TINY
    assert get_preset("camvid").num_classes == 11 and get_preset("camvid").source_ignore == (11,)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"class_names": "abcd"}, "class_names must be a list of strings"),
        ({"class_names": ["a", "b", "a", "d"]}, "class_names lists 'a' twice"),
        ({"palette": [[200, 0, 0], [0, 300, 0], [0, 0, 200], [1, 1, 1]]}, r"palette\[1\]"),
        ({"palette": [[200, 0, 0], [0, -1, 0], [0, 0, 200], [1, 1, 1]]}, r"palette\[1\]"),
        ({"palette": [[200, 0], [0, 0, 0], [0, 0, 200], [1, 1, 1]]}, r"palette\[0\]"),
        ({"void_colors": [[0, 0, 256]]}, r"void_colors\[0\] must be \[r, g, b\]"),
        ({"reduce_zero_label": "false"}, "reduce_zero_label must be true or false"),
        ({"reduce_zero_label": 0}, "reduce_zero_label must be true or false"),
        ({"label_map": {"255": 1.9}}, r"label_map\['255'\] must be an integer, got 1.9"),
        ({"label_map": {"255": True}}, r"label_map\['255'\] must be an integer, got True"),
        ({"label_map": {"2.5": 1}}, "label_map key '2.5' must be an integer"),
        ({"label_map": [[255, 1]]}, "label_map must be an object"),
        ({"ignore_index": 254.9}, "ignore_index must be an integer, got 254.9"),
        ({"ignore_index": True}, "ignore_index must be an integer, got True"),
        ({"source_ignore": ["9"]}, "source_ignore must be an integer, got '9'"),
        # misspelled keys were dropped: the defaults read the labels (classes shifted by one)
        (
            {"reduce_zero_labels": True},
            "unknown key 'reduce_zero_labels'; did you mean 'reduce_zero_label'",
        ),
        ({"ignore_value": 0}, "unknown key 'ignore_value'; did you mean 'ignore_index'"),
        ({"comment": "x"}, "unknown key .comment.; the keys are name, class_names"),
    ],
)
def test_bad_meta_json_is_one_line_naming_the_file(list_root, change, expected):
    (list_root / "meta.json").write_text(json.dumps({**TINY.to_dict(), **change}))
    with pytest.raises(DataError, match=expected) as err:
        build_dataset(list_root)
    message = str(err.value)
    assert message.startswith(str(list_root / "meta.json")) and "\n" not in message


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            {"palette": [[200, 0, 0], [0, 200, 0], [200, 0, 0], [1, 1, 1]]},
            r"classes 'a' and 'c' share the palette colour \(200, 0, 0\)",
        ),
        ({"void_colors": [[0, 200, 0]]}, r"void colour \(0, 200, 0\) is also class 'b'"),
    ],
)
def test_a_colour_meaning_two_things_is_refused_only_where_colours_are_decoded(
    list_root, change, expected
):
    from dualseg.data.readers import decode_color_label

    (list_root / "meta.json").write_text(json.dumps({**TINY.to_dict(), **change}))
    meta = build_dataset(list_root).meta  # index labels: the palette only draws
    with pytest.raises(DataError, match=expected):
        decode_color_label(np.zeros((2, 2, 3), np.uint8), meta)


def test_meta_json_keys_are_to_dicts_and_a_note_for_people_is_read(list_root):
    from dualseg.data.presets import META_KEYS

    assert set(META_KEYS) == set(TINY.to_dict())  # the one list to refuse unknown keys by
    (list_root / "meta.json").write_text(json.dumps({**TINY.to_dict(), "_comment": "by hand"}))
    assert build_dataset(list_root).meta.class_names == TINY.class_names


def test_meta_json_integers_and_booleans_are_read_as_written(list_root):
    meta = {**TINY.to_dict(), "label_map": {"255": 1, 7: 2}, "reduce_zero_label": False}
    (list_root / "meta.json").write_text(json.dumps({**meta, "ignore_index": None}))
    read = build_dataset(list_root).meta
    assert read.label_map == ((7, 2), (255, 1)) and read.ignore_value is None
    assert read.reduce_zero_label is False


def test_a_meta_json_not_in_utf8_is_one_line(list_root):
    (list_root / "meta.json").write_bytes(
        json.dumps(TINY.to_dict()).replace("a", "\xe9").encode("latin-1")
    )
    with pytest.raises(DataError, match=r"not UTF-8 .*save the dataset description as UTF-8 JSON"):
        build_dataset(list_root)


def test_a_meta_json_with_a_byte_order_mark_is_read(list_root):
    """Windows Notepad's UTF-8 starts with a BOM, which json refused ("Unexpected UTF-8 BOM")."""
    (list_root / "meta.json").write_text(json.dumps(TINY.to_dict()), encoding="utf-8-sig")
    assert build_dataset(list_root).meta == TINY


def test_missing_listed_file(list_root):
    missing = list_root / "train" / "1.png"
    missing.unlink()
    with pytest.raises(DataError) as err:
        build_dataset(list_root, preset=TINY)
    assert str(missing) in str(err.value) and "train.txt:2" in str(err.value)


def test_size_mismatch_names_both_files(list_root):
    save(list_root / "trainannot" / "0.png", np.zeros((10, 10), np.uint8))
    ds = build_dataset(list_root, preset=TINY)
    with pytest.raises(DataError, match="differs") as err:
        ds[0]
    assert "trainannot/0.png" in str(err.value) and "train/0.png" in str(err.value)


def test_out_of_range_label_when_loading(list_root):
    save(list_root / "trainannot" / "2.png", np.full((16, 24), 7, np.uint8))
    ds = build_dataset(list_root, preset=TINY)
    with pytest.raises(DataError, match=r"\[7\]") as err:
        ds[2]
    assert "trainannot/2.png" in str(err.value)


def test_empty_dataset_and_malformed_lines(tmp_path):
    (tmp_path / "train.txt").write_text("\n")
    with pytest.raises(DataError, match="empty") as err:
        build_dataset(tmp_path, preset=TINY)
    assert str(tmp_path / "train.txt") in str(err.value)
    (tmp_path / "train.txt").write_text("only_one_path.png\n")
    with pytest.raises(DataError, match=r"train.txt:1: expected"):
        build_dataset(tmp_path, preset=TINY)
    with pytest.raises(DataError, match=r"has no split 'val' \(splits found: train\)"):
        build_dataset(tmp_path, split="val")  # no val.txt, no images/, ...
    (tmp_path / "train.txt").unlink()
    with pytest.raises(DataError, match="cannot tell the dataset layout"):
        build_dataset(tmp_path, split="val")  # no split at all


def test_folder_with_unmatched_files(tmp_path):
    rng = np.random.default_rng(4)
    image, label = random_pair(rng)
    save(tmp_path / "images" / "a.png", image)
    save(tmp_path / "labels" / "b.png", label)
    with pytest.raises(DataError, match=r"a\.png: no label") as err:
        build_dataset(tmp_path, preset=TINY)
    assert "1 more" in str(err.value)


def test_folder_layout_reads_webp_pairs_as_the_list_layout_does(tmp_path):
    # a lossless WebP pair was skipped without a word (the list layout read it)
    rng = np.random.default_rng(5)
    image, label = random_pair(rng)
    save(tmp_path / "images" / "a.png", image)
    save(tmp_path / "labels" / "a.png", label)
    Image.fromarray(image).save(tmp_path / "images" / "b.webp", lossless=True)
    Image.fromarray(label).save(tmp_path / "labels" / "b.webp", lossless=True)
    ds = build_dataset(tmp_path, preset=TINY)
    assert sorted(p.name for p, _ in ds.samples) == ["a.png", "b.webp"]
    assert np.array_equal(ds.load_pair(1)[1], label)


def test_samples_per_epoch_expands_with_fresh_augmentations(list_root):
    t = build_train_transform(crop_size=(16, 16), scale_range=(0.5, 2.0))
    ds = build_dataset(list_root, preset=TINY, transform=t, samples_per_epoch=10)
    assert len(ds) == 10 and len(ds.samples) == 3
    a, b = ds[1], ds[4]  # the same source pair, different per-index augmentation
    assert not torch.equal(a[0], b[0])
    assert torch.equal(ds[4][0], b[0])  # same index -> same sample
    ds.set_epoch(1)
    assert not torch.equal(ds[4][0], b[0])  # a new epoch -> new augmentations


def test_an_epoch_shorter_than_the_dataset_still_reads_every_pair_equally(list_root):
    ds = build_dataset(list_root, preset=TINY, samples_per_epoch=2)  # 3 pairs, 2 per epoch
    read = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        read += [ds.pair_index(i) for i in range(len(ds))]
    assert sorted(read) == [0, 0, 1, 1, 2, 2]  # each pair twice in 3 epochs (was: 0, 1 only)
    ds.set_epoch(2)  # and the sample itself is the pair's pixels
    torch.testing.assert_close(ds[0][1], build_dataset(list_root, preset=TINY)[1][1])
    plain = build_dataset(list_root, preset=TINY)
    plain.set_epoch(5)
    assert [plain.pair_index(i) for i in range(3)] == [0, 1, 2]  # no expansion: index = pair


def test_stream_is_independent_of_dataloader_workers(list_root):
    t = build_train_transform(crop_size=(16, 16))
    ds = build_dataset(list_root, preset=TINY, transform=t, samples_per_epoch=6, seed=3)

    def batches(workers):
        loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=workers)
        return [torch.cat([x.flatten(), y.flatten().float()]) for x, y in loader]

    assert all(torch.equal(a, b) for a, b in zip(batches(0), batches(2), strict=True))


def _flat_root(root, stems=("a", "b", "c", "d")):
    """A flat images/ + labels/ folder (no list files, no split folders)."""
    rng = np.random.default_rng(5)
    for stem in stems:
        image, label = random_pair(rng)
        save(root / "images" / f"{stem}.png", image)
        save(root / "labels" / f"{stem}.png", label)
    return root


def test_layout_folder_beside_list_files_naming_the_splits_is_refused(tmp_path):
    # --layout folder read the flat images/ for every split: train held the val images too
    root = _flat_root(tmp_path / "lists")
    (root / "train.txt").write_text("images/a.png labels/a.png\nimages/b.png labels/b.png\n")
    (root / "val.txt").write_text("images/c.png labels/c.png\n")
    with pytest.raises(DataError, match=r"train\.txt lists split 'train'.*--layout list"):
        build_dataset(root, split="train", layout="folder", preset=TINY)
    assert len(build_dataset(root, split="train", layout="list", preset=TINY)) == 2  # the fix
    assert len(build_dataset(root, split="train", preset=TINY)) == 2  # auto: the list
    plain = _flat_root(tmp_path / "plain")  # no list files: the flat folder serves any split
    assert len(build_dataset(plain, split="train", layout="folder", preset=TINY)) == 4
    (plain / "all.txt").write_text("images/a.png labels/a.png\n")  # a list of another name
    assert len(build_dataset(plain, split="train", layout="folder", preset=TINY)) == 4


def test_mmsegmentation_stem_lists_name_the_pairs_of_each_split(tmp_path):
    """train.txt / val.txt of file stems beside images/ + labels/ (mmsegmentation's split
    files): auto read every line as a bad pair, and --layout folder scored train's images as
    val's."""
    from dualseg.data.check import check_dataset

    root = _flat_root(tmp_path / "mm")
    save(root / "images" / "e.jpg", random_pair(np.random.default_rng(0))[0])  # stem: any suffix
    (root / "labels" / "e.png").write_bytes((root / "labels" / "a.png").read_bytes())
    (root / "train.txt").write_text("a\nb\ne\n")
    (root / "val.txt").write_text("c\n")
    train = build_dataset(root, split="train", preset=TINY)
    assert [(i.name, lab.name) for i, lab in train.samples] == [
        ("a.png", "a.png"), ("b.png", "b.png"), ("e.jpg", "e.png")
    ]  # fmt: skip
    assert [i.name for i, _ in build_dataset(root / "val.txt", preset=TINY).samples] == ["c.png"]
    assert check_dataset(root, preset=TINY).pairs == {"train": 3, "val": 1}
    with pytest.raises(DataError, match=r"val\.txt lists split 'val'.*--layout list"):
        build_dataset(root, split="val", layout="folder", preset=TINY)
    (root / "val.txt").write_text("c\nzz\n")
    with pytest.raises(DataError, match=r"val\.txt:2: stem 'zz' is in no file of .*images"):
        build_dataset(root, split="val", preset=TINY)
    bare = tmp_path / "bare"  # stems without images/ + labels/ to find them in
    bare.mkdir()
    (bare / "train.txt").write_text("a\n")
    with pytest.raises(DataError, match=r"train\.txt:1: expected 'image_path label_path'"):
        build_dataset(bare, preset=TINY)


def test_a_preset_that_contradicts_the_datasets_meta_json_is_refused(list_root, tmp_path):
    import json

    from dualseg.data import make_synthetic_dataset

    (list_root / "meta.json").write_text(json.dumps(TINY.to_dict()))
    with pytest.raises(DataError, match=r"--preset synthetic has the classes \['sky'.*says"):
        build_dataset(list_root, preset="synthetic")  # read as sky, building, ... silently
    synthetic = make_synthetic_dataset(tmp_path / "syn", n_train=1, n_val=1, size=(24, 32))
    assert len(build_dataset(synthetic, preset="synthetic")) == 1  # the same classes: fine
    # another tool's meta.json (no dualseg description) does not block the preset
    (list_root / "meta.json").write_text('{"classes": [{"title": "sky"}], "tags": []}')
    assert len(build_dataset(list_root, preset="synthetic")) == 3


def test_a_split_the_root_lacks_is_not_the_flat_folder(tmp_path):
    # list files over a flat images/ folder (what make_synthetic_dataset and augment write)
    root = _flat_root(tmp_path / "lists")
    (root / "train.txt").write_text("images/a.png labels/a.png\nimages/b.png labels/b.png\n")
    (root / "val.txt").write_text("images/c.png labels/c.png\n")
    assert len(build_dataset(root, split="val", preset=TINY)) == 1
    missing = r"has no split 'test' \(splits found: train, val\)"
    with pytest.raises(DataError, match=missing):
        build_dataset(root, split="test", preset=TINY)
    with pytest.raises(DataError, match=missing):
        detect_layout(root, "test")
    with pytest.raises(DataError, match=missing):
        check_dataset(root, splits=("test",), preset=TINY)
    assert available_splits(root) == ["train", "val"]
    # split subfolders beside an images/ folder: images/train only
    split_inside = tmp_path / "inside"
    for sub in ("images", "labels"):
        (split_inside / sub / "train").mkdir(parents=True)
    _flat_root(split_inside / "x")  # x/images + x/labels: a split "x" too
    for stem in ("a", "b"):
        for sub in ("images", "labels"):
            (split_inside / "x" / sub / f"{stem}.png").rename(
                split_inside / sub / "train" / f"{stem}.png"
            )
    assert len(build_dataset(split_inside, split="train", preset=TINY)) == 2
    with pytest.raises(DataError, match=r"has no split 'val' \(splits found: train, x\)"):
        build_dataset(split_inside, split="val", preset=TINY)


def test_a_truly_flat_folder_serves_any_split(tmp_path):
    root = _flat_root(tmp_path / "flat")
    (root / "README.txt").write_text("four pairs, drawn at random\n")  # not a list file
    for split in ("train", "val", "test"):
        assert len(build_dataset(root, split=split, preset=TINY)) == 4
    report = check_dataset(root, preset=TINY)
    assert not report.problems and report.pairs == {"train": 4}


def test_list_files_with_a_bom_or_another_encoding(list_root):
    listed = list_root / "train.txt"
    text = listed.read_text(encoding="utf-8")
    listed.write_bytes(b"\xef\xbb\xbf" + text.encode())  # Windows Notepad's UTF-8
    assert len(build_dataset(list_root, preset=TINY).samples) == 3
    listed.write_bytes("caf\xe9.png caf\xe9.png\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"train.txt: not UTF-8 text .*save the list file as UTF-8"):
        build_dataset(list_root, preset=TINY)


def test_files_sharing_a_stem_are_a_problem_not_a_guess(tmp_path):
    rng = np.random.default_rng(5)
    for stem in ("a", "b"):
        image, label = random_pair(rng)
        save(tmp_path / "images" / f"{stem}.png", image)
        save(tmp_path / "labels" / f"{stem}.png", label)
    save(tmp_path / "images" / "a.jpg", random_pair(rng)[0])  # which image is a.png's?
    report = check_dataset(tmp_path, preset=TINY)
    assert any("a.jpg, a.png share the name 'a'" in p for p in report.problems), report.problems
    with pytest.raises(DataError, match="share the name 'a'"):
        build_dataset(tmp_path, preset=TINY)


def test_messages_for_swapped_columns_gif_labels_and_spaces(list_root, tmp_path):
    """Swapped list columns name the colour "label"; .gif labels are found; a path with a
    space says why it has too many fields."""

    lines = (list_root / "train.txt").read_text().splitlines()
    (list_root / "train.txt").write_text("".join(f"{b} {a}\n" for a, b in map(str.split, lines)))
    with pytest.raises(DataError, match=r"train/0\.png: this label is a colour image"):
        build_dataset(list_root, preset=TINY).load_pair(0)
    # a colour-coded label beside a greyscale picture still gets --label-format color
    grey = np.random.default_rng(1).integers(0, 256, (16, 24), np.uint8)
    save(list_root / "grey.png", grey)
    save(list_root / "colour.png", np.asarray(TINY.palette, np.uint8)[grey % 4])
    (list_root / "train.txt").write_text("grey.png colour.png\n")
    with pytest.raises(DataError, match="--label-format color"):
        build_dataset(list_root, preset=TINY).load_pair(0)

    rng = np.random.default_rng(2)
    image, label = random_pair(rng)
    save(tmp_path / "gif" / "images" / "a.png", image)
    save(tmp_path / "gif" / "labels" / "a.gif", label)
    gif = build_dataset(tmp_path / "gif", preset=TINY)
    assert len(gif) == 1 and np.array_equal(gif.load_pair(0)[1], label)

    spaced = tmp_path / "spaced"
    save(spaced / "images" / "a b.png", image)
    save(spaced / "labels" / "a b.png", label)
    (spaced / "train.txt").write_text("images/a b.png labels/a b.png\n")
    with pytest.raises(
        DataError, match=r"train\.txt:1: expected .* 4 fields.*cannot hold a space; rename"
    ):
        build_dataset(spaced, preset=TINY)
