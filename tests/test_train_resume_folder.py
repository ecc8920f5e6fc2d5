"""``dualseg train --resume``: a run folder is continued only by its own run, never taken over.

Tiny CPU runs through ``dualseg.cli.main`` in-process: a refusal is one stderr line and leaves
every file of the folder's run byte for byte as it was.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from dualseg.cli import main
from dualseg.engine.checkpoint import load_checkpoint
from reliability_helpers import FOUR, class_maps, one_line, write_checkpoint, write_dataset

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_synthetic.yaml"


def run_argv(out: Path, *extra: str, config: tuple[str, ...] = ()) -> list[str]:
    """``dualseg train`` of one iteration into ``out``; ``config`` first (flags override it)."""
    argv = ["train", *config, "--train.out_dir", str(out), "--train.max_iters", "1"]
    return [*argv, "--train.val_every", "0", "--train.progress", "false", *extra]


def new_run_argv(root: Path, out: Path, *extra: str) -> list[str]:
    config = ("--config", str(TINY), "--data.root", str(root), "--data.preset", "null")
    return run_argv(out, "--data.crop_size", "[32,32]", *extra, config=config)


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def data(tmp_path: Path) -> Path:
    maps = class_maps(2, 4)
    return write_dataset(tmp_path / "four", {"train": maps, "val": maps}, meta=FOUR)


def test_resume_of_another_runs_checkpoint_never_takes_over_a_run(data, tmp_path, capsys):
    run_a, run_b = tmp_path / "runA", tmp_path / "runB"
    assert main(new_run_argv(data, run_a)) == 0
    assert main(new_run_argv(data, run_b, "--optim.lr", "0.02")) == 0
    before = files(run_b)
    assert {"last.pt", "best.pt", "config.yaml", "metrics.jsonl"} <= set(before)
    capsys.readouterr()

    resume_a = ["--resume", str(run_a / "last.pt"), "--train.max_iters", "2"]
    assert main(new_run_argv(data, run_b, *resume_a)) == 1
    err = one_line(capsys)
    assert str(run_b) in err and str(run_a / "last.pt") in err
    assert "--train.out_dir" in err and "--overwrite" in err
    assert files(run_b) == before

    # its own checkpoints continue it, however the path is spelled
    own = run_b / ".." / "runB" / "best.pt"
    assert main(new_run_argv(data, run_b, "--resume", str(own), "--optim.lr", "0.02")) == 0
    assert load_checkpoint(run_b / "last.pt")["iteration"] == 1
    before = files(run_b)

    # --overwrite: runB's run goes, the training continues runA's at its iteration 1
    assert main(new_run_argv(data, run_b, *resume_a, "--overwrite")) == 0
    state = load_checkpoint(run_b / "last.pt")
    assert state["iteration"] == 2 and state["config"]["optim"]["lr"] == 0.01
    # runB's old best.pt is gone: a best.pt there now is the new run's (when it improved)
    best = run_b / "best.pt"
    assert not best.exists() or load_checkpoint(best)["iteration"] == 2
    assert not (run_b / "metrics.jsonl").read_bytes().startswith(before["metrics.jsonl"])
    assert yaml.safe_load((run_b / "config.yaml").read_text())["optim"]["lr"] == 0.01
    assert load_checkpoint(run_a / "last.pt")["iteration"] == 1


def test_resume_from_an_older_best_pt_of_the_folder_needs_overwrite(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(new_run_argv(data, out, "--train.val_every", "1")) == 0  # best.pt at 1
    longer = ("--resume", "auto", "--train.max_iters", "3", "--train.val_every", "0")
    assert main(new_run_argv(data, out, *longer)) == 0  # last.pt at 3, no validation since
    assert load_checkpoint(out / "best.pt")["iteration"] == 1
    before = files(out)
    capsys.readouterr()
    rewind = ("--resume", str(out / "best.pt"), "--train.max_iters", "3")
    assert main(new_run_argv(data, out, *rewind)) == 1
    err = one_line(capsys)
    assert "would rewind" in err and "iteration 3" in err and "--overwrite" in err
    assert files(out) == before
    assert main(new_run_argv(data, out, *rewind, "--overwrite")) == 0  # asked: it goes back
    assert load_checkpoint(out / "last.pt")["iteration"] == 3
    # a broken last.pt: best.pt is the way back, with nothing to rewind over
    (out / "last.pt").write_bytes((out / "last.pt").read_bytes()[:1000])
    assert main(new_run_argv(data, out, *rewind)) == 0
    assert load_checkpoint(out / "last.pt")["iteration"] == 3


def test_resume_auto_in_a_run_without_last_pt_is_refused(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(new_run_argv(data, out)) == 0
    (out / "last.pt").unlink()  # e.g. deleted to save space: best.pt and the logs remain
    before = files(out)
    capsys.readouterr()
    assert main(new_run_argv(data, out, "--resume", "auto")) == 1
    err = one_line(capsys)
    assert "without last.pt" in err and f"--resume {out / 'best.pt'}" in err
    assert "--overwrite" in err
    assert files(out) == before

    # nothing of a run there: --resume auto starts one, and says so
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (empty, tmp_path / "new"):
        assert main(new_run_argv(data, folder, "--resume", "auto")) == 0
        assert f"no checkpoint in {folder}; starting a new run" in capsys.readouterr().out
        assert load_checkpoint(folder / "last.pt")["iteration"] == 1

    # --overwrite replaces the run without last.pt by a new one
    assert main(new_run_argv(data, out, "--resume", "auto", "--overwrite")) == 0
    assert load_checkpoint(out / "last.pt")["iteration"] == 1
    assert (out / "best.pt").read_bytes() != before["best.pt"]


def test_resume_without_config_starts_from_the_checkpoints_own_config(data, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(new_run_argv(data, run, "--optim.lr", "0.02")) == 0
    moved = tmp_path / "elsewhere" / "last.pt"  # no config.yaml beside it
    moved.parent.mkdir()
    shutil.copy(run / "last.pt", moved)
    capsys.readouterr()

    out = tmp_path / "continued"
    assert main(run_argv(out, "--resume", str(moved), "--train.max_iters", "2")) == 0
    config = yaml.safe_load((out / "config.yaml").read_text())
    stored = load_checkpoint(moved)["config"]
    assert config["data"] == stored["data"] and config["model"] == stored["model"]
    assert config["optim"]["lr"] == 0.02 and config["train"]["max_iters"] == 2
    assert load_checkpoint(out / "last.pt")["iteration"] == 2

    # a checkpoint that stores no config: one line asking for --config
    bare = write_checkpoint(tmp_path / "bare" / "model.pt", FOUR.class_names)
    assert main(run_argv(tmp_path / "other", "--resume", str(bare))) == 1
    err = one_line(capsys)
    assert str(bare) in err and "--config" in err
    assert not (tmp_path / "other").exists()


def test_resume_auto_without_config_reads_the_folders_config(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(new_run_argv(data, out, "--optim.lr", "0.02")) == 0
    capsys.readouterr()
    assert main(run_argv(out, "--resume", "auto", "--train.max_iters", "2")) == 0
    assert f"resumed from {out / 'last.pt'} at iteration 1" in capsys.readouterr().out
    state = load_checkpoint(out / "last.pt")
    assert state["iteration"] == 2 and state["config"]["optim"]["lr"] == 0.02


def test_a_moved_run_folder_goes_on_in_its_own_folder(data, tmp_path, capsys):
    """Its config.yaml still named the old place: the resume trained there (and with
    --overwrite replaced the run there), leaving the moved folder behind."""
    run = tmp_path / "run"
    assert main(new_run_argv(data, run, "--quiet")) == 0
    copy = Path(shutil.copytree(run, tmp_path / "copy"))
    before = files(run)
    capsys.readouterr()
    argv = ["train", "--resume", str(copy / "last.pt"), "--train.max_iters", "2"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert f"the run goes on in {copy}, the checkpoint's folder" in err
    assert load_checkpoint(copy / "last.pt")["iteration"] == 2
    assert files(run) == before  # the original is left alone
    # the first run's --quiet is not this one's: it shows its progress
    assert f"resumed from {copy / 'last.pt'} at iteration 1" in out


def test_resume_auto_says_a_new_run_even_when_quiet(data, tmp_path, capsys):
    out = tmp_path / "fresh"
    assert main(new_run_argv(data, out, "--resume", "auto", "--quiet")) == 0
    assert f"no checkpoint in {out}; starting a new run" in capsys.readouterr().err


def test_a_resume_that_no_longer_fits_names_the_changed_setting(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(new_run_argv(data, out)) == 0
    capsys.readouterr()
    hidden = load_checkpoint(out / "last.pt")["model_kwargs"]["renet_hidden"]
    argv = run_argv(out, "--resume", "auto", "--train.max_iters", "2")
    assert main([*argv, "--model.renet_hidden", str(hidden * 2)]) == 1
    err = one_line(capsys)
    assert f"model.renet_hidden: {hidden} -> {hidden * 2}" in err and "--overwrite" in err


def test_a_moved_run_keeps_the_quiet_and_out_dir_of_this_commands_section_file(
    data, tmp_path, capsys
):
    """``--train FILE`` setting quiet or out_dir is this command's choice: the stored run's
    quiet does not win over it, and its out_dir is not taken for a moved folder's."""
    run = tmp_path / "run"
    assert main(new_run_argv(data, run)) == 0
    copy = Path(shutil.copytree(run, tmp_path / "copy"))
    section = tmp_path / "quiet.yaml"
    section.write_text("quiet: true\n")
    capsys.readouterr()
    argv = ["train", "--resume", str(copy / "last.pt"), "--train", str(section)]
    assert main([*argv, "--train.max_iters", "2"]) == 0
    out, err = capsys.readouterr()
    assert "resumed from" not in out  # quiet, as the section file says
    assert load_checkpoint(copy / "last.pt")["iteration"] == 2

    elsewhere = tmp_path / "elsewhere"
    section.write_text(f"out_dir: {elsewhere}\n")
    argv = ["train", "--resume", str(copy / "last.pt"), "--train", str(section)]
    assert main([*argv, "--train.max_iters", "3"]) == 0
    _, err = capsys.readouterr()
    assert "the checkpoint's folder" not in err
    assert load_checkpoint(elsewhere / "last.pt")["iteration"] == 3
