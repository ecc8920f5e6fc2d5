"""The run folder of ``fit``: never replace a run by accident, clean up after kills, save often.

- :func:`check_run_dir`: refuse a folder that already holds a run unless the caller continues
  that very run (``--resume auto`` finding its ``last.pt``, or ``--resume`` of its own
  ``last.pt`` / ``best.pt``: :func:`continues_run`) or asked to overwrite it; check that it is
  writable. It changes nothing, so ``fit`` runs it first, before any other work.
- :func:`prepare_run_dir`: the same checks, then, on the main process, the cleaning: with
  ``overwrite`` (unless continuing the folder's own run) the old run's files are set aside in
  :data:`REPLACED_DIR` (so no stale ``best.pt`` mixes with the new run — also when the new run
  resumes another run's checkpoint), and the temporaries a killed checkpoint write left
  behind (``.last.pt.*.tmp``, see :func:`dualseg.io.atomic_open`) are removed. ``fit`` runs it
  right before its first write, once the data, the model and everything else that can fail on
  user input have passed.
- :func:`restore_replaced` / :func:`discard_replaced`: the set-aside run comes back when the
  new one fails before its first checkpoint (a bad label met in training with
  ``data.check false``, out of memory, a NaN at the first step), and is deleted once the new
  one has a checkpoint: an ``--overwrite`` never leaves a folder with neither run.
- :func:`hold_run_folder` / :func:`check_not_in_use`: one process at a time writes a folder
  (:data:`LOCK_NAME` holds its pid): a second run into it is refused, where two mixed their
  files (one's config beside the other's checkpoint).
- :class:`CheckpointClock`: when ``last.pt`` is due — every ``ckpt_every`` iterations and, by
  default, every ``ckpt_minutes`` of wall clock — so a kill loses little even with
  ``val_every 0``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from dualseg.errors import RunExistsError
from dualseg.io import check_writable

__all__ = [
    "FALLBACK_CKPT_EVERY",
    "LOCK_NAME",
    "REPLACED_DIR",
    "RUN_FILES",
    "CheckpointClock",
    "check_not_in_use",
    "check_run_dir",
    "checkpoint_interval",
    "continues_run",
    "discard_replaced",
    "hold_run_folder",
    "prepare_run_dir",
    "remove_stale_temporaries",
    "restore_replaced",
    "run_files",
]

# The files a run writes into its folder (TensorBoard's events.out.* come on top); summary.json
# is written by `dualseg train` at the end.
RUN_FILES = ("last.pt", "best.pt", "metrics.jsonl", "config.yaml", "curves.png", "summary.json")
LAST, BEST = RUN_FILES[:2]  # the run's checkpoints (dualseg.engine.checkpoint.LAST_NAME, BEST_NAME)
AUTO = "auto"  # --resume auto: the folder's own last.pt when there is one, else a new run
EVENTS_GLOB = "events.out.tfevents.*"
FALLBACK_CKPT_EVERY = 1000  # iterations between checkpoints when neither interval is set
# an --overwrite's old run waits here (renamed, same filesystem) for the new run's first checkpoint
REPLACED_DIR = ".replaced"
# the process writing the folder now: {"pid", "host", "started"} (see hold_run_folder)
LOCK_NAME = ".dualseg.lock"
LOCK_BEAT_S = 60.0  # how often the holder touches it
LOCK_STALE_S = 600.0  # another machine's lock untouched this long: its run was killed


def _process_start(pid: int) -> str | None:
    """When ``pid`` started (Linux: /proc's clock ticks), telling a live holder from a later
    process that got its pid; None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22, counted after the command name


def _holder(out_dir: Path) -> dict | None:
    """The lock's record when a live process other than this one holds it, else None (no lock,
    a stale one of a process that ended, or this process's own)."""
    try:
        record = json.loads((out_dir / LOCK_NAME).read_text(encoding="utf-8"))
        pid = int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if record.get("host") != socket.gethostname():
        # another machine's process (a shared disk): it runs while it keeps the lock fresh
        try:
            age = time.time() - (out_dir / LOCK_NAME).stat().st_mtime
        except OSError:
            return None
        return record if age < LOCK_STALE_S else None
    if pid == os.getpid():
        return None  # this process, or (another start time) a killed one whose pid it got
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None  # it ended without removing the lock (killed)
    except PermissionError:
        pass  # alive, another user's
    started = record.get("started")
    if started is not None and _process_start(pid) not in (None, started):
        return None  # its pid now belongs to another process
    return record


def check_not_in_use(out_dir: str | Path) -> None:
    """Refuse ``out_dir`` while another live process writes it (:func:`hold_run_folder`)."""
    out_dir = Path(out_dir)
    record = _holder(out_dir)
    if record is not None:
        raise RunExistsError(
            f"{out_dir} is in use by another dualseg run (process {record.get('pid')} on "
            f"{record.get('host')}); wait for it to end or choose another folder (if no run is "
            f"using it, delete {out_dir / LOCK_NAME})"
        )


@contextlib.contextmanager
def hold_run_folder(out_dir: str | Path) -> Iterator[None]:
    """Hold ``out_dir`` (created if needed) for this process while the block runs: another
    process that tries meanwhile is refused (:func:`check_not_in_use`). Re-entrant within one
    process (the demo holds its folder around ``fit``, which holds it too); a lock left by a
    killed process is taken over."""
    out_dir = Path(out_dir)
    check_not_in_use(out_dir)
    lock = out_dir / LOCK_NAME
    pid = os.getpid()
    record = {"pid": pid, "host": socket.gethostname(), "started": _process_start(pid)}
    try:
        held = json.loads(lock.read_text(encoding="utf-8"))
        mine = all(held.get(k) == v for k, v in record.items())  # same pid, host and start
    except (OSError, ValueError, AttributeError):
        mine = False
    if mine:  # held by an outer block of this process
        yield
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    lock.unlink(missing_ok=True)  # stale: its process ended (or another got its pid)
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:  # another process took it between the check and here
        check_not_in_use(out_dir)
        raise
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(record, f)
    stop = threading.Event()
    beat = threading.Thread(target=_keep_fresh, args=(lock, stop), daemon=True)
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
        lock.unlink(missing_ok=True)


def _keep_fresh(lock: Path, stop: threading.Event) -> None:
    """Touch the lock every LOCK_BEAT_S until ``stop``: another machine sharing the disk takes
    a lock left untouched for LOCK_STALE_S as a killed run's (a job requeued on another node
    resumes by itself)."""
    while not stop.wait(LOCK_BEAT_S):
        with contextlib.suppress(OSError):
            os.utime(lock)


def run_files(out_dir: Path) -> list[Path]:
    """The files of a previous run in ``out_dir``."""
    files = [out_dir / name for name in RUN_FILES if (out_dir / name).exists()]
    return files + sorted(out_dir.glob(EVENTS_GLOB))


def remove_stale_temporaries(out_dir: Path) -> list[Path]:
    """Delete the temporaries of this run's files that a killed write left; return them."""
    stale = [p for name in RUN_FILES for p in out_dir.glob(f".{name}.*.tmp")]
    for path in stale:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return stale


def continues_run(out_dir: str | Path, resume: str | os.PathLike[str] | None) -> bool:
    """Whether ``--resume resume`` continues the run in ``out_dir``: ``"auto"`` with a
    ``last.pt`` there, or a path that is the folder's own ``last.pt`` or ``best.pt`` (resolved:
    links and ``..`` do not matter)."""
    out_dir = Path(out_dir)
    if resume is None:
        return False
    if resume == AUTO:
        return (out_dir / LAST).is_file()
    own = {(out_dir / name).resolve() for name in (LAST, BEST)}
    return Path(resume).resolve() in own


def check_run_dir(
    out_dir: str | Path, *, resume: str | os.PathLike[str] | None, overwrite: bool
) -> list[Path]:
    """Check ``out_dir`` without changing it; return the files of the run it holds.

    ``resume``: ``None``, ``"auto"`` or a checkpoint path (``fit``'s). Raises
    :class:`RunExistsError` when ``out_dir`` holds a run, ``overwrite`` is not set and
    ``resume`` does not continue that run (:func:`continues_run`): no resume; ``--resume auto``
    in a folder without ``last.pt``; another run's checkpoint. Raises
    :class:`dualseg.errors.OutputError` when it cannot be written.
    """
    out_dir = Path(out_dir)
    check_writable(out_dir, kind="dir", what="train.out_dir")
    previous = run_files(out_dir) if out_dir.is_dir() else []
    # a run an --overwrite set aside (REPLACED_DIR) is a run too, until a checkpoint replaces it
    shown = list(previous)
    if (out_dir / REPLACED_DIR).is_dir():
        shown.append(out_dir / REPLACED_DIR)
    if not shown or overwrite or continues_run(out_dir, resume):
        return previous
    names = ", ".join(p.name for p in shown[:4]) + (" ..." if len(shown) > 4 else "")
    aside = out_dir / REPLACED_DIR
    if resume in (None, AUTO) and aside.is_dir() and not (out_dir / LAST).is_file():
        # an --overwrite stopped before its first checkpoint: the run it was replacing is whole
        # in REPLACED_DIR, and the advice to --overwrite again would discard it
        kept = ", ".join(sorted(p.name for p in aside.iterdir())[:4])
        raise RunExistsError(
            f"{out_dir} holds an --overwrite that stopped before its first checkpoint; the run "
            f"it replaced is kept whole in {aside} ({kept}): to go on with that run, move its "
            f"files back (mv {aside}/* {out_dir}/) and --resume auto; to start over, "
            "--overwrite (which discards it), or choose another --train.out_dir"
        )
    if resume is None:
        if not any((out_dir / name).is_file() for name in (LAST, BEST)):
            # stopped before its first checkpoint (a failure at start-up): nothing to continue
            raise RunExistsError(
                f"{out_dir} holds a run that stopped before its first checkpoint ({names}); "
                "replace it with --overwrite, or choose another --train.out_dir"
            )
        raise RunExistsError(
            f"{out_dir} already holds a run ({names}); continue it with --resume auto, "
            "replace it with --overwrite, or choose another --train.out_dir"
        )
    if resume == AUTO:
        best = out_dir / BEST
        hint = f"resume from its {BEST} with --resume {best}, " if best.is_file() else ""
        raise RunExistsError(
            f"{out_dir} holds a run without {LAST} ({names}), so --resume auto has nothing to "
            f"continue: {hint}replace the run with --overwrite, or choose another --train.out_dir"
        )
    raise RunExistsError(
        f"{out_dir} holds another run ({names}) than the checkpoint {resume}: to resume {resume} "
        f"choose another --train.out_dir, or replace {out_dir}'s run with --overwrite"
    )


def prepare_run_dir(
    out_dir: str | Path,
    *,
    resume: str | os.PathLike[str] | None,
    overwrite: bool,
    is_main: bool = True,
) -> Path | None:
    """:func:`check_run_dir`, then, on the main process, clean ``out_dir`` as requested: with
    ``overwrite``, unless ``resume`` continues the folder's own run (:func:`continues_run`:
    then ``overwrite`` changes nothing), the old run's files move into
    ``out_dir/REPLACED_DIR``, whose path is returned (None when nothing is set aside there) —
    also when the new run resumes another run's checkpoint; stale temporaries are removed.

    Call it right before the first write, after everything that can fail on user input
    (``fit`` has loaded the checkpoint by then); then :func:`discard_replaced` after the new
    run's first checkpoint, or :func:`restore_replaced` when it fails before one.
    """
    out_dir = Path(out_dir)
    previous = check_run_dir(out_dir, resume=resume, overwrite=overwrite)
    if not is_main:
        return None
    replaced = out_dir / REPLACED_DIR
    if overwrite and not continues_run(out_dir, resume):
        replaced = _set_aside(out_dir, previous)
    elif not replaced.is_dir():  # continuing beside one killed before its first checkpoint: kept
        replaced = None
    if out_dir.is_dir():
        remove_stale_temporaries(out_dir)
    return replaced


def _set_aside(out_dir: Path, previous: list[Path]) -> Path | None:
    backup = out_dir / REPLACED_DIR
    if backup.is_dir():
        # an earlier --overwrite was killed before its first checkpoint: the run set aside
        # then is the one to keep, and the files beside it are that attempt's
        for path in previous:
            path.unlink(missing_ok=True)
        return backup
    if not previous:
        return None
    backup.mkdir()
    for path in previous:
        os.replace(path, backup / path.name)
    return backup


def restore_replaced(out_dir: str | Path, replaced: Path) -> None:
    """Put the run :func:`prepare_run_dir` set aside back, removing the failed new run's files."""
    out_dir = Path(out_dir)
    for path in run_files(out_dir):
        path.unlink(missing_ok=True)
    for path in replaced.iterdir():
        os.replace(path, out_dir / path.name)
    replaced.rmdir()


def discard_replaced(replaced: Path) -> None:
    """Delete the run set aside by an ``--overwrite``: the new run has its first checkpoint."""
    shutil.rmtree(replaced, ignore_errors=True)


def checkpoint_interval(ckpt_every: int | None, val_every: int) -> int:
    """Iterations between ``last.pt`` saves: ``ckpt_every``, else ``val_every``, else 1000."""
    return ckpt_every or val_every or FALLBACK_CKPT_EVERY


class CheckpointClock:
    """Says when ``last.pt`` is due: every ``every`` iterations or ``minutes`` of wall clock."""

    def __init__(
        self,
        every: int,
        minutes: float | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every = int(every)
        self.seconds = None if minutes is None else 60.0 * float(minutes)
        self._clock = clock
        self._last = clock()

    def due(self, iteration: int) -> bool:
        if iteration % self.every == 0:
            return True
        return self.seconds is not None and self._clock() - self._last >= self.seconds

    def saved(self) -> None:
        """Record that a checkpoint was just written."""
        self._last = self._clock()
