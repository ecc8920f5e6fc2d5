"""User-facing errors.

Every expected failure (bad image, bad label, mismatched sizes, corrupt or incompatible
checkpoint, empty dataset, ...) raises a subclass of :class:`DualsegError` whose message names
the file and says how to fix it. The CLI prints such errors as one line, without a traceback.
"""

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
    """The one line to show for ``err``.

    A :class:`DualsegError` raised inside a DataLoader worker reaches the main process re-raised
    by torch with a message holding the worker's whole traceback ("Caught DataError in
    DataLoader worker process 0. Original Traceback ..."); its last line is the original
    message, which is what the user needs: the same line as with ``num_workers=0``.
    """
    text = str(err)
    if _WORKER_HEADER in text and _ORIGINAL in text:
        last = [line for line in text.split(_ORIGINAL, 1)[1].splitlines() if line.strip()]
        if last:
            head, sep, message = last[-1].partition(": ")
            text = message if sep and "Error" in head else last[-1]
    return " ".join(text.split("\n")).strip()


class Terminated(BaseException):
    """SIGTERM (``timeout``, ``docker stop``, Slurm) raised in the command's process, so that
    what Ctrl-C runs runs too: a half-written file's temporary is removed (``dualseg.io``),
    a training or fit saves its state, and the exit is one line. A BaseException, as
    KeyboardInterrupt is: no ``except Exception`` swallows it."""
