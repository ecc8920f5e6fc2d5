"""Run bookkeeping of ``fit``: signals (:class:`Interrupt`), loop state saved in checkpoints
(:class:`Progress`) and the rank-0 outputs (:class:`RunLog`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import signal
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from dualseg.engine.distributed import DistEnv
from dualseg.engine.options import Config
from dualseg.io import atomic_write_text
from dualseg.viz import save_curves as draw


class Interrupt:
    """Turns SIGINT / SIGTERM into a flag checked after each step (then save and return)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __call__(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> Interrupt:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: leave handlers alone
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclass
class Progress:
    """Loop state beyond weights: best score, patience counter, smoothed loss."""

    best_miou: float = -1.0
    best_iteration: int = 0
    best_monitored: float | None = None
    bad_evals: int = 0
    loss_ema: float | None = None
    last_val: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "last_val"}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        for key, value in d.items():
            setattr(self, key, value)

    def update_monitor(self, value: float, *, higher_is_better: bool, min_delta: float) -> bool:
        """Record one evaluation of the monitored quantity; True when it improved. A NaN (no
        labelled pixel) is no evaluation: it neither becomes the best nor spends patience."""
        if math.isnan(value):
            return False
        best = self.best_monitored
        improved = (
            best is None
            or (higher_is_better and value > best + min_delta)
            or (not higher_is_better and value < best - min_delta)
        )
        if improved:
            self.best_monitored, self.bad_evals = value, 0
        else:
            self.bad_evals += 1
        return improved


class RunLog:
    """Rank-0 outputs: JSONL records, TensorBoard scalars, a tqdm bar or plain lines."""

    def __init__(self, cfg: Config, env: DistEnv, out_dir: Path, start: int) -> None:
        self.enabled, self.quiet = env.is_main, cfg.train.quiet
        self.path, self.tb, self.bar = out_dir / "metrics.jsonl", None, None
        if not self.enabled:
            return
        if self.path.exists():  # records past the resumed checkpoint: dropped
            keep = [r for r in self.history() if r.get("iteration", 0) <= start]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in keep))
        if cfg.train.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir), purge_step=start or None)
            except ImportError:
                print(
                    "dualseg train: warning: tensorboard is not installed, so no event files are "
                    "written (pip install tensorboard, or --train.tensorboard false)",
                    file=sys.stderr,
                )
        if cfg.train.progress and not self.quiet and sys.stderr.isatty():
            self.bar = tqdm(total=cfg.train.max_iters, initial=start, desc="train", unit="it")

    def history(self) -> list[dict[str, Any]]:
        records = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    records.append(json.loads(line))
        return records

    def write(self, record: dict[str, Any], *, echo: str | None = None) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if key != "iteration" and isinstance(value, int | float):
                    self.tb.add_scalar(key.replace("_", "/", 1), value, record["iteration"])
        if echo:
            self.message(echo)

    def step(self, **postfix: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix({k: f"{v:.4f}" for k, v in postfix.items()}, refresh=False)

    def message(self, text: str, *, always: bool = False) -> None:
        """A log line; ``always``: said even with ``train.quiet`` (then on stderr)."""
        if not self.enabled or (self.quiet and not always):
            return
        if self.quiet:
            print(text, file=sys.stderr, flush=True)
        elif self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


def train_data_record(samples: list[tuple[Path, Path]]) -> dict[str, Any]:
    """The training pairs' count and a digest of their file names (a resume on changed data
    says so)."""
    names = "\n".join(f"{img.name}\t{label.name}" for img, label in samples)
    return {"pairs": len(samples), "digest": hashlib.sha1(names.encode("utf-8")).hexdigest()}


def save_curves(path: Path, history: list[dict[str, Any]]) -> None:
    """PNG of the loss terms and validation scores; skipped when nothing was logged."""
    if not history:
        return

    keys: list[Any] = [("loss", "l1", "loss_ema"), "l2"]
    ylabels = ["loss", "L2 weight penalty"]  # L2 on its own axis: it is orders smaller
    val = ("val_miou", "val_trimap_miou", "val_boundary_f1")
    if any("val_miou" in r for r in history):
        keys.append(val)
        ylabels.append("validation score (%)")
    names = {"l1": "L1 (cross-entropy)", "loss_ema": "loss (smoothed)", "l2": "L2"}
    names |= {"val_miou": "mIoU", "val_trimap_miou": "trimap mIoU", "val_boundary_f1": "bF1"}
    draw(path, history, keys, x_key="iteration", title="training", ylabels=ylabels,
         scale=dict.fromkeys(val, 100.0), names=names)  # fmt: skip
