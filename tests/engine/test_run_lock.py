"""One process writes a run folder at a time: a second ``train`` or ``demo`` into a folder that
a live run holds is refused in one line (two runs mixed their files: one's config beside the
other's checkpoint); a lock left by a killed run is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dualseg.engine.rundir import LOCK_NAME, check_not_in_use, hold_run_folder
from dualseg.errors import RunExistsError


@pytest.fixture
def other_process():
    """A live process that is not this one (its pid is what a lock would name)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def lock_for(folder: Path, pid: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    record = {"pid": pid, "host": socket.gethostname()}
    (folder / LOCK_NAME).write_text(json.dumps(record))


def test_a_folder_held_by_a_live_process_is_refused_and_a_dead_ones_lock_taken_over(
    tmp_path, other_process
) -> None:
    out = tmp_path / "run"
    lock_for(out, other_process.pid)
    with pytest.raises(
        RunExistsError, match=rf"in use by another dualseg run \(process {other_process.pid}"
    ):
        check_not_in_use(out)
    with pytest.raises(RunExistsError, match="in use"), hold_run_folder(out):
        pass
    other_process.kill()
    other_process.wait()
    with hold_run_folder(out):  # its process ended: the lock is stale
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
        with hold_run_folder(out):  # re-entrant: the demo holds its folder around fit
            pass
        assert (out / LOCK_NAME).is_file()
    assert not (out / LOCK_NAME).exists()


def test_train_into_a_folder_another_run_holds_is_one_line_and_changes_nothing(
    tmp_path, other_process, capsys
) -> None:
    from dualseg.cli import main
    from reliability_helpers import FOUR, class_maps, one_line, write_dataset

    maps = class_maps(2, 4)
    data = write_dataset(tmp_path / "four", {"train": maps, "val": maps}, meta=FOUR)
    out = tmp_path / "run"
    lock_for(out, other_process.pid)
    argv = ["train", "--config", str(Path(__file__).parents[2] / "configs" / "tiny_synthetic.yaml")]
    argv += ["--data.root", str(data), "--data.preset", "null", "--data.crop_size", "[32,32]"]
    argv += ["--train.out_dir", str(out), "--train.max_iters", "1", "--train.val_every", "0"]
    assert main(argv) == 1
    assert "is in use by another dualseg run" in one_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    other_process.kill()
    other_process.wait()
    assert main([*argv, "--train.progress", "false"]) == 0  # the stale lock is taken over
    assert (out / "last.pt").is_file() and not (out / LOCK_NAME).exists()


def test_a_demo_into_a_folder_another_run_holds_is_refused_before_it_generates_data(
    tmp_path, other_process, capsys
) -> None:
    from dualseg.cli import main
    from reliability_helpers import one_line

    out = tmp_path / "demo"
    lock_for(out, other_process.pid)
    argv = ["demo", "--out", str(out), "--size", "32", "48", "--n-train", "4", "--n-val", "2"]
    argv += ["--iters", "1", "--batch-size", "2", "--weights", "none", "--no-refine", "--quiet"]
    assert main(argv) == 1
    assert "is in use by another dualseg run" in one_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]


def test_another_machines_lock_is_refused_with_the_file_to_delete(tmp_path):
    """Whether another host's process lives cannot be told from here: its lock is refused,
    naming the lock file to delete when no run uses the folder."""
    out = tmp_path / "run"
    out.mkdir()
    lock = out / LOCK_NAME
    lock.write_text(json.dumps({"pid": 4242, "host": "node-a"}))
    with pytest.raises(RunExistsError, match=rf"process 4242 on node-a.*delete {lock}"):
        check_not_in_use(out)
    lock.unlink()
    with hold_run_folder(out):
        assert json.loads(lock.read_text())["host"] == socket.gethostname()
    assert not lock.exists()
