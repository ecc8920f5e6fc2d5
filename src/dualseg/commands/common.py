"""Flags shared by the commands that run a model: ``--device``, ``--threads``, ``--amp``,
``--quiet`` — added by one helper so that every command spells and means them the same way.

``dualseg train`` has the same three as config fields (``--train.device``, ``--train.threads``,
``--train.amp``), since a run's YAML records them.
"""

from __future__ import annotations

import argparse
from typing import Any

from dualseg.console import ProgressMode, progress_mode

__all__ = [
    "add_quiet_arg",
    "add_runtime_args",
    "apply_runtime",
    "autocast",
    "fraction",
    "mode_of",
    "nonnegative_int",
]

DEVICE_HELP = "auto | cpu | cuda | cuda:N (auto: CUDA when available)"


def nonnegative_int(text: str) -> int:
    """argparse ``type=``: an integer >= 0 (``--workers``, pixel widths), refused at parsing."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def fraction(text: str) -> float:
    """argparse ``type=``: a number in [0, 1] (``--alpha``), refused at parsing, so that no
    output is written before a bad value is noticed."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # also NaN
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def add_runtime_args(p: argparse.ArgumentParser, *, device: str = "auto") -> None:
    """``--device`` (default ``device``), ``--threads`` (0) and ``--amp`` (off)."""
    g = p.add_argument_group("device")
    g.add_argument("--device", default=device, help=f"{DEVICE_HELP} ({device})")
    g.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0: torch's default, one per core)",
    )
    g.add_argument("--amp", action="store_true", help="bf16 autocast on CUDA (off; CPU: ignored)")


def add_quiet_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="no progress output (default: bars on a terminal, a plain line every 30 s in a log)",
    )


def apply_runtime(args: argparse.Namespace) -> Any:
    """Apply ``--threads`` and return the resolved ``--device`` (a ``torch.device``)."""
    import torch

    from dualseg.engine.predict import resolve_device

    if args.threads < 0:
        from dualseg.errors import ConfigError

        raise ConfigError(f"--threads must be >= 0 (0: torch's default), got {args.threads}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return resolve_device(args.device)


def mode_of(args: argparse.Namespace) -> ProgressMode:
    """The progress mode of a command run with these arguments (see :mod:`dualseg.console`)."""
    return progress_mode(getattr(args, "quiet", False))


def autocast(args: argparse.Namespace, device: Any) -> Any:
    """``--amp``: a bf16 autocast context on CUDA; a no-op context otherwise."""
    import contextlib

    import torch

    if args.amp and device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
