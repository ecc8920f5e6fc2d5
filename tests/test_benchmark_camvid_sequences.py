"""benchmarks/camvid.py's sequences: a frame's sequence read from its name, and a held-out or
unseen sequence kept out of training and of every choice made on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmark_helpers import load_benchmark

protocols = load_benchmark("camvid_protocols")


def test_a_frame_s_sequence_is_its_file_name_prefix(camvid) -> None:
    assert protocols.sequence_of("train/0001TP_006690.png trainannot/0001TP_006690.png") == "0001TP"
    assert protocols.sequence_of("/abs/val/0016E5_07959.png") == "0016E5"
    lines = ["a/SEQA_1.png b/SEQA_1.png", "a/SEQB_1.png b/SEQB_1.png", "a/SEQA_2.png b/SEQA_2.png"]
    train, held = protocols.split_by_sequence(lines, "SEQA")
    assert held == [lines[0], lines[2]] and train == [lines[1]]  # order kept, nothing shared


@pytest.mark.parametrize(
    ("holdout", "said"), [("SEQC", "SEQC is not among"), ("SEQA", "SEQA is the only one of")]
)
def test_a_holdout_sequence_that_leaves_no_split_is_one_error(camvid, holdout, said) -> None:
    from dualseg.errors import ConfigError

    lines = ["a/SEQA_1.png b/SEQA_1.png"] + (
        ["a/SEQB_1.png b/SEQB_1.png"] if holdout != "SEQA" else []
    )
    with pytest.raises(ConfigError, match=rf"--holdout-sequence {said} the training sequences"):
        protocols.split_by_sequence(lines, holdout)


def _three_sequences(tmp_path: Path, frames: int) -> Path:
    """A CamVid-like folder of list files: ``frames`` frames of each of its three training
    sequences, one val frame of 0016E5 (no images: the carve reads the lists alone)."""
    data = tmp_path / "camvid"
    data.mkdir()
    lines = [f"train/{s}_{i:04d}.png trainannot/{s}_{i:04d}.png"
             for s in ("0001TP", "0006R0", "0016E5") for i in range(frames)]  # fmt: skip
    (data / "train.txt").write_text("\n".join(lines) + "\n")
    (data / "val.txt").write_text("val/0016E5_9999.png valannot/0016E5_9999.png\n")
    return data


def test_leave_one_sequence_out_trains_on_the_others_and_chooses_on_it(
    camvid, tmp_path: Path
) -> None:
    """Dev and the cross-scene split are the held-out sequence: no frame of it is trained on,
    and the plateau runs read the derived lists in --out (the images stay where they are)."""
    data = _three_sequences(tmp_path, 4)
    out = tmp_path / "out"
    root = camvid.carve_dev_split(data, out, 0.125, "0001TP")

    def read(name: str) -> list[str]:
        return (root / f"{name}.txt").read_text().splitlines()

    assert {protocols.sequence_of(ln) for ln in read("dev")} == {"0001TP"} and len(read("dev")) == 4
    assert read("cross_scene_0001TP") == read("dev")
    assert {protocols.sequence_of(ln) for ln in read("train_fit")} == {"0006R0", "0016E5"}
    assert len(read("train_fit")) == 8 and all(
        Path(ln.split()[0]).is_absolute() for ln in read("dev")
    )
    assert sorted(p.name for p in root.iterdir()) == [
        "cross_scene_0001TP.txt", "dev.txt", "train_fit.txt", "val.txt"]  # fmt: skip
    args = ["--data", str(data), "--out", str(out), "--protocol", "plateau"]
    cfg = camvid.base_config(
        camvid.parse_args([*args, "--holdout-sequence", "0001TP"]), "peer", out
    )
    assert (cfg.data.root, cfg.data.train_split, cfg.data.val_split) == (
        str(root), "train_fit", "dev")  # fmt: skip
    # another carve into a folder trained on this one is refused, naming both flags
    (out / "refiner_all.pt").write_text("")
    from dualseg.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--dev-fraction 0\.125 of .*--holdout-sequence"):
        camvid.carve_dev_split(data, out, 0.125)
    with pytest.raises(ConfigError, match=r"--holdout-sequence 0006R0 of"):
        camvid.carve_dev_split(data, out, 0.125, "0006R0")


def test_an_unseen_sequence_is_left_out_of_training_and_of_every_choice(
    camvid, tmp_path: Path
) -> None:
    """Choose on one new scene, score on another: the unseen sequence is in neither train_fit
    nor dev, and is its own list, evaluated beside the cross-scene one."""
    data = _three_sequences(tmp_path, 3)
    out = tmp_path / "out"
    root = camvid.carve_dev_split(data, out, 0.125, "0001TP", "0006R0")

    def seqs(name: str) -> set[str]:
        return {protocols.sequence_of(ln) for ln in (root / f"{name}.txt").read_text().split("\n")
                if ln}  # fmt: skip

    assert seqs("train_fit") == {"0016E5"} and seqs("dev") == {"0001TP"}
    assert seqs("unseen_0006R0") == {"0006R0"}
    assert len((root / "unseen_0006R0.txt").read_text().splitlines()) == 3
    from dualseg.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--unseen-sequence 0099XX is not among"):
        camvid.carve_dev_split(data, tmp_path / "other", 0.125, "0001TP", "0099XX")
    (out / "refiner_all.pt").write_text("")  # trained on this carve: another is refused
    with pytest.raises(ConfigError, match=r"--holdout-sequence 0001TP of"):
        camvid.carve_dev_split(data, out, 0.125, "0001TP")
    base = ["--data", str(data), "--out", str(tmp_path / "o"), "--protocol", "plateau"]
    for flags in (["--unseen-sequence", "0006R0"],
                  ["--holdout-sequence", "0006R0", "--unseen-sequence", "0006R0"]):  # fmt: skip
        with pytest.raises(ConfigError, match="add --holdout-sequence with another sequence"):
            camvid.check_args(camvid.parse_args([*base, *flags]))
