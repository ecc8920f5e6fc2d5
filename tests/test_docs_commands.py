"""Every command the docs show still works as written: each ``dualseg ...`` line in README.md and
docs/*.md (shell code blocks and inline code) names a real command and subcommand, uses only flags
that command's ``--help`` lists (with a listed value where the flag has choices), and every
``python``/``bash`` script a doc runs exists. The commands' own ``--help`` examples are held to the
same rule. ``--help`` runs in-process through the console-script entry point, once per command."""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from dualseg import cli

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
COMMANDS = {"dualseg", "python", "bash", "torchrun"}  # the lines checked; curl, pip, git are not
FLAG = re.compile(r"-{1,2}[A-Za-z][\w.-]*")
# argparse's option lines: the invocation at a small indent, the help after two spaces or below
OPTION_LINE = re.compile(r"^ {2,8}(-\S.*?)(?: {2,}|$)", re.M)
SUBCOMMANDS = re.compile(r"\{([\w,-]+)\} \.\.\.")
FOREIGN = {"--no-deps"}  # pip's, in docs/models.md


def doc_commands(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, command line) for each shell line and inline command span of a doc."""
    text = path.read_text(encoding="utf-8")
    for block in FENCE.finditer(text):
        if block[1] not in SHELL_BLOCKS:
            continue
        first = text.count("\n", 0, block.start(2)) + 1
        joined, start = "", first
        for offset, line in enumerate(block[2].splitlines()):
            if not joined:
                start = first + offset
            stripped = line.strip().removeprefix("$ ")
            if stripped.endswith("\\"):
                joined += stripped[:-1].rstrip() + " "
                continue
            yield start, joined + stripped
            joined = ""
    for number, span in inline_code(text):
        if span.split(" ", 1)[0] in COMMANDS and " " in span:
            yield number, span


def inline_code(text: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each `inline code` span outside the code blocks."""
    prose = FENCE.sub(lambda m: "\n" * m[0].count("\n"), text)  # keep line numbers
    for span in re.finditer(r"`([^`\n]+)`", prose):
        yield prose.count("\n", 0, span.start()) + 1, span[1]


@functools.cache
def help_text(command: tuple[str, ...]) -> str | None:
    """``dualseg COMMAND --help``'s output, or None when that is not a command."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = cli.main([*command, "--help"])
        except SystemExit as exit_:
            code = exit_.code
    return out.getvalue() if code in (0, None) else None


@functools.cache
def options(command: tuple[str, ...]) -> dict[str, frozenset[str] | None]:
    """Each flag the command's help lists -> its choices (None: any value)."""
    found: dict[str, frozenset[str] | None] = {}
    for invocation in OPTION_LINE.findall(help_text(command) or ""):
        for part in invocation.split(", "):
            flag, _, metavar = part.partition(" ")
            choices = re.fullmatch(r"\{(.*)\}", metavar)
            found[flag] = frozenset(choices[1].split(",")) if choices else None
    return found


def command_of(argv: list[str]) -> tuple[tuple[str, ...] | None, str]:
    """The (sub)command path an argv runs, or None and why."""
    command = (argv[0],)
    text = help_text(command)
    if text is None:
        return None, f"'dualseg {argv[0]}' is not a command"
    usage = text.split("\n\n", 1)[0]
    subs = SUBCOMMANDS.search(usage)
    if subs:
        names = subs[1].split(",")
        if len(argv) < 2 or argv[1] not in names:
            return None, f"'dualseg {argv[0]}' needs one of {names}"
        command += (argv[1],)
    return command, ""


def is_placeholder(token: str) -> bool:
    return token == "..." or "<" in token or re.fullmatch(r"[A-Z][A-Z_]*/?", token) is not None


def script_problems(script: str, argv: list[str]) -> list[str]:
    """A script must exist and name each flag it is given (read, not run: no torch import)."""
    path = REPO / script
    if not path.is_file():
        return [f"{script} does not exist"]
    source = path.read_text(encoding="utf-8")
    flags = [token.split("=", 1)[0] for token in argv]
    return [
        f"{script} has no flag {flag}"
        for flag in flags
        if FLAG.fullmatch(flag) and f'"{flag}"' not in source and f"'{flag}'" not in source
    ]


