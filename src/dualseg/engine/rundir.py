"""The run folder of ``fit``: a folder holding a run is refused unless ``--resume`` continues
it or ``--overwrite`` replaces it; a lock file (pid and host) keeps a second process out."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from dualseg.errors import RunExistsError
from dualseg.io import check_writable

# the files a run writes (TensorBoard's events.out.* come on top)
RUN_FILES = ("last.pt", "best.pt", "metrics.jsonl", "config.yaml", "curves.png", "summary.json")
LAST, BEST = RUN_FILES[:2]
LOCK_NAME = ".dualseg.lock"


def run_files(out_dir: Path) -> list[Path]:
    """The files of a previous run in ``out_dir``."""
    files = [out_dir / name for name in RUN_FILES if (out_dir / name).exists()]
    return files + sorted(out_dir.glob("events.out.tfevents.*"))


def continues_run(out_dir: str | Path, resume: str | os.PathLike[str] | None) -> bool:
    """Whether ``--resume`` continues the run in ``out_dir`` (``auto``, or its own checkpoint)."""
    out_dir = Path(out_dir)
    if resume is None:
        return False
    if resume == "auto":
        return (out_dir / LAST).is_file()
    return Path(resume).resolve() in {(out_dir / n).resolve() for n in (LAST, BEST)}


def check_run_dir(
    out_dir: str | Path, *, resume: str | os.PathLike[str] | None, overwrite: bool
) -> list[Path]:
    """Refuse ``out_dir`` when it cannot be written or holds a run ``resume`` does not continue
    (unless ``overwrite``); returns the run's files."""
    out_dir = Path(out_dir)
    check_writable(out_dir, kind="dir", what="train.out_dir")
    previous = run_files(out_dir) if out_dir.is_dir() else []
    if not previous or overwrite or continues_run(out_dir, resume):
        return previous
    names = ", ".join(p.name for p in previous[:4]) + (" ..." if len(previous) > 4 else "")
    hint = ""
    if not any((out_dir / n).is_file() for n in (LAST, BEST)):
        why = "holds a run that stopped before its first checkpoint"
    elif resume is None:
        why, hint = "already holds a run", "continue it with --resume auto, "
    elif resume == "auto":  # a best.pt alone
        why = f"holds a run without {LAST}, so --resume auto has nothing to continue"
        hint = f"resume from its {BEST} with --resume {out_dir / BEST}, "
    else:
        why = f"holds another run than the checkpoint {resume}"
    raise RunExistsError(
        f"{out_dir} {why} ({names}); {hint}replace it with --overwrite, or choose another "
        "--train.out_dir"
    )


def clear_run_dir(
    out_dir: str | Path, *, resume: str | os.PathLike[str] | None, overwrite: bool
) -> None:
    """Right before the first write: :func:`check_run_dir`, then delete the old run's files
    (``overwrite``) and temporaries a killed write left."""
    out_dir = Path(out_dir)
    previous = check_run_dir(out_dir, resume=resume, overwrite=overwrite)
    if overwrite and not continues_run(out_dir, resume):
        for path in previous:
            path.unlink(missing_ok=True)
    for path in (p for name in RUN_FILES for p in out_dir.glob(f".{name}.*.tmp")):
        path.unlink(missing_ok=True)


def _holder(out_dir: Path) -> dict | None:
    """The lock's record while another live process (or another host) holds it, else None."""
    try:
        record = json.loads((out_dir / LOCK_NAME).read_text(encoding="utf-8"))
        pid = int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if record.get("host") != socket.gethostname():
        return record  # another machine's: whether it lives cannot be told from here
    if pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    return record


def check_not_in_use(out_dir: str | Path) -> None:
    """Refuse ``out_dir`` while another live process writes it (:func:`hold_run_folder`)."""
    out_dir = Path(out_dir)
    if (record := _holder(out_dir)) is not None:
        raise RunExistsError(
            f"{out_dir} is in use by another dualseg run (process {record.get('pid')} on "
            f"{record.get('host')}); wait for it to end or choose another folder (if no run is "
            f"using it, delete {out_dir / LOCK_NAME})"
        )


@contextlib.contextmanager
def hold_run_folder(out_dir: str | Path) -> Iterator[None]:
    """Hold ``out_dir`` (created if needed) while the block runs; re-entrant in one process."""
    out_dir = Path(out_dir)
    check_not_in_use(out_dir)
    lock = out_dir / LOCK_NAME
    record = {"pid": os.getpid(), "host": socket.gethostname()}
    try:
        mine = json.loads(lock.read_text(encoding="utf-8")) == record
    except (OSError, ValueError):
        mine = False
    if mine:  # an outer block of this process holds it (the demo around fit)
        yield
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    lock.unlink(missing_ok=True)  # stale: its process ended
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:  # another process took it between the check and here
        check_not_in_use(out_dir)
        raise
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(record, f)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


class CheckpointClock:
    """Says when ``last.pt`` is due: every ``every`` iterations or ``minutes`` of wall clock."""

    def __init__(self, every: int, minutes: float | None) -> None:
        self.every, self.seconds = every, None if minutes is None else 60.0 * minutes
        self.saved()

    def due(self, iteration: int) -> bool:
        if iteration % self.every == 0:
            return True
        return self.seconds is not None and time.monotonic() - self._last >= self.seconds

    def saved(self) -> None:
        self._last = time.monotonic()
