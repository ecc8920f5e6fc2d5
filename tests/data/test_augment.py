"""`dualseg augment`: N pairs + list file, deterministic, resumes, refuses mixed settings."""

from __future__ import annotations

import json

import numpy as np
import pytest
from datahelpers import TINY

from dualseg.commands.augment import main
from dualseg.data import build_dataset, read_label
from dualseg.data.augment import augment_dataset
from dualseg.errors import DataError


def _files(dst):
    return {p.relative_to(dst): p for p in sorted(dst.glob("*s/*.png"))}


@pytest.fixture
def src(list_root):
    (list_root / "meta.json").write_text(json.dumps(TINY.to_dict()))
    return list_root


def test_writes_pairs_list_and_meta(src, tmp_path, capsys):
    dst = tmp_path / "aug"
    assert main([str(src), str(dst), "--count", "5", "--crop-size", "12", "16"]) == 0
    assert "5 pairs written" in capsys.readouterr().out
    assert len(_files(dst)) == 10
    lines = (dst / "train.txt").read_text().splitlines()
    assert lines[0] == "images/000000.png labels/000000.png" and len(lines) == 5
    ds = build_dataset(dst)  # reads meta.json: same classes, labels already hold 255
    assert len(ds) == 5 and ds.meta.class_names == TINY.class_names
    image, label = ds.load_pair(4)
    assert image.shape == (12, 16, 3) and set(np.unique(label)) <= {0, 1, 2, 3, 255}


def test_resume_skips_valid_outputs_and_redoes_broken_ones(src, tmp_path):
    dst = tmp_path / "aug"
    assert augment_dataset(src, dst, count=6, progress=False) == (6, 0)
    files = _files(dst)
    before = {k: (p.read_bytes(), p.stat().st_mtime_ns) for k, p in files.items()}
    files[next(iter(files))].unlink()  # images/000000.png gone
    label = dst / "labels" / "000003.png"
    label.write_bytes(label.read_bytes()[:40])  # truncated
    assert augment_dataset(src, dst, count=6, progress=False) == (2, 4)
    after = {k: (p.read_bytes(), p.stat().st_mtime_ns) for k, p in _files(dst).items()}
    assert {k: v[0] for k, v in after.items()} == {k: v[0] for k, v in before.items()}
    redone = {k for k in after if after[k][1] != before[k][1]}
    assert {str(k) for k in redone} <= {
        "images/000000.png", "labels/000000.png", "images/000003.png", "labels/000003.png"
    }  # fmt: skip
    assert read_label(label, TINY).shape == (16, 24)


def test_a_resume_removes_the_temporary_files_of_a_killed_run(src, tmp_path):
    # a worker killed mid-write (Ctrl-C terminates the pool) left .<name>.*.tmp behind for good
    dst = tmp_path / "aug"
    assert augment_dataset(src, dst, count=2, progress=False) == (2, 0)
    left = [dst / "images" / ".000002.png.g7f03fz8.tmp", dst / "labels" / ".000002.png.x.tmp"]
    for tmp in left:
        tmp.write_bytes(b"half")
    assert augment_dataset(src, dst, count=3, progress=False) == (1, 2)
    assert not any(p.exists() for p in left)
    assert sorted(p.name for p in (dst / "images").iterdir()) == [f"00000{i}.png" for i in range(3)]


def test_workers_ignore_ctrl_c_so_the_parent_says_it_once(src, tmp_path, monkeypatch):
    import signal

    import torch

    from dualseg.data import augment as A

    before = signal.getsignal(signal.SIGINT)
    seen = {}
    monkeypatch.setattr(signal, "signal", lambda sig, handler: seen.setdefault(sig, handler))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this process keeps its own
    A._init_worker()  # as the pool calls it in each worker
    assert seen == {signal.SIGINT: signal.SIG_IGN} and signal.getsignal(signal.SIGINT) == before


