"""Flags shared by the commands that run a model: ``--device``, ``--threads``, ``--amp``,
``--quiet`` — added by one helper so that every command spells and means them the same way.

``dualseg train`` has the same three as config fields (``--train.device``, ``--train.threads``,
``--train.amp``), since a run's YAML records them.
"""

from __future__ import annotations

import argparse
from typing import Any

from dualseg.console import ProgressMode, progress_mode

__all__ = ["add_quiet_arg", "add_runtime_args", "apply_runtime", "autocast", "mode_of"]

DEVICE_HELP = "auto | cpu | cuda | cuda:N (auto: CUDA when available)"


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
