"""``dualseg train``: train from a YAML config plus ``--section.field`` overrides.

``--resume PATH`` without ``--config`` reads the run's ``config.yaml`` beside ``PATH``, else the
config stored in the checkpoint. Exit status 0 when the run finished, 130 / 143 after SIGINT /
SIGTERM (a checkpoint was saved first; ``--resume auto`` continues).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from dualseg.engine.checkpoint import load_checkpoint
from dualseg.engine.config import parse_command
from dualseg.engine.train import fit
from dualseg.errors import ConfigError
from dualseg.io import atomic_write_json


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --help exits here and bad flags raise ConfigError, before torch is imported
    cfg, resume, flags = parse_command(argv)
    # a stored train.quiet is how that run's command was run: this command's own is kept
    quiet = cfg.train.quiet
    if resume not in (None, "auto") and not any(a.startswith("--config") for a in argv):
        # `dualseg train --resume runs/x/last.pt`: the run's own resolved config, then flags
        base = resume_base_config(Path(resume))
        cfg, resume, flags = parse_command(["--config", base, *argv])
        folder = Path(resume).parent
        # a moved run folder's config.yaml still names the old place: the run goes on here
        # unless a flag or section file names another
        stored_out = None
        if Path(base) == folder / "config.yaml":
            stored_out = parse_command(["--config", base])[0].train.out_dir
        if stored_out == cfg.train.out_dir and Path(stored_out).resolve() != folder.resolve():
            print(
                f"dualseg train: note: {base} names train.out_dir {stored_out}; the run "
                f"goes on in {folder}, the checkpoint's folder (--train.out_dir chooses another)",
                file=sys.stderr,
            )
            argv = [*argv, "--train.out_dir", str(folder)]
            cfg, resume, flags = parse_command(["--config", base, *argv])
    elif resume == "auto" and not any(a.startswith("--config") for a in argv):
        # `dualseg train --resume auto --train.out_dir runs/x`: that run's own config, if any
        run_config = Path(cfg.train.out_dir) / "config.yaml"
        if run_config.is_file():
            cfg, resume, flags = parse_command(["--config", str(run_config), *argv])
    if cfg.train.quiet != quiet:
        cfg = replace(cfg, train=replace(cfg.train, quiet=quiet))

    started = time.perf_counter()
    summary = fit(cfg, resume=resume, overwrite=flags["overwrite"])
    summary["seconds"] = round(time.perf_counter() - started, 1)
    if summary.get("rank", 0) == 0:
        atomic_write_json(Path(summary["out_dir"]) / "summary.json", summary)
        text = format_summary(summary, has_val=bool(cfg.data.val_split))
        print(json.dumps(summary) if flags["json"] else text)
    if summary["stop_reason"] == "interrupted":
        return 128 + int(summary.get("signal", signal.SIGINT))
    return 0


def resume_base_config(checkpoint: Path) -> str:
    """The ``--config`` of ``--resume CHECKPOINT`` without one: the ``config.yaml`` beside it,
    else the config stored in the checkpoint (as YAML text, which ``--config`` reads too)."""
    run_config = checkpoint.parent / "config.yaml"
    if run_config.is_file():
        return str(run_config)

    stored = load_checkpoint(checkpoint).get("config")
    if not isinstance(stored, dict) or not stored:
        raise ConfigError(
            f"{checkpoint} stores no config and has no config.yaml beside it: pass the run's "
            "config with --config FILE"
        )
    sections = {k: v for k, v in stored.items() if k in ("data", "model", "optim", "train")}
    return yaml.safe_dump(sections, sort_keys=False)


STOP_REASONS = {
    "max_iters": "reached train.max_iters",
    "patience": "stopped early: no improvement for train.patience evaluations",
    "interrupted": "interrupted; continue with --resume auto",
}


def format_summary(summary: dict[str, Any], *, has_val: bool = True) -> str:
    """The lines a person reads at the end of a run (``fit``'s summary dict)."""
    out = summary["out_dir"]
    lines = [
        f"training done: {summary['iteration']} iterations in {summary.get('seconds', 0):.0f} s "
        f"({STOP_REASONS.get(summary['stop_reason'], summary['stop_reason'])})"
    ]
    if summary.get("best_miou") is not None:
        where = summary["best"] or "the best.pt of the run resumed from (none here yet)"
        lines.append(
            f"best validation mIoU {100 * summary['best_miou']:.1f}% at iteration "
            f"{summary['best_iteration']}: {where}"
        )
    elif has_val:  # e.g. interrupted before the first train.val_every
        lines.append("no validation yet")
    else:
        lines.append("no validation ran (data.val_split is null)")
    lines.append(f"last checkpoint: {summary['last']}")
    lines.append(f"run folder: {out} (config.yaml, metrics.jsonl, curves.png, summary.json)")
    best = summary.get("best") or summary["last"]
    lines.append(f"next: dualseg eval -c {best} --data DATA_ROOT")
    return "\n".join(lines)
