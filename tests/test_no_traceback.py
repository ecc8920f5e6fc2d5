"""Every command, run as ``python -m dualseg`` with a bad input: one line, exit 1, no traceback."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reliability_helpers import save

REPO = Path(__file__).resolve().parents[1]


def test_every_command_with_a_bad_input_prints_no_traceback(tmp_path: Path) -> None:
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not a checkpoint, not an image\n")
    missing = str(tmp_path / "missing")
    image = save(tmp_path / "img.png", np.zeros((16, 16, 3), np.uint8))
    commands = {
        "train": ["train", "--data.root", missing, "--train.out_dir", str(tmp_path / "run")],
        "eval": ["eval", "--checkpoint", f"{missing}.pt", "--data", missing],
        "predict": ["predict", f"{missing}.png", "-c", f"{missing}.pt", "--out", str(image)],
        "demo": ["demo", "--out", str(image / "x")],
        "refine fit": ["refine", "fit", "--data", missing, "--steps", "0"],
        "refine apply": ["refine", "apply", str(image), "-r", "r.pt", "--base", "x", "-o", "."],
        "export": ["export", "-c", f"{missing}.pt", "--out", str(text_file / "m.onnx")],
        "serve": ["serve", "-c", f"{missing}.pt", "--port", "70000"],
        "data check": ["data", "check", missing],
        "augment": ["augment", missing, str(text_file), "--count", "1"],
        "train config key": ["train", "--trian.max_iters", "3"],
        # argparse's own errors (a flag without its value, a bad number, an unknown subcommand)
        "eval flag value": ["eval", "--checkpoint"],
        "demo bad int": ["demo", "--iters", "x"],
        "refine apply top-n": [
            "refine",
            "apply",
            str(image),
            "-r",
            "r",
            "-b",
            "b",
            "-o",
            ".",
            "--top-n",
            "0",
        ],
        "data subcommand": ["data", "chek"],
        # a (2r+1)^2 dilation kernel: r = 100000 asked OpenCV for 40 GB, a cv2.error traceback
        "refine fit radius": ["refine", "fit", "--data", missing, "--radius", "100000"],
    }
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    # One interpreter runs them all (torch is imported once): DRIVER calls dualseg.cli.main as
    # `python -m dualseg` does and prints an escaping exception's traceback, as Python would.
    results = json.loads(
        subprocess.run(
            [sys.executable, "-c", DRIVER, json.dumps(commands)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout
    )
    assert set(results) == set(commands)
    for name, (code, out, err) in results.items():
        assert code == 1, (name, code, err)
        assert "Traceback" not in err + out, (name, err)
        # a user error, argparse's included: exactly one line (no usage block before it)
        assert err.strip().splitlines() == [err.strip()], (name, err)
        assert err.startswith(f"dualseg {name.split()[0]}"), (name, err)
    assert results["eval flag value"][2].strip() == (
        "dualseg eval: error: argument --checkpoint/-c: expected one argument; "
        "see 'dualseg eval --help'"
    )
    assert results["refine apply top-n"][2].startswith(
        "dualseg refine apply: error: argument --top-n: must be >= 1, got 0"
    )
    assert results["refine apply"][2].startswith("dualseg refine apply: error:")
    assert "argument --radius: must be at most 256 pixels" in results["refine fit radius"][2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img.png", "notes.txt"]


def test_python_m_dualseg_turns_a_bad_input_into_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "dualseg", "train", "--trian.max_iters", "3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "dualseg train: error: unknown flag --trian.max_iters; did you mean --train.max_iters?"
    ]


SUBCOMMANDS = [
    "demo",
    "train",
    "eval",
    "predict",
    "augment",
    "data",
    "data check",
    "refine",
    "refine fit",
    "refine apply",
    "export",
    "serve",
]


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_an_unknown_flag_is_one_line_and_exit_status_1(command: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "dualseg", *command.split(), "--no-such-flag"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dualseg {command}: error: "), proc.stderr


def test_an_unknown_command_is_one_line_and_exit_status_1(capsys) -> None:
    from dualseg import cli

    assert cli.main(["trian"]) == 1
    err = capsys.readouterr().err
    assert err == "dualseg: error: unknown command 'trian'; see 'dualseg --help'\n"


DRIVER = """
import contextlib, io, json, sys, traceback
from dualseg.cli import main

