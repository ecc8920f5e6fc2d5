"""Issue 11: bad inputs through the CLI end in one line, the right exit code, nothing half-written.

Each test feeds one bad input to ``dualseg.cli.main`` in-process and asserts the exit status,
the single stderr line (its file, value and fix) and that nothing was written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dualseg.cli import main
from dualseg.engine.checkpoint import load_checkpoint
from dualseg.errors import ConfigError
from reliability_helpers import (
    BINARY,
    FOUR,
    binary_masks,
    class_maps,
    one_line,
    save,
    tree,
    write_checkpoint,
    write_dataset,
)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_synthetic.yaml"


def train_argv(root: Path, out: Path, *extra: str) -> list[str]:
    argv = ["train", "--config", str(TINY), "--data.root", str(root), "--data.preset", "null"]
    argv += ["--data.crop_size", "[32,32]", "--train.out_dir", str(out)]
    argv += ["--train.max_iters", "1", "--train.val_every", "0", "--train.progress", "false"]
    return [*argv, *extra]


@pytest.fixture(scope="module")
def four_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "four.pt", FOUR.class_names)


@pytest.fixture
def four_data(tmp_path: Path) -> Path:
    maps = class_maps(2, 4)
    return write_dataset(tmp_path / "four", {"train": maps, "val": maps}, meta=FOUR)


# ------------------------------------------------------------------ 0/255 binary masks
def test_data_check_flags_a_0_255_mask_and_the_label_map_fixes_it(tmp_path, capsys) -> None:
    root = write_dataset(tmp_path / "bin", {"train": binary_masks(2)}, meta=BINARY)
    assert main(["data", "check", str(root)]) == 1
    out = capsys.readouterr().out
    assert "looks like a 0/255 binary mask" in out and "--label-map 255:1" in out
    assert main(["data", "check", str(root), "--label-map", "255:1"]) == 0
    assert "no problems found" in capsys.readouterr().out

    # the same fix written into the dataset's meta.json
    meta = {**BINARY.to_dict(), "label_map": {"255": 1}}
    (root / "meta.json").write_text(json.dumps(meta))
    assert main(["data", "check", str(root)]) == 0
    capsys.readouterr()

    # ignore_index null: no value means ignore, so an unmapped 255 is an error naming the file
    (root / "meta.json").write_text(json.dumps({**BINARY.to_dict(), "ignore_index": None}))
    assert main(["data", "check", str(root)]) == 1
    out = capsys.readouterr().out
    assert "trainannot/0.png: label values [255]" in out and "ignore (none)" in out


def test_train_refuses_0_255_masks_naming_its_own_flag(tmp_path, capsys) -> None:
    root = write_dataset(
        tmp_path / "bin", {"train": binary_masks(2), "val": binary_masks(1)}, meta=BINARY
    )
    out = tmp_path / "run"
    assert main(train_argv(root, out)) == 1
    err = one_line(capsys)
    assert "labels contain 1 class(es) ('background'" in err
    assert "looks like a 0/255 binary mask" in err and "--data.label_map 255:1" in err
    assert "--label-map" not in err
    assert tree(out) == []  # refused before anything was written

    assert main(train_argv(root, out, "--data.label_map", "255:1")) == 0
    assert load_checkpoint(out / "last.pt")["class_names"] == ["background", "object"]


def test_train_refuses_labels_with_a_single_class(tmp_path, capsys) -> None:
    labels = [np.zeros((32, 32), np.uint8)] * 2
    root = write_dataset(tmp_path / "one", {"train": labels, "val": labels[:1]}, meta=FOUR)
    out = tmp_path / "run"
    assert main(train_argv(root, out)) == 1
    err = one_line(capsys)
    assert "the 'train' labels contain 1 class(es) ('a'; 0.0% of pixels are ignore)" in err
    assert "training cannot learn to separate classes" in err
    assert tree(out) == []


def test_a_class_absent_from_every_split_is_a_problem(tmp_path, capsys) -> None:
    maps = class_maps(2, 3)  # classes a, b, c; d never appears
    root = write_dataset(tmp_path / "ds", {"train": maps, "val": maps}, meta=FOUR)
    assert main(["data", "check", str(root)]) == 1
    out = capsys.readouterr().out
    assert "class(es) 3 'd' have no pixels in any split (train, val)" in out
    # train warns (a subset of a large class set may lack some) but trains
    run = tmp_path / "run"
    assert main(train_argv(root, run)) == 0
    assert "warning: " in capsys.readouterr().err and (run / "last.pt").is_file()


def test_validation_of_a_single_class_says_so() -> None:
    from dualseg.engine.preflight import scored_classes_note

    nan = float("nan")
    note = scored_classes_note({"iou": torch.tensor([1.0, nan])}, ("background", "object"))
    assert note == " (1 class scored: 'background'; the labels hold no other class)"
    assert scored_classes_note({"iou": [0.5, 0.7]}, ("a", "b")) == ""


# ------------------------------------------------------------------ classes differ
def test_eval_refuses_a_checkpoint_of_other_classes(four_ckpt, tmp_path, capsys) -> None:
    maps = class_maps(1, 2)
    root = write_dataset(tmp_path / "bin", {"val": maps}, meta={**BINARY.to_dict()})
    out = tmp_path / "eval"
    assert main(["eval", "-c", str(four_ckpt), "--data", str(root), "--out", str(out)]) == 1
    err = one_line(capsys)
    assert "['a', 'b', 'c', 'd']" in err and "['background', 'object']" in err
    assert tree(out) == []


def test_predict_and_refine_apply_with_data_refuse_other_classes(
    four_ckpt, tmp_path, capsys
) -> None:
    root = write_dataset(tmp_path / "bin", {"val": class_maps(1, 2)}, meta=BINARY)
    image = root / "val" / "0.png"
    out = tmp_path / "pred"
    argv = ["predict", str(image), "-c", str(four_ckpt), "--out", str(out), "--data", str(root)]
    assert main(argv) == 1
    err = one_line(capsys)
    assert "['a', 'b', 'c', 'd']" in err and "['background', 'object']" in err
    assert tree(out) == []
    # with the model's own dataset it runs
    four = write_dataset(tmp_path / "four", {"val": class_maps(1, 4)}, meta=FOUR)
    assert main([*argv[:-1], str(four)]) == 0
    assert (out / "labels" / "0.png").is_file()


def test_refine_fit_steps_0_is_refused(four_data, tmp_path, capsys) -> None:
    out = tmp_path / "refiner.pt"
    assert main(["refine", "fit", "--data", str(four_data), "--steps", "0", "--out", str(out)]) == 1
    assert "--steps must be >= 1" in one_line(capsys)
    assert not out.exists() and not out.with_suffix(".train.pt").exists()


def test_tensorboard_missing_is_said_at_the_start(four_data, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    out = tmp_path / "run"
    assert main(train_argv(four_data, out, "--train.tensorboard", "true")) == 0
    err = capsys.readouterr().err
    assert "warning: tensorboard is not installed" in err
    assert not list(out.glob("events.out.*"))


# ------------------------------------------------------------------ tracebacks
def test_worker_errors_read_as_the_same_line_as_without_workers(four_data, tmp_path, capsys):
    save(four_data / "valannot" / "1.png", np.full((32, 32), 7, np.uint8))  # out of range
    argv = ["eval", "-c", "CKPT", "--data", str(four_data), "--out", str(tmp_path / "e")]
    lines = []
    ckpt = write_checkpoint(tmp_path / "four.pt", FOUR.class_names)
    for workers in ("0", "1"):
        assert main([*[str(ckpt) if a == "CKPT" else a for a in argv], "--workers", workers]) == 1
        lines.append(one_line(capsys))
    assert lines[0] == lines[1]
    assert "valannot/1.png: label values [7]" in lines[0]


def test_train_scans_the_data_before_step_1(four_data, tmp_path, capsys) -> None:
    save(four_data / "trainannot" / "1.png", np.full((32, 32), 9, np.uint8))
    out = tmp_path / "run"
    assert main(train_argv(four_data, out)) == 1
    err = one_line(capsys)
    assert "trainannot/1.png: label values [9]" in err and "dualseg data check" in err
    assert tree(out) == []
    # the opt-out skips the scan: the error comes from the loader instead, still one line
    assert main(train_argv(four_data, out, "--data.check", "false", "--train.max_iters", "4")) == 1
    assert "trainannot/1.png" in one_line(capsys)


@pytest.mark.parametrize(
    "argv_of",
    [
        lambda d, c, o: ["export", "-c", c, "--out", f"{o}/model.onnx"],
        lambda d, c, o: ["predict", f"{d}/val/0.png", "-c", c, "--out", o],
        lambda d, c, o: ["eval", "-c", c, "--data", d, "--out", o],
        lambda d, c, o: ["augment", d, o, "--count", "1"],
        lambda d, c, o: ["data", "check", d, "--json", f"{o}/report.json"],
        lambda d, c, o: train_argv(Path(d), Path(o)),
    ],
    ids=["export", "predict", "eval", "augment", "data-check", "train"],
)
def test_unwritable_outputs_are_refused_up_front(argv_of, four_data, four_ckpt, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    out = blocker / "sub"  # below a file: nothing can be written there
    assert main(argv_of(str(four_data), str(four_ckpt), str(out))) == 1
    err = one_line(capsys)
    assert str(out) in err and "a_file is a file" in err


def test_predict_out_and_augment_dst_that_are_files(four_data, four_ckpt, tmp_path, capsys):
    target = tmp_path / "taken.png"
    target.write_bytes(b"keep me")
    assert (
        main(["predict", str(four_data / "val" / "0.png"), "-c", str(four_ckpt), "-o", str(target)])
        == 1
    )
    assert "is an existing file, not a folder" in one_line(capsys)
    assert main(["augment", str(four_data), str(target), "--count", "1"]) == 1
    assert "DST" in one_line(capsys)
    assert target.read_bytes() == b"keep me"


# ------------------------------------------------------------------ lost work
def test_train_into_an_existing_run_needs_resume_or_overwrite(four_data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_argv(four_data, out)) == 0
    before = (out / "last.pt").read_bytes()
    capsys.readouterr()
    assert main(train_argv(four_data, out)) == 1
    err = one_line(capsys)
    assert "already holds a run" in err and "--resume auto" in err and "--overwrite" in err
    assert (out / "last.pt").read_bytes() == before

    stale = out / ".last.pt.x1y2.tmp"  # what a kill during a checkpoint write leaves
    stale.write_bytes(b"partial")
    assert main(train_argv(four_data, out, "--resume", "auto", "--train.max_iters", "2")) == 0
    assert load_checkpoint(out / "last.pt")["iteration"] == 2 and not stale.exists()
    assert main(train_argv(four_data, out, "--overwrite")) == 0
    assert load_checkpoint(out / "last.pt")["iteration"] == 1


def test_a_run_that_stopped_before_its_first_checkpoint_is_not_sent_to_resume(
    four_data, tmp_path, capsys
):
    # a start-up failure leaves config.yaml: --resume auto has nothing to continue, so the
    # refusal must not suggest it (it did, and --resume auto then suggested --overwrite)
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("data: {}\n")
    assert main(train_argv(four_data, out)) == 1
    err = one_line(capsys)
    assert "stopped before its first checkpoint" in err and "--overwrite" in err
    assert "--resume" not in err
    assert main(train_argv(four_data, out, "--overwrite")) == 0
    assert load_checkpoint(out / "last.pt")["iteration"] == 1


def test_overwrite_keeps_the_old_run_until_the_new_one_passed_its_checks(
    four_data, tmp_path, capsys
):
    out = tmp_path / "run"
    assert main(train_argv(four_data, out)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"last.pt", "config.yaml", "metrics.jsonl"} <= set(before)
    capsys.readouterr()
    # an unknown architecture: a config check, with the names to choose from
    assert main(train_argv(four_data, out, "--overwrite", "--model.arch", "foo")) == 1
    err = one_line(capsys)
    assert "model.arch" in err and "'foo'" in err and "dualseg_mobilenet_v2" in err
    # a batch size the two training images cannot fill: found while building the loaders
    assert main(train_argv(four_data, out, "--overwrite", "--data.batch_size", "8")) == 1
    assert "data.batch_size=8" in one_line(capsys)
    # bad label values: found by the data scan
    save(four_data / "trainannot" / "1.png", np.full((32, 32), 9, np.uint8))
    assert main(train_argv(four_data, out, "--overwrite")) == 1
    assert "label values [9]" in one_line(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_overwrite_that_fails_in_training_leaves_a_folder_refused_without_overwrite(
    four_data, tmp_path, capsys
):
    """--overwrite replaces the old run at the new run's first write, once every check passed;
    a new run that then fails in training leaves its attempt, never a mix of the two runs."""
    out = tmp_path / "run"
    assert main(train_argv(four_data, out)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    # bad label values the (switched off) data scan would have found: met in the first batch
    save(four_data / "trainannot" / "1.png", np.full((32, 32), 9, np.uint8))
    save(four_data / "trainannot" / "0.png", np.full((32, 32), 9, np.uint8))
    argv = train_argv(four_data, out, "--overwrite", "--data.check", "false")
    assert main(argv) == 1
    assert "label values [9]" in one_line(capsys)
    assert not (out / "last.pt").exists() and (out / "config.yaml").exists()
    assert main(train_argv(four_data, out)) == 1
    assert "stopped before its first checkpoint" in one_line(capsys)
    save(four_data / "trainannot" / "1.png", np.ones((32, 32), np.uint8))
    save(four_data / "trainannot" / "0.png", np.ones((32, 32), np.uint8))
    assert main(argv) == 0
    assert (out / "last.pt").read_bytes() != before["last.pt"]


def test_checkpoints_on_a_time_interval_without_validation(four_data, tmp_path, monkeypatch):
    from dualseg.data import SegmentationDataset
    from dualseg.engine.config import load_config
    from dualseg.engine.train import fit
    from dualseg.errors import DataError

    real, seen = SegmentationDataset.__getitem__, {"n": 0}

    def getitem(self, index):
        seen["n"] += 1
        if seen["n"] == 5:  # the 3rd batch of 2: a crash after 2 steps
            raise DataError("crash at the 3rd batch")
        return real(self, index)

    monkeypatch.setattr(SegmentationDataset, "__getitem__", getitem)
    data = {"root": str(four_data), "preset": None, "crop_size": [32, 32], "val_split": None}
    train = {"out_dir": str(tmp_path / "run"), "max_iters": 10, "val_every": 0}
    cfg = load_config(TINY, data=data, train={**train, "ckpt_minutes": 0.0})
    with pytest.raises(DataError, match="3rd batch"):
        fit(cfg)
    assert load_checkpoint(tmp_path / "run" / "last.pt")["iteration"] == 2


def test_eval_refuses_an_unwritable_folder_before_evaluating(four_ckpt, four_data, capsys):
    # the default output is beside the checkpoint; here a file blocks it
    blocked = four_ckpt.parent / "eval_val_four"
    blocked.write_text("a file where the folder goes")
    try:
        assert main(["eval", "-c", str(four_ckpt), "--data", str(four_data)]) == 1
        captured = capsys.readouterr()
        assert "eval_val_four is an existing file" in captured.err and "mIoU" not in captured.out
    finally:
        blocked.unlink()


def test_eval_prints_the_scores_before_a_failing_write(
    four_ckpt, four_data, tmp_path, capsys, monkeypatch
):
    import dualseg.commands.eval as eval_command

    def refuse(path, obj):  # the folder turned read-only while evaluating
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(eval_command, "atomic_write_json", refuse)
    out = tmp_path / "e"
    assert main(["eval", "-c", str(four_ckpt), "--data", str(four_data), "-o", str(out)]) == 1
    captured = capsys.readouterr()
    assert "mIoU" in captured.out  # the finished evaluation is on screen
    # stderr: the finished evaluation's plain progress line (stderr is no terminal here: the
    # progress rule of dualseg.console) and its warnings about the scores, then the one error
    *progress, err = captured.err.strip().splitlines()
    assert all(line.startswith(("eval: ", "dualseg eval: warning: ")) for line in progress)
    assert err.startswith("dualseg eval: error: ") and "metrics.json: Permission denied" in err
    assert tree(out) == []


def test_ignore_index_null_makes_an_unmapped_255_an_error(tmp_path, capsys) -> None:
    root = write_dataset(tmp_path / "bin", {"train": binary_masks(2)}, meta=BINARY)
    run = tmp_path / "run"
    argv = train_argv(root, run, "--data.val_split", "null", "--data.ignore_index", "null")
    assert main(argv) == 1
    err = one_line(capsys)
    assert "label values [255]" in err and "ignore (none)" in err
    assert "--data.label_map RAW:CLASS" in err and tree(run) == []
    assert main([*argv, "--data.label_map", "255:1"]) == 0


# ------------------------------------------------------------------ messages
def test_colour_label_hint_names_the_train_flag(tmp_path, capsys) -> None:
    colour = np.zeros((32, 32, 3), np.uint8)
    colour[:, :16] = FOUR.palette[0]
    colour[:, 16:] = FOUR.palette[1]
    root = write_dataset(tmp_path / "c", {"train": [colour] * 2}, meta=FOUR)
    out = tmp_path / "run"
    assert main(train_argv(root, out, "--data.val_split", "null")) == 1
    err = one_line(capsys)
    assert "--data.label_format color" in err and "--label-format" not in err
    assert main(["data", "check", str(root)]) == 1
    assert "--label-format color" in capsys.readouterr().out


def test_eval_on_a_missing_split_lists_the_splits(four_ckpt, four_data, tmp_path, capsys):
    out = tmp_path / "e"
    assert (
        main(
            [
                "eval",
                "-c",
                str(four_ckpt),
                "--data",
                str(four_data),
                "--split",
                "test",
                "-o",
                str(out),
            ]
        )
        == 1
    )
    err = one_line(capsys)
    assert "has no split 'test' (splits found: train, val)" in err


def test_unknown_config_key_is_one_line_with_the_closest_key(tmp_path, capsys) -> None:
    assert main(["train", "--config", str(TINY), "--train.max_itres", "3"]) == 1
    assert one_line(capsys).endswith(
        "unknown flag --train.max_itres; did you mean --train.max_iters?"
    )
    # a value of the wrong type: the key, the value and what it takes, not jsonargparse's text
    for flag, value, said in (
        (
            "--train.patience",
            "2.7",
            "train.patience: '2.7' is not valid; it takes an integer or null",
        ),
        ("--optim.class_weights", "median_freq", "takes a list, e.g. [1, 2] or median_frequency"),
        ("--train.amp", "maybe", "it takes auto | none | bf16 | fp16"),
        # a list with one bad item names the list given; a wrong length says how many
        ("--optim.class_weights", "[1, x]", "class_weights: \"[1, 'x']\" is not valid"),
        ("--data.crop_size", "[1, 2, 3]", "'[1, 2, 3]' is not valid; it takes a list of 2"),
    ):
        assert main(["train", "--config", str(TINY), flag, value]) == 1
        line = one_line(capsys)
        assert said in line and "Union" not in line, line
    assert main(["train", "--config", str(TINY), "--lr", "1"]) == 1
    assert "unknown flag --lr;" in one_line(capsys)
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  batch_sise: 2\n")
    assert main(["train", "--config", str(bad)]) == 1
    assert "unknown config key data.batch_sise; did you mean data.batch_size?" in one_line(capsys)


def test_load_config_refuses_a_key_written_twice(tmp_path) -> None:
    from dualseg.engine.config import load_config

    twice = tmp_path / "twice.yaml"
    twice.write_text(TINY.read_text() + "\noptim:\n  lr: 0.5\n")  # a second optim section
    with pytest.raises(ConfigError, match=r"twice.yaml is not valid YAML .*'optim' is written"):
        load_config(twice)
    once = tmp_path / "once.yaml"
    once.write_text("optim:\n  lr: 0.5\n  momentum: 0.8\n")
    assert load_config(once).optim.lr == 0.5
    # jsonargparse takes the YAML itself as --config too (train --resume passes it so)
    from dualseg.engine.config import parse_command

    with pytest.raises(ConfigError, match=r"the --config text .* 'lr' is written twice on line 1"):
        parse_command(["--config", "{optim: {lr: 0.1, lr: 0.2}}"])
    assert parse_command(["--config", once.read_text()])[0].optim.momentum == 0.8
