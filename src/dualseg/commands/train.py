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
from pathlib import Path
from typing import Any

from dualseg.engine.preflight import train_command
from dualseg.engine.train import fit
from dualseg.io import atomic_write_json


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg, resume, flags = train_command(argv)  # --help exits here, a bad flag is one line
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
