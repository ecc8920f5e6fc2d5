"""User-facing errors: one line naming the file and the fix, printed by the CLI."""

from __future__ import annotations


class DualsegError(Exception):
    """Base class of dualseg's user-facing errors."""


class DataError(DualsegError, ValueError):
    """A dataset, image or label file is missing, unreadable or inconsistent."""


class CheckpointError(DualsegError, ValueError):
    """A checkpoint is corrupt, or belongs to another architecture or class set."""


class WeightsNotFoundError(DualsegError, FileNotFoundError):
    """Pretrained weights could not be found in any of the places searched."""


class ConfigError(DualsegError, ValueError):
    """A configuration value is invalid."""


class OutputError(DualsegError, OSError):
    """An output file or folder cannot be written (checked before any work is done)."""


class RunExistsError(DualsegError, FileExistsError):
    """A run folder already holds a run; resume it or overwrite it explicitly."""


_WORKER_HEADER = "in DataLoader worker process"
_ORIGINAL = "Original Traceback (most recent call last):"


def user_message(err: BaseException) -> str:
    """The one line to show for ``err``; from a DataLoader worker's re-raised error (the
    worker's whole traceback), its last line: the line ``num_workers=0`` shows."""
    text = str(err)
    if _WORKER_HEADER in text and _ORIGINAL in text:
        last = [line for line in text.split(_ORIGINAL, 1)[1].splitlines() if line.strip()]
        if last:
            head, sep, message = last[-1].partition(": ")
            text = message if sep and "Error" in head else last[-1]
    return " ".join(text.split("\n")).strip()


class Terminated(BaseException):
    """SIGTERM raised in the command, so cleanup runs as for Ctrl-C; a BaseException, as
    KeyboardInterrupt is, so no ``except Exception`` swallows it."""
