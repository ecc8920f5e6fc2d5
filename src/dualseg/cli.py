"""The ``dualseg`` command line: command -> module with ``main(argv) -> int``, imported when it
runs (``dualseg --help`` stays fast); user errors become one line, exit 1."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import select
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from dualseg._version import __version__
from dualseg.errors import DualsegError, Terminated, user_message  # light: no torch import

# name -> (module with main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("dualseg.commands.demo", "train, evaluate and refine on a built-in synthetic dataset"),
    "train": ("dualseg.commands.train", "train a model from a YAML config (+ overrides)"),
    "eval": ("dualseg.commands.eval", "evaluate a checkpoint: mIoU, boundary F1, trimap mIoU"),
    "predict": ("dualseg.commands.predict", "segment images: label PNG, colour PNG, overlay"),
    "augment": ("dualseg.commands.augment", "write N augmented image/label pairs plus a list file"),
    "data": ("dualseg.commands.data", "dataset tools: 'dualseg data check ROOT'"),
    "refine": ("dualseg.commands.refine", "method B: 'refine fit' and 'refine apply'"),
    "export": ("dualseg.commands.export", "export a checkpoint to ONNX or TorchScript"),
    "serve": ("dualseg.commands.serve", "local web page and JSON API for segmentation"),
}
SUBCOMMANDS = {"data": ("check",), "refine": ("fit", "apply")}  # named in error lines too
# the data layer's messages name most commands' flags; train's are config fields
TRAIN_FLAGS = {
    "--label-format": "--data.label_format",
    "--label-map": "--data.label_map",
    "--ignore-index": "--data.ignore_index",
    "--layout": "--data.layout",
    "--preset": "--data.preset",
}
TRAIN_FLAG_RE = re.compile("(" + "|".join(map(re.escape, TRAIN_FLAGS)) + r")\b(?![.-])")
# what makes each command's memory smaller, for the out-of-memory line
OUT_OF_MEMORY_FIXES = {
    "train": "a smaller --data.batch_size or --data.crop_size",
    "eval": "--mode slide --window 512 512 for large images, or --batch-size 1",
    "predict": "--mode slide --window 512 512 for large images, or a smaller --batch-size",
    "refine fit": "a smaller --batch-size or --crop-size",
    "refine apply": "--mode slide --window 512 512 for large images",
    "serve": "a lower --work-megapixels or --max-megapixels",
}


def usage() -> str:
    width = max(len(n) for n in COMMANDS)
    return "\n".join([
        "usage: dualseg COMMAND [options]   (dualseg COMMAND --help for a command's options)",
        "",
        "dualseg: dual-branch semantic segmentation and boundary re-optimization.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help", "help", "--version"}:
        try:
            print(f"dualseg {__version__}" if argv[:1] == ["--version"] else usage(), flush=True)
        except BrokenPipeError:  # dualseg --help | head -1
            if _stdout_closed():
                return 141
            raise
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dualseg: error: unknown command {name!r}; see 'dualseg --help'", file=sys.stderr)
        return 1
    module = COMMANDS[name][0]
    if rest and rest[0] in SUBCOMMANDS.get(name, ()):
        name = f"{name} {rest[0]}"
    try:
        with terminated_as_exception():
            # imported here: a Ctrl-C while torch loads is one line too
            code = int(importlib.import_module(module).main(rest) or 0)
        sys.stdout.flush()  # a reader gone before the last buffered line: caught below too
        return code
    except KeyboardInterrupt:
        print("dualseg: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("dualseg: terminated", file=sys.stderr)
        return 143  # 128 + SIGTERM, as a shell reports it
    except (DualsegError, OSError, MemoryError, RuntimeError) as err:
        if isinstance(err, BrokenPipeError) and _stdout_closed():
            return 141  # 128 + SIGPIPE: what a shell reports for `dualseg ... | head`
        line = failure_line(name, err)
        if line is None:  # not the user's input nor the machine: a bug to see whole
            raise
        print(f"dualseg {name}: error: {line}", file=sys.stderr)
        return 1


def failure_line(name: str, err: BaseException) -> str | None:
    """What went wrong, for a user error or the machine's limit (disk, memory), else None."""
    if isinstance(err, DualsegError):
        text = user_message(err)
        return TRAIN_FLAG_RE.sub(lambda m: TRAIN_FLAGS[m[1]], text) if name == "train" else text
    text = " ".join(str(err).split())
    memory = isinstance(err, RuntimeError) and (
        type(err).__name__ == "OutOfMemoryError"  # CUDA's; torch's CPU allocator says:
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
    )
    if memory or isinstance(err, MemoryError):  # MemoryError: numpy's allocations
        asked = re.search(r"allocate (\d+) bytes", text)
        size = f" (it asked for {int(asked[1]) / 2**30:.1f} GiB more)" if asked else ""
        fix = OUT_OF_MEMORY_FIXES.get(name, "smaller inputs")
        return f"out of memory{size}; use {fix}, or a machine with more memory"
    if isinstance(err, RuntimeError) and "PytorchStreamWriter failed" in text:  # torch.save's
        return f"writing a torch file failed ({text}); check the free space and permissions"
    if isinstance(err, OSError) and (err.filename is not None or err.errno is not None):
        where = f"{err.filename}: " if err.filename is not None else ""
        problem = err.strerror or type(err).__name__
        return f"{where}{problem}; check the path, its permissions and the free space"
    return None


@contextlib.contextmanager
def terminated_as_exception() -> Iterator[None]:
    """In the block, SIGTERM raises :class:`Terminated` in the main thread (a forked worker
    dies of it as by default)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pid = os.getpid()

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != pid:  # a DataLoader or pool worker forked from this process
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe without reader (``| head``); if so it is pointed at /dev/null,
    so Python's flush at exit does not fail again."""
    try:
        fd = sys.stdout.fileno()
        poll = select.poll()  # the write end of a pipe without reader: POLLERR (Linux)
        poll.register(fd, select.POLLOUT)
        if not any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0)):
            return False
    except (OSError, ValueError, AttributeError):  # stdout replaced (tests), closed, or no poll
        return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    return True


if __name__ == "__main__":
    sys.exit(main())