def problems_of(line: str) -> list[str]:
    """What in one command line no longer matches the code (empty: all fine)."""
    if line.split(" ", 1)[0] not in COMMANDS:
        return []  # prose in an unlabelled block, or another tool
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError as err:
        return [f"not valid shell ({err})"]
    if not tokens:
        return []
    if tokens[0] in {"python", "bash"} and len(tokens) > 1 and not tokens[1].startswith("-"):
        return script_problems(tokens[1], tokens[2:])
    if tokens[0] == "dualseg":
        argv = tokens[1:]
    elif "-m" in tokens and tokens[tokens.index("-m") + 1 :][:1] == ["dualseg"]:
        argv = tokens[tokens.index("-m") + 2 :]  # python -m dualseg, torchrun ... -m dualseg
    else:
        return []
    if not argv or argv[0].startswith("-") or not re.fullmatch(r"[a-z]+", argv[0]):
        return []  # dualseg --help, or a placeholder such as COMMAND
    command, why = command_of(argv)
    if command is None:
        return [why]
    known = options(command)
    problems = []
    for i, token in enumerate(argv):
        if not FLAG.fullmatch(token.split("=", 1)[0]):
            continue
        flag, eq, value = token.partition("=")
        if flag not in known:
            problems.append(f"'dualseg {' '.join(command)}' has no flag {flag}")
            continue
        if not eq and i + 1 < len(argv):
            value = argv[i + 1]
        choices = known[flag]
        given = value and not value.startswith("-") and not is_placeholder(value)
        if choices and given and value not in choices:
            problems.append(f"{flag} {value}: not one of {sorted(choices)}")
    return problems


def all_commands() -> list[tuple[str, ...]]:
    """Each command 'dualseg --help' lists, and each subcommand its own help lists."""
    top = (help_text(()) or "").partition("\ncommands:\n")[2]
    commands = [(name,) for name in re.findall(r"^  ([a-z]+) ", top, re.M)]
    assert len(commands) > 5, "'dualseg --help' lists no commands"
    for (name,) in list(commands):
        subs = SUBCOMMANDS.search((help_text((name,)) or "").split("\n\n", 1)[0])
        commands += [(name, sub) for sub in subs[1].split(",")] if subs else []
    return commands


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_documented_commands_match_the_parsers(doc: Path) -> None:
    found = [
        f"{doc.name}:{number}: {line}\n    -> {problem}"
        for number, line in doc_commands(doc)
        for problem in problems_of(line)
    ]
    assert not found, "the docs show commands the code no longer accepts:\n" + "\n".join(found)


def test_help_examples_match_the_parsers() -> None:
    found = []
    for command in all_commands():
        text = help_text(command)
        assert text, f"'dualseg {' '.join(command)} --help' failed"
        examples = text.partition("\nexamples:\n")[2]
        lines = [line.strip() for line in examples.splitlines()]
        for line in filter(lambda line: line.startswith("dualseg "), lines):
            found += [f"{' '.join(command)} --help: {line}\n    -> {p}" for p in problems_of(line)]
    assert not found, "'--help' examples the parsers refuse:\n" + "\n".join(found)


def test_flags_named_in_prose_exist() -> None:
    """A flag the docs name on its own (`--tta-flip`, `--mode slide`) belongs to some command."""
    known = {flag for command in all_commands() for flag in options(command)}
    sources = "".join(p.read_text(encoding="utf-8") for p in (REPO / "benchmarks").glob("*.py"))
    found = []
    for doc in DOCS:
        for number, span in inline_code(doc.read_text(encoding="utf-8")):
            flags = [token.split("=", 1)[0] for token in span.split()] if span[0] == "-" else []
            for flag in flags:
                placeholder = flag.startswith("--section.") or flag != flag.lower()
                foreign = flag in FOREIGN or f'"{flag}"' in sources  # pip's, a benchmark's
                if FLAG.fullmatch(flag) and not (placeholder or foreign or flag in known):
                    found.append(f"{doc.name}:{number}: `{span}` -> no command has {flag}")
    assert not found, "the docs name flags no command accepts:\n" + "\n".join(found)


def test_the_checker_sees_the_docs_and_refuses_a_lost_flag() -> None:
    lines = [line for doc in DOCS for _, line in doc_commands(doc)]
    assert sum(line.startswith("dualseg ") for line in lines) > 50
    assert options(("train",))["--train.amp"] == {"auto", "none", "bf16", "fp16"}
    assert problems_of("dualseg predict x -c m.pt --no-such-flag") == [
        "'dualseg predict' has no flag --no-such-flag"
    ]
    assert problems_of("dualseg refine polish") != []
    assert problems_of("python benchmarks/no_such_script.py") != []
    assert problems_of("python benchmarks/refine_gain.py --time-imagez 20") == [
        "benchmarks/refine_gain.py has no flag --time-imagez"
    ]
