"""``dualseg train``: train from a YAML config plus command-line overrides.

    dualseg train --config configs/camvid_mobilenet_v2.yaml --optim.lr 0.01 --train.max_iters 100
    dualseg train --config configs/camvid_mobilenet_v2.yaml --resume auto
    dualseg train --resume runs/camvid_mobilenet_v2/last.pt --train.max_iters 30000
    dualseg train --config configs/camvid_mobilenet_v2.yaml --overwrite   # replace the old run
    torchrun --nproc_per_node=2 -m dualseg train --config configs/camvid_resnet101.yaml

Every field of :mod:`dualseg.engine.config` is a flag (``dualseg train --help`` lists them).
``--resume PATH`` without ``--config`` reads the run's ``config.yaml`` beside ``PATH`` first.
An ``out_dir`` that already holds a run is refused unless ``--resume`` or ``--overwrite`` is
given. Before step 1 every pair is scanned (``--data.check false`` skips it).
Exit status: 0 when the run finished (max iterations or patience), 130 after SIGINT and 143
after SIGTERM (a checkpoint was saved first; ``--resume auto`` continues).
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from dualseg.engine.config import parse_run_args

    argv = list(sys.argv[1:] if argv is None else argv)
    # --help exits here and bad flags raise ConfigError, before torch is imported
    cfg, resume, overwrite = parse_run_args(argv)
    if resume not in (None, "auto") and not any(a.startswith("--config") for a in argv):
        # `dualseg train --resume runs/x/last.pt`: the run's own resolved config, then flags.
        run_config = Path(resume).parent / "config.yaml"
        if run_config.is_file():
            cfg, resume, overwrite = parse_run_args(["--config", str(run_config), *argv])

    from dualseg.engine.train import fit

    summary = fit(cfg, resume=resume, overwrite=overwrite)
    if summary.get("rank", 0) == 0:
        print(json.dumps(summary))
    if summary["stop_reason"] == "interrupted":
        return 128 + int(summary.get("signal", signal.SIGINT))
    return 0
