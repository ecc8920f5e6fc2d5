"""What every command prints while it works: tqdm bars on a terminal, a plain line every
``DEFAULT_EVERY_S`` seconds in a pipe or log, nothing when quiet; one help layout, one error."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, Literal, NoReturn, TextIO, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")
ProgressMode = Literal["bar", "lines", "off"]
DEFAULT_EVERY_S = 30.0  # seconds between two plain progress lines (pipes, logs)


def progress_mode(quiet: bool = False, stream: TextIO | None = None) -> ProgressMode:
    if quiet:
        return "off"
    return "bar" if (stream or sys.stderr).isatty() else "lines"


class Progress:
    """A progress display of ``total`` steps in ``mode``: ``update(n)``, ``close()``, ``with``."""

    def __init__(
        self,
        *,
        desc: str,
        total: int | None = None,
        unit: str = "it",
        mode: ProgressMode = "bar",
        every_s: float = DEFAULT_EVERY_S,
        stream: TextIO | None = None,
    ) -> None:
        self.desc, self.total, self.unit, self.mode = desc, total, unit, mode
        self.every_s, self.stream, self.done = every_s, stream, 0
        self._start = self._last = time.monotonic()
        self._bar = None
        if mode == "bar":
            self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=stream)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.mode == "lines" and time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            self._line()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "lines":
            self._line()
        self.mode = "off"  # a second close() prints nothing

    def _line(self) -> None:
        secs = time.monotonic() - self._start
        of = f"/{self.total} ({100 * self.done / self.total:.0f}%)" if self.total else ""
        rate = f", {self.done / secs:.2f} {self.unit}/s" if secs > 0 else ""
        print(
            f"{self.desc}: {self.done}{of} {self.unit}{rate}, {secs:.0f}s",
            file=self.stream or sys.stderr,
            flush=True,
        )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None and self.mode == "lines":
            self.mode = "off"  # a failure: its one error line, not a last progress line
        self.close()


def track(
    iterable: Iterable[T],
    *,
    desc: str,
    total: int | None = None,
    unit: str = "it",
    mode: ProgressMode = "bar",
    every_s: float = DEFAULT_EVERY_S,
    stream: TextIO | None = None,
) -> Iterator[T]:
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with Progress(
        desc=desc, total=total, unit=unit, mode=mode, every_s=every_s, stream=stream
    ) as bar:
        for item in iterable:
            yield item
            bar.update()


class ExamplesHelpFormatter(argparse.HelpFormatter):
    """Wraps description paragraphs; keeps indented lines (examples) and blank lines as is."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in text.splitlines():
            if not line.strip() or line.startswith(" "):
                lines.append(indent + line if line.strip() else "")
            else:
                lines.append(super()._fill_text(line, width, indent))
        return "\n".join(lines)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit status 1, as every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(1, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def examples(*lines: str) -> str:
    """An epilog: ``examples:`` then each command line, indented."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def argparse_kwargs(*example_lines: str) -> dict[str, Any]:
    """``ArgumentParser(**argparse_kwargs(...))``: the epilog and the formatter that keeps it."""
    return {"epilog": examples(*example_lines), "formatter_class": ExamplesHelpFormatter}
