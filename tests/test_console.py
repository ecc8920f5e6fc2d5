"""The CLI explains itself: field help, examples, shared flags, one progress rule."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest

from dualseg.cli import COMMANDS
from dualseg.console import Progress, progress_mode, track
from dualseg.engine.config import build_parser
from dualseg.engine.options import SECTIONS, field_docs


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_rule_bar_on_a_terminal_lines_in_a_log_nothing_when_quiet() -> None:
    assert progress_mode(stream=_Stream(True)) == "bar"
    assert progress_mode(stream=_Stream(False)) == "lines"
    assert progress_mode(quiet=True, stream=_Stream(True)) == "off"

    log = _Stream(False)
    got = list(track(range(5), desc="eval", unit="img", mode="lines", every_s=0, stream=log))
    assert got == [0, 1, 2, 3, 4]
    lines = log.getvalue().splitlines()
    assert len(lines) == 6  # one per step (every_s=0) plus the final one
    assert re.fullmatch(r"eval: 5/5 \(100%\) img.*", lines[-1]) and "\r" not in log.getvalue()
    log = _Stream(False)
    with Progress(desc="predict", total=3, mode="lines", every_s=1e9, stream=log) as bar:
        bar.update(3)
    assert log.getvalue().splitlines() == [log.getvalue().splitlines()[0]]  # only the last
    assert log.getvalue().startswith("predict: 3/3 (100%)")
    quiet = _Stream(False)
    assert list(track([1, 2], desc="x", mode="off", stream=quiet)) == [1, 2]
    assert quiet.getvalue() == ""


def test_train_help_describes_every_field_and_ends_with_examples() -> None:
    text = build_parser().format_help()
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{section}.{f.name} has no description"
            assert f"--{section}.{f.name}" in text
    # the description sits next to its flag, with the default
    flat = " ".join(text.split())
    assert "--optim.ohem_min_kept OHEM_MIN_KEPT OHEM: keep at least" in flat
    assert "default: 100000" in flat
    assert "--data.root ROOT dataset folder" in flat
    assert field_docs(SECTIONS["optim"])["class_weights"].startswith("Beyond S32, off by default")
    assert text.rstrip().splitlines()[-3].strip().startswith("dualseg train --")
    assert "examples:" in text


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_help_ends_with_examples(name, capsys) -> None:
    import importlib

    module = importlib.import_module(COMMANDS[name][0])
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    examples = lines[lines.index("examples:") + 1 :]
    assert 1 <= len(examples) <= 3
    assert all(line.startswith("  dualseg ") for line in examples)


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "-c", "x.pt", "--data", "d"],
        ["predict", "a.png", "-c", "x.pt", "-o", "o"],
        ["refine", "apply", "a.png", "-r", "r.pt", "-b", "x.pt", "-o", "o"],
        ["refine", "fit", "--data", "d"],
        ["serve", "-c", "x.pt"],
    ],
)
def test_commands_that_run_a_model_take_device_threads_amp_the_same_way(argv) -> None:
    import importlib

    module = importlib.import_module(COMMANDS[argv[0]][0])
    parser = module.build_parser()
    args = parser.parse_args([*argv[1:], "--device", "cpu", "--threads", "2", "--amp"])
    assert (args.device, args.threads, args.amp) == ("cpu", 2, True)