def test_a_truncated_jpeg_is_written_again(src, tmp_path):
    from dualseg.data import read_image

    dst = tmp_path / "aug"
    assert augment_dataset(src, dst, count=2, image_format="jpg", progress=False) == (2, 0)
    image = dst / "images" / "000001.jpg"
    image.write_bytes(image.read_bytes()[: image.stat().st_size * 2 // 3])  # cut short
    assert augment_dataset(src, dst, count=2, image_format="jpg", progress=False) == (1, 1)
    assert read_image(image).shape[:2] == (16, 24)


def test_workers_give_the_same_files(src, tmp_path):
    augment_dataset(src, tmp_path / "one", count=4, progress=False)
    augment_dataset(src, tmp_path / "two", count=4, workers=2, progress=False)
    one, two = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert one.keys() == two.keys()
    assert all(one[k].read_bytes() == two[k].read_bytes() for k in one)


def test_other_settings_in_the_same_folder_are_refused(src, tmp_path):
    dst = tmp_path / "aug"
    augment_dataset(src, dst, count=2, progress=False)
    with pytest.raises(DataError, match="seed") as err:
        augment_dataset(src, dst, count=2, seed=1, progress=False)
    assert str(dst) in str(err.value)


def test_a_resume_with_another_label_mapping_is_refused(src, tmp_path):
    """The labels' coding is part of the settings: pairs mapped two ways never share a folder."""
    dst = tmp_path / "aug"
    augment_dataset(src, dst, count=2, progress=False)
    augment_dataset(src, dst, count=3, progress=False)  # the same settings: resumes
    meta = {**TINY.to_dict(), "label_map": {"3": 0}}
    (src / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="meta"):
        augment_dataset(src, dst, count=4, progress=False)


def test_a_resume_on_a_source_whose_pairs_changed_is_refused(src, tmp_path):
    """Output i reads source pair i % N: a list that gained or reordered pairs would put two
    orderings in one folder (pairs 0-3 of the old one, 4-7 of the new)."""
    dst = tmp_path / "aug"
    augment_dataset(src, dst, count=2, progress=False)
    lines = (src / "train.txt").read_text().splitlines(keepends=True)
    (src / "train.txt").write_text("".join(lines[::-1]))  # the same pairs, reordered
    with pytest.raises(DataError, match="source_digest"):
        augment_dataset(src, dst, count=4, progress=False)
    (src / "train.txt").write_text("".join(lines[:-1]))  # one pair fewer
    with pytest.raises(DataError, match="source_digest, source_pairs"):
        augment_dataset(src, dst, count=4, progress=False)
    (src / "train.txt").write_text("".join(lines))  # as it was: resumes
    assert augment_dataset(src, dst, count=4, progress=False) == (2, 2)


def test_a_resume_on_a_source_file_edited_in_place_is_refused(src, tmp_path):
    """The same paths in the same order, one image rewritten: the resume mixed pairs of the
    old and the new image without a word."""
    import os

    dst = tmp_path / "aug"
    augment_dataset(src, dst, count=2, progress=False)
    image = build_dataset(src).samples[0][0]
    st = image.stat()
    image.write_bytes(image.read_bytes())  # rewritten: same bytes here, another time
    os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(DataError, match=r"source files that have changed since.*empty DST"):
        augment_dataset(src, dst, count=4, progress=False)
    os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns))  # as it was: resumes
    assert augment_dataset(src, dst, count=4, progress=False) == (2, 2)


def test_a_settings_file_without_the_source_record_is_refused(src, tmp_path):
    dst = tmp_path / "aug"
    augment_dataset(src, dst, count=2, progress=False)
    settings = json.loads((dst / "augment.json").read_text())
    old = {k: v for k, v in settings.items() if not k.startswith("source_")}
    (dst / "augment.json").write_text(json.dumps(old))  # which source pairs: unknown
    with pytest.raises(DataError, match="source_digest, source_pairs, source_stamp differ"):
        augment_dataset(src, dst, count=3, progress=False)


def test_a_stale_settings_file_without_pairs_does_not_block_a_run(src, tmp_path):
    dst = tmp_path / "aug"
    dst.mkdir()
    (dst / "augment.json").write_text(json.dumps({"scale_range": [2.0, 0.5]}))  # a failed run's
    assert augment_dataset(src, dst, count=2, progress=False) == (2, 0)
    assert json.loads((dst / "augment.json").read_text())["scale_range"] == [0.5, 2.0]


def test_a_settings_file_not_in_utf8_is_one_line(src, tmp_path):
    dst = tmp_path / "aug"
    augment_dataset(src, dst, count=2, progress=False)
    (dst / "augment.json").write_bytes(b'{"seed": "\xff"}')
    with pytest.raises(DataError, match=r"augment\.json: not UTF-8 JSON") as err:
        augment_dataset(src, dst, count=2, progress=False)
    assert "\n" not in str(err.value)


def _snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_source_or_another_dataset_as_destination_is_refused(src, tmp_path):
    before = _snapshot(src)
    for source in (src, src / "train.txt"):  # a folder or its list file, DST the same folder
        with pytest.raises(DataError, match="is the source dataset") as e:
            main([str(source), str(src), "--count", "2"])
        assert str(src) in str(e.value) and "choose a new folder" in str(e.value)
    with pytest.raises(DataError, match="is the source dataset"):
        augment_dataset(src, src / "train" / "..", count=2, progress=False)
    with pytest.raises(DataError, match="is inside the source dataset"):  # a new split of SRC
        augment_dataset(src, src / "aug", count=2, progress=False)
    other = tmp_path / "other"  # a dataset dualseg augment did not write
    other.mkdir()
    (other / "train.txt").write_bytes((src / "train.txt").read_bytes())
    (other / "meta.json").write_bytes((src / "meta.json").read_bytes())
    with pytest.raises(DataError, match=r"holds a dataset that dualseg augment did not write") as e:
        augment_dataset(src, other, count=2, progress=False)
    assert str(other) in str(e.value) and "train.txt, meta.json" in str(e.value)
    # a list whose pairs live in DST/images, DST/labels: writing there would overwrite them
    lst = tmp_path / "lists" / "shared.txt"
    lst.parent.mkdir()
    lst.write_text("../pool/images/0.png ../pool/labels/0.png\n")
    for sub, name in (("images", "train"), ("labels", "trainannot")):
        (tmp_path / "pool" / sub).mkdir(parents=True)
        (tmp_path / "pool" / sub / "0.png").write_bytes((src / name / "0.png").read_bytes())
    with pytest.raises(DataError, match="would overwrite files of the source dataset"):
        augment_dataset(lst, tmp_path / "pool", count=1, preset=TINY, progress=False)
    assert _snapshot(src) == before and sorted(p.name for p in other.iterdir()) == [
        "meta.json", "train.txt"
    ]  # fmt: skip