results = {}
for name, argv in json.loads(sys.argv[1]).items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    results[name] = (code, out.getvalue(), err.getvalue())
print(json.dumps(results))
"""


def test_environment_failures_without_a_file_name_are_one_line(monkeypatch, capsys) -> None:
    from dualseg import cli
    from dualseg.commands import data as data_command

    def fail_with(err: BaseException):
        def main(argv):
            raise err

        return main

    full = OSError(errno.ENOSPC, "No space left on device")  # a write, no file name
    monkeypatch.setattr(data_command, "main", fail_with(full))
    assert cli.main(["data", "check", "x"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "dualseg data check: error: No space left on device; check the path, its permissions and "
        "the free space"
    )
    torch_save = RuntimeError("[enforce fail] PytorchStreamWriter failed writing file data/0")
    monkeypatch.setattr(data_command, "main", fail_with(torch_save))
    assert cli.main(["data", "check", "x"]) == 1
    assert "writing a torch file failed" in capsys.readouterr().err
    # out of memory (torch's CPU allocator, numpy): the machine's limit, with the fix
    from dualseg.commands import predict as predict_command

    oom = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 866304000 bytes. Error code 12 (Cannot allocate memory)"
    )
    monkeypatch.setattr(predict_command, "main", fail_with(oom))
    assert cli.main(["predict", "x"]) == 1
    assert capsys.readouterr().err.strip() == (
        "dualseg predict: error: out of memory (it asked for 0.8 GiB more); use --mode slide "
        "--window 512 512 for large images, or a smaller --batch-size, or a machine with more "
        "memory"
    )
    monkeypatch.setattr(data_command, "main", fail_with(MemoryError()))
    assert cli.main(["data", "check", "x"]) == 1
    assert "dualseg data check: error: out of memory; use smaller inputs" in capsys.readouterr().err
    # anything else is a bug, and its traceback is what a report needs
    monkeypatch.setattr(data_command, "main", fail_with(RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        cli.main(["data", "check", "x"])


def test_a_failed_atomic_write_names_its_file_and_leaves_none(monkeypatch, tmp_path) -> None:
    import os

    from dualseg.io import atomic_write_text

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")  # fsync names no file

    monkeypatch.setattr(os, "fsync", full)
    target = tmp_path / "metrics.json"
    with pytest.raises(OSError, match="No space left") as err:
        atomic_write_text(target, "{}")
    assert err.value.filename == str(target) and err.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []  # no target, no temporary


def _piped(body: str, *, stop_reading: bool) -> tuple[int, str]:
    """Run ``cli.main(['data', 'check', 'x'])`` in a child whose data command is ``body``,
    its stdout a pipe we read one line of and then close (as ``| head -1`` does) or keep."""
    code = (
        "import sys\n"
        "from dualseg import cli\n"
        "from dualseg.commands import data\n"
        f"def main(argv):\n{body}"
        "data.main = main\n"
        "sys.exit(cli.main(['data', 'check', 'x']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered stdout
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert proc.stdout.readline() == b"line 0\n"
    if stop_reading:
        proc.stdout.close()
    err = proc.stderr.read().decode()
    return proc.wait(timeout=60), err


needs_linux_pipes = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="tells a gone reader by poll(): Linux pipes"
)


@needs_linux_pipes
@pytest.mark.parametrize(
    "body",
    [
        "    for i in range(200000):\n        print('line', i)\n",  # more than a pipe holds
        # one short line, left in the buffer: the pipe breaks at the last flush
        "    print('line', 0, flush=True)\n    import time; time.sleep(1)\n    print('end')\n",
    ],
    ids=["while-writing", "at-the-last-flush"],
)
def test_output_piped_into_a_reader_that_stops_ends_quietly(body: str) -> None:
    """`dualseg data check D | head -4` once ended "error: Broken pipe; check the path, its
    permissions and the free space": the reader stopping is no error to report."""
    code, err = _piped(body, stop_reading=True)
    assert code == 141 and err == "", err  # 128 + SIGPIPE, as a shell says


@needs_linux_pipes
def test_a_broken_pipe_that_is_not_stdout_is_still_reported() -> None:
    body = (
        "    print('line', 0, flush=True)\n"
        "    import errno\n"
        "    raise BrokenPipeError(errno.EPIPE, 'Broken pipe')\n"  # e.g. a child's stdin
    )
    code, err = _piped(body, stop_reading=False)
    assert code == 1 and "error: Broken pipe; check the path" in err, err


def test_sigterm_is_one_line_and_removes_a_half_written_file(tmp_path: Path, monkeypatch, capsys):
    """SIGTERM (timeout, docker stop, Slurm) killed every command but train and augment at
    once: a file being written left its temporary for good, and nothing was said."""
    import signal

    from dualseg import cli

    (tmp_path / "fake_command.py").write_text(
        "import os, signal, time\n"
        "from dualseg.io import atomic_open\n"
        "def main(argv):\n"
        f"    with atomic_open({str(tmp_path / 'out.png')!r}) as f:\n"
        "        f.write(b'half')\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(5)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "fake", ("fake_command", "a test command"))
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["fake"]) == 143
    assert capsys.readouterr().err == "dualseg: terminated\n"
    assert not (tmp_path / "out.png").exists() and not list(tmp_path.glob(".*.tmp"))
    assert signal.getsignal(signal.SIGTERM) == before


@needs_linux_pipes
def test_help_piped_into_a_reader_that_stops_ends_quietly() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = str(REPO / "src")
    code = "import sys, time; from dualseg import cli; time.sleep(1); sys.exit(cli.main([]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    proc.stdout.close()  # the reader is gone before the usage is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == "", err
