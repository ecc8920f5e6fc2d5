"""The demo's synthetic street scenes: deterministic, every class, learnable but not by colour."""

from __future__ import annotations

import numpy as np

from dualseg.data import build_dataset, get_preset, make_synthetic_dataset
from dualseg.data.synthetic import draw_scene


def test_deterministic_files_and_reuse(tmp_path):
    a = make_synthetic_dataset(tmp_path / "a", n_train=4, n_val=2, size=(48, 64), seed=5)
    b = make_synthetic_dataset(tmp_path / "b", n_train=4, n_val=2, size=(48, 64), seed=5)
    c = make_synthetic_dataset(tmp_path / "c", n_train=4, n_val=2, size=(48, 64), seed=6)
    files = sorted(p.relative_to(a) for p in a.rglob("*.png"))
    assert len(files) == 12
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert any((a / f).read_bytes() != (c / f).read_bytes() for f in files)
    mtime = (a / files[0]).stat().st_mtime_ns
    make_synthetic_dataset(a, n_train=4, n_val=2, size=(48, 64), seed=5)  # complete: reused
    assert (a / files[0]).stat().st_mtime_ns == mtime
    train, val = build_dataset(a), build_dataset(a, split="val")
    assert train.meta == get_preset("synthetic") and (len(train), len(val)) == (4, 2)
    image, label = train[0]
    assert image.shape == (3, 48, 64) and int(label.max()) < 8


def test_a_stamp_not_in_utf8_is_regenerated(tmp_path):
    a = make_synthetic_dataset(tmp_path / "a", n_train=1, n_val=1, size=(24, 32))
    (a / "synthetic.json").write_bytes(b'{"seed": "\xff"}')  # a damaged stamp: not UTF-8
    assert make_synthetic_dataset(a, n_train=1, n_val=1, size=(24, 32)) == a
    assert len(build_dataset(a)) == 1 and b"\xff" not in (a / "synthetic.json").read_bytes()


def test_someone_elses_folder_is_refused_and_a_half_written_one_is_written_again(tmp_path):
    import json

    import pytest

    from dualseg.errors import DataError

    user = tmp_path / "user"
    (user / "images").mkdir(parents=True)
    (user / "train.txt").write_text("images/train_00000.png labels/train_00000.png\n")
    (user / "meta.json").write_text('{"class_names": ["a", "b"]}')
    with pytest.raises(DataError, match=r"did not write \(no synthetic\.json\)"):
        make_synthetic_dataset(user, n_train=1, n_val=1, size=(24, 32))
    assert (user / "meta.json").read_text() == '{"class_names": ["a", "b"]}'  # untouched
    assert sorted(p.name for p in user.iterdir()) == ["images", "meta.json", "train.txt"]
    # an interrupted call leaves its incomplete stamp: the folder is written anew, not reused
    a = make_synthetic_dataset(tmp_path / "a", n_train=1, n_val=1, size=(24, 32))
    stamp = json.loads((a / "synthetic.json").read_text())
    (a / "synthetic.json").write_text(json.dumps({**stamp, "complete": False}))
    (a / "val.txt").unlink()
    assert make_synthetic_dataset(a, n_train=1, n_val=1, size=(24, 32)) == a
    assert len(build_dataset(a, split="val")) == 1
    assert json.loads((a / "synthetic.json").read_text()) == stamp


def test_every_class_appears_poles_are_thin_colour_is_not_enough():
    meta = get_preset("synthetic")
    scenes = [draw_scene(np.random.default_rng([0, 0, i]), (96, 128)) for i in range(24)]
    labels = np.stack([lb for _, lb in scenes])
    counts = np.bincount(labels.ravel(), minlength=meta.num_classes)
    assert (counts > 0).all() and len(counts) == meta.num_classes
    pole = meta.class_names.index("pole")
    widths = [(lb == pole).sum(1).max() for _, lb in scenes if (lb == pole).any()]
    assert min(widths) <= 3  # 1-3 px wide structures: boundaries matter
    # the best colour-only classifier (a lookup table on quantized colours) stays far from 100%
    x = np.concatenate([im.reshape(-1, 3) for im, _ in scenes]).astype(int) // 16
    key, y = x[:, 0] * 256 + x[:, 1] * 16 + x[:, 2], labels.ravel()
    half = len(y) // 2
    table = np.zeros((4096, meta.num_classes))
    np.add.at(table, (key[:half], y[:half]), 1)
    accuracy = (table[key[half:]].argmax(1) == y[half:]).mean()
    assert 0.3 < accuracy < 0.85
