"""The run folder of ``fit``: never replace a run by accident, clean up after kills, save often.

- :func:`check_run_dir`: refuse a folder that already holds a run unless the caller resumes
  it or asked to overwrite it; check that it is writable. It changes nothing, so ``fit`` runs
  it first, before any other work.
- :func:`prepare_run_dir`: the same checks, then, on the main process, the cleaning: with
  ``overwrite`` the old run's files are removed (so no stale ``best.pt`` survives), and the
  temporaries a killed checkpoint write left behind (``.last.pt.*.tmp``, see
  :func:`dualseg.io.atomic_open`). ``fit`` runs it right before its first write, once the
  data, the model and everything else that can fail on user input have passed, so a failed
  ``--overwrite`` keeps the old run.
- :class:`CheckpointClock`: when ``last.pt`` is due — every ``ckpt_every`` iterations and, by
  default, every ``ckpt_minutes`` of wall clock — so a kill loses little even with
  ``val_every 0``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from dualseg.errors import RunExistsError
from dualseg.io import check_writable

__all__ = [
    "FALLBACK_CKPT_EVERY",
    "RUN_FILES",
    "CheckpointClock",
    "check_run_dir",
    "checkpoint_interval",
    "prepare_run_dir",
    "remove_stale_temporaries",
    "run_files",
]

# The files a run writes into its folder (TensorBoard's events.out.* come on top); summary.json
# is written by `dualseg train` at the end.
RUN_FILES = ("last.pt", "best.pt", "metrics.jsonl", "config.yaml", "curves.png", "summary.json")
EVENTS_GLOB = "events.out.tfevents.*"
FALLBACK_CKPT_EVERY = 1000  # iterations between checkpoints when neither interval is set


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


def check_run_dir(out_dir: str | Path, *, resuming: bool, overwrite: bool) -> list[Path]:
    """Check ``out_dir`` without changing it; return the files of the run it holds.

    Raises :class:`RunExistsError` when it holds a run and neither ``resuming`` nor
    ``overwrite`` is set, :class:`dualseg.errors.OutputError` when it cannot be written.
    """
    out_dir = Path(out_dir)
    check_writable(out_dir, kind="dir", what="train.out_dir")
    previous = run_files(out_dir) if out_dir.is_dir() else []
    if previous and not resuming and not overwrite:
        names = ", ".join(p.name for p in previous[:4]) + (" ..." if len(previous) > 4 else "")
        raise RunExistsError(
            f"{out_dir} already holds a run ({names}); continue it with --resume auto, "
            "replace it with --overwrite, or choose another --train.out_dir"
        )
    return previous


def prepare_run_dir(
    out_dir: str | Path, *, resuming: bool, overwrite: bool, is_main: bool = True
) -> None:
    """:func:`check_run_dir`, then, on the main process, clean ``out_dir`` as requested: the
    old run's files with ``overwrite`` (not when resuming), and stale temporaries.

    Call it right before the first write, after everything that can fail on user input.
    """
    out_dir = Path(out_dir)
    previous = check_run_dir(out_dir, resuming=resuming, overwrite=overwrite)
    if not is_main:
        return
    if overwrite and not resuming:
        for path in previous:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    if out_dir.is_dir():
        remove_stale_temporaries(out_dir)


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
