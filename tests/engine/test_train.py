"""Training loop: run folder, CLI overrides, stopping, signals, NaN stop, resume after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dualseg.commands.train import main as train_main
from dualseg.data import SegmentationDataset, make_synthetic_dataset
from dualseg.engine.checkpoint import load_checkpoint
from dualseg.engine.config import load_config
from dualseg.engine.options import Config
from dualseg.engine.train import TrainingDivergedError, fit
from dualseg.errors import CheckpointError, ConfigError, RunExistsError

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_synthetic.yaml"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("synthetic")
    return make_synthetic_dataset(root, n_train=6, n_val=2, size=(36, 44), seed=0)


def tiny(data: Path, out: Path, *, data_cfg: dict | None = None, **train: Any) -> Config:
    """The tiny config on ``data``, writing to ``out``, with ``train`` overrides."""
    data_section = {"root": str(data), "crop_size": [32, 32], **(data_cfg or {})}
    return load_config(TINY, data=data_section, train={"out_dir": str(out), **train})


def test_cli_run_writes_the_run_folder(data: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["--config", str(TINY), "--data.root", str(data), "--data.crop_size", "[32,32]"]
    argv += ["--train.out_dir", str(out), "--optim.lr", "0.02", "--train.max_iters", "4"]
    argv += ["--train.val_every", "2", "--train.tensorboard", "true", "--json"]
    assert train_main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["iteration"] == 4 and summary["stop_reason"] == "max_iters"

    # The resolved config, with the overrides, reads back as the same run.
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["optim"]["lr"] == 0.02 and resolved["train"]["max_iters"] == 4
    assert load_config(out / "config.yaml").optim.lr == 0.02

    ckpt = load_checkpoint(out / "last.pt")
    expected_keys = {"format", "version", "arch", "model_kwargs", "model", "optimizer"}
    expected_keys |= {"scheduler", "scaler", "iteration", "epoch", "sampler", "rng", "config"}
    expected_keys |= {"class_names", "palette", "ignore_index", "metrics"}
    assert expected_keys <= set(ckpt)
    assert ckpt["iteration"] == 4 and ckpt["arch"] == "dualseg_mobilenet_v2"
    assert ckpt["model_kwargs"] == {"num_classes": 8, "renet_hidden": 8}
    assert ckpt["metrics"]["iteration"] == 4 and 0.0 <= ckpt["metrics"]["miou"] <= 1.0
    assert (out / "best.pt").is_file() and (out / "curves.png").stat().st_size > 1000
    assert list(out.glob("events.out.tfevents.*"))  # TensorBoard is installed here

    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["iteration"] for r in steps] == [1, 2, 3, 4]
    for r in steps:  # L1, L2 and L logged separately, L = L1 + L2
        assert r["loss"] == pytest.approx(r["l1"] + r["l2"], rel=1e-5) and r["l2"] > 0
    assert steps[1]["lr"] < steps[0]["lr"]  # poly decay
    assert [r["iteration"] for r in records if "val_miou" in r] == [2, 4]


def test_patience_on_smoothed_training_loss(data: Path, tmp_path: Path) -> None:
    # min_delta larger than any possible improvement: the 2nd and 3rd evaluations are "bad".
    settings = {"max_iters": 50, "val_every": 1, "monitor": "train_loss", "patience": 2}
    cfg = tiny(data, tmp_path, data_cfg={"val_split": None}, min_delta=1e3, **settings)
    summary = fit(cfg)
    assert summary["stop_reason"] == "patience" and summary["iteration"] == 3
    assert load_checkpoint(tmp_path / "last.pt")["iteration"] == 3
    assert not (tmp_path / "best.pt").exists()  # no validation split, no best checkpoint


def test_a_run_stopped_on_patience_resumes_to_the_same_stop(data: Path, tmp_path: Path) -> None:
    settings = {"max_iters": 50, "val_every": 1, "monitor": "train_loss", "patience": 2}
    cfg = tiny(data, tmp_path, data_cfg={"val_split": None}, min_delta=1e3, **settings)
    assert fit(cfg)["iteration"] == 3
    before = (tmp_path / "last.pt").read_bytes()
    again = fit(cfg, resume="auto")  # same patience: it stopped, and stays stopped
    assert again["stop_reason"] == "patience" and again["iteration"] == 3
    assert (tmp_path / "last.pt").read_bytes() == before
    longer = tiny(data, tmp_path, data_cfg={"val_split": None}, min_delta=1e3,
                  **{**settings, "patience": 4})  # fmt: skip
    assert fit(longer, resume="auto")["iteration"] == 5  # raised: it trains on


def test_a_run_that_did_not_stop_on_patience_trains_on_when_patience_is_set(
    data: Path, tmp_path: Path
) -> None:
    settings = {"val_every": 1, "monitor": "train_loss", "min_delta": 1e3}
    free = tiny(data, tmp_path, data_cfg={"val_split": None}, max_iters=4, patience=None,
                **settings)  # fmt: skip
    assert fit(free)["stop_reason"] == "max_iters"  # 3 evaluations without improvement
    watched = tiny(data, tmp_path, data_cfg={"val_split": None}, max_iters=8, patience=2,
                   **settings)  # fmt: skip
    again = fit(watched, resume="auto")  # patience counts from here, it did not stop before
    assert again["stop_reason"] == "patience" and again["iteration"] == 4 + 1


def test_a_setting_changed_on_resume_is_said_even_when_quiet_and_logged(
    data: Path, tmp_path: Path, capsys
) -> None:
    argv = ["--config", str(TINY), "--data.root", str(data), "--data.crop_size", "[32,32]",
            "--train.out_dir", str(tmp_path), "--train.max_iters", "2", "--quiet"]  # fmt: skip
    assert train_main(argv) == 0
    capsys.readouterr()
    assert train_main([*argv, "--resume", "auto", "--train.max_iters", "3"]) == 0
    assert "settings changed since that checkpoint: train.max_iters: 2 -> 3" in (
        capsys.readouterr().err
    )
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (resumed,) = [r for r in records if "changed" in r]
    assert resumed["iteration"] == 2 and resumed["changed"] == {"train.max_iters": [2, 3]}


def test_every_resume_is_marked_in_the_log_and_validations_carry_the_clock(
    data: Path, tmp_path: Path
) -> None:
    """``time`` restarts at 0 in a resumed process: readers add the pieces at each
    ``resumed_from`` record, and a validation's own record says when it ended (else the last
    validation's time is lost)."""
    fit(tiny(data, tmp_path, max_iters=2, val_every=1))
    fit(tiny(data, tmp_path, max_iters=3, val_every=1), resume="auto")
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "resumed_from" in r] == [2]
    vals = {r["iteration"]: r for r in records if "val_miou" in r}
    assert sorted(vals) == [1, 2, 3] and all(r["time"] > 0 for r in vals.values())
    step1 = next(r for r in records if r.get("iteration") == 1 and "loss" in r)
    assert vals[1]["time"] >= step1["time"]  # taken after the validation


def test_best_pt_is_written_before_the_last_pt_that_records_it(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dualseg.engine import train

    order: list[str] = []
    save = train._save
    monkeypatch.setattr(
        train, "_save", lambda run, kind, at: (order.append(kind), save(run, kind, at=at))
    )
    fit(tiny(data, tmp_path, max_iters=2, val_every=2))
    assert order == ["best", "last"]  # a crash between them leaves the previous last.pt


def test_s33_default_stops_when_the_validation_loss_stops_decreasing(
    data: Path, tmp_path: Path
) -> None:
    # S33 default: patience on, monitor "auto" = the validation loss when a val split exists.
    cfg = tiny(data, tmp_path, max_iters=50, val_every=1, min_delta=1e3)
    assert cfg.train.monitor == "auto" and cfg.train.patience == 5
    summary = fit(cfg)
    assert summary["stop_reason"] == "patience" and summary["iteration"] == 6
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["val_loss"] > 0 for r in records if "val_miou" in r)  # watched, and logged


def test_cpu_amp_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    from dualseg.engine import cpu_bf16 as train
    from dualseg.engine.cpu_bf16 import amp_dtype_for as _amp_dtype
    from dualseg.errors import ConfigError

    cpu = torch.device("cpu")
    # auto: bf16 where the CPU computes it natively (AVX-512 BF16 / AMX), else fp32
    for native, expected in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(train, "cpu_has_native_bf16", lambda native=native: native)
        assert _amp_dtype("auto", cpu) is expected
        assert _amp_dtype("none", cpu) is None
    assert _amp_dtype("bf16", cpu) is torch.bfloat16  # opt-in (warns without native bf16)
    with pytest.raises(ConfigError, match="fp16 needs a GPU"):
        _amp_dtype("fp16", cpu)


def test_autocast_training_says_so(data: Path, tmp_path: Path, capsys) -> None:
    fit(tiny(data, tmp_path / "bf16", max_iters=1, val_every=0, amp="bf16"))
    assert "training in bf16 autocast on cpu (train.amp bf16;" in capsys.readouterr().out
    fit(tiny(data, tmp_path / "fp32", max_iters=1, val_every=0, amp="none"))
    assert "training in" not in capsys.readouterr().out


def _patch_samples(monkeypatch: pytest.MonkeyPatch, at: int, action) -> None:
    """Run ``action(sample)`` on the ``at``-th training sample read (1-based)."""
    real = SegmentationDataset.__getitem__
    count = {"n": 0}

    def getitem(self: SegmentationDataset, index: int):
        image, label = real(self, index)
        if image.shape[-1] == 32:  # training crops only (validation images are 44 wide)
            count["n"] += 1
            if count["n"] == at:
                image = action(image)
        return image, label

    monkeypatch.setattr(SegmentationDataset, "__getitem__", getitem)


def test_sigterm_saves_a_checkpoint_and_stops(data: Path, tmp_path: Path, monkeypatch) -> None:
    def terminate(image: torch.Tensor) -> torch.Tensor:
        os.kill(os.getpid(), signal.SIGTERM)
        return image

    _patch_samples(monkeypatch, at=5, action=terminate)  # during the 3rd batch (batch size 2)
    summary = fit(tiny(data, tmp_path, max_iters=100, val_every=0))
    assert summary["stop_reason"] == "interrupted" and summary["signal"] == signal.SIGTERM
    assert summary["iteration"] == 3
    assert load_checkpoint(tmp_path / "last.pt")["iteration"] == 3
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored


def test_nan_loss_stops_and_keeps_last_good_checkpoint(
    data: Path, tmp_path: Path, monkeypatch
) -> None:
    _patch_samples(monkeypatch, at=9, action=lambda image: image * float("nan"))  # 5th batch
    with pytest.raises(TrainingDivergedError, match=r"iteration 5.*last good checkpoint"):
        fit(tiny(data, tmp_path, max_iters=100, val_every=0, ckpt_every=2))
    ckpt = load_checkpoint(tmp_path / "last.pt")
    assert ckpt["iteration"] == 4
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())
    # an --overwrite that diverges before its first checkpoint says it has none; the folder
    # holds that attempt, which a new run without --overwrite is refused
    _patch_samples(monkeypatch, at=3, action=lambda image: image * float("nan"))  # 2nd batch
    with pytest.raises(TrainingDivergedError, match=r"iteration 2.*no checkpoint yet"):
        fit(tiny(data, tmp_path, max_iters=100, val_every=0, ckpt_every=50), overwrite=True)
    assert not (tmp_path / "last.pt").exists()
    with pytest.raises(RunExistsError, match="stopped before its first checkpoint"):
        fit(tiny(data, tmp_path, max_iters=100, val_every=0, ckpt_every=50))


def test_resume_checks_the_model_and_follows_the_new_schedule(
    data: Path, tmp_path: Path, capsys
) -> None:
    fit(tiny(data, tmp_path / "a", max_iters=2, val_every=0))
    data_section = {"root": str(data), "crop_size": [32, 32]}
    other = load_config(
        TINY, data=data_section, model={"arch": "dualseg_resnet18"}, train={"out_dir": "unused"}
    )
    with pytest.raises(CheckpointError, match=r"dualseg_mobilenet_v2.*expected 'dualseg_resnet18'"):
        fit(other, resume=str(tmp_path / "a" / "last.pt"))

    # Extending the run from the command line (the run's config.yaml is read back): iteration 3
    # uses the new poly schedule (T = 4), not the LR the old schedule (T = 2) ended on.
    assert train_main(["--resume", str(tmp_path / "a" / "last.pt"), "--train.max_iters", "4"]) == 0
    # the change is said, not silent
    assert (
        "settings changed since that checkpoint: train.max_iters: 2 -> 4" in capsys.readouterr().out
    )
    assert load_checkpoint(tmp_path / "a" / "last.pt")["iteration"] == 4
    records = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["iteration"]: r["lr"] for r in records if "lr" in r}
    assert sorted(lrs) == [1, 2, 3, 4]
    assert lrs[3] == pytest.approx(0.01 * (1 - 2 / 4) ** 0.9)


def test_resume_with_other_optimizer_settings(data: Path, tmp_path: Path, capsys) -> None:
    """A resume follows the config's momentum (as its LR), and a head_lr_mult that regroups
    the parameters is refused in one line, not torch's ValueError."""
    from tests.reliability_helpers import refused

    fit(tiny(data, tmp_path / "a", max_iters=2, val_every=0))
    last = str(tmp_path / "a" / "last.pt")
    argv = ["train", "--resume", last, "--train.max_iters", "3", "--train.quiet", "true"]
    capsys.readouterr()  # the first run's progress lines
    err = refused([*argv, "--optim.head_lr_mult", "10"], capsys)
    assert "last.pt" in err and "head_lr_mult" in err
    assert load_checkpoint(tmp_path / "a" / "last.pt")["iteration"] == 2  # nothing trained

    assert train_main([*argv[1:], "--optim.momentum", "0.5", "--optim.nesterov", "true"]) == 0
    groups = load_checkpoint(tmp_path / "a" / "last.pt")["optimizer"]["param_groups"]
    assert [(g["momentum"], g["nesterov"]) for g in groups] == [(0.5, True)] * len(groups)


@pytest.mark.slow
def test_sigkill_and_resume_is_bit_identical(data: Path, tmp_path: Path) -> None:
    """Kill a CPU run with SIGKILL after a checkpoint, resume it: same final weights."""
    settings = {"max_iters": 8, "val_every": 4, "ckpt_every": 2}
    reference = fit(tiny(data, tmp_path / "ref", **settings))
    assert reference["iteration"] == 8

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "dualseg", "train", "--config", str(TINY)]
    cmd += ["--data.root", str(data), "--data.crop_size", "[32,32]", "--train.out_dir", str(out)]
    cmd += [f"--train.{k}={v}" for k, v in settings.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (out / "last.pt").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    killed_at = load_checkpoint(out / "last.pt")["iteration"]
    assert 2 <= killed_at < 8  # killed mid-run, after a checkpoint

    resumed = fit(tiny(data, out, **settings), resume="auto")
    assert resumed["iteration"] == 8
    a, b = load_checkpoint(tmp_path / "ref" / "last.pt"), load_checkpoint(out / "last.pt")
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])
    assert a["metrics"]["miou"] == b["metrics"]["miou"]
    # The log of the resumed run has each iteration once (lines past the checkpoint dropped).
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "loss" in r] == list(range(1, 9))


def test_a_val_split_that_is_the_training_images_is_refused(data: Path, tmp_path: Path) -> None:
    flat = tmp_path / "flat"  # images/ + labels/ only: the flat folder serves every split
    for sub in ("images", "labels"):
        (flat / sub).mkdir(parents=True)
        for p in sorted((data / sub).glob("train_*.png")):
            (flat / sub / p.name).write_bytes(p.read_bytes())
    (flat / "meta.json").write_bytes((data / "meta.json").read_bytes())
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"data\.val_split 'val' resolves to the training images"):
        fit(tiny(flat, out, max_iters=1, val_every=0))
    assert not out.exists()
    summary = fit(tiny(flat, out, data_cfg={"val_split": None}, max_iters=1, val_every=0))
    assert summary["iteration"] == 1


def test_validation_images_of_two_sizes_in_one_batch_are_one_line(
    data: Path, tmp_path: Path
) -> None:
    from PIL import Image

    from dualseg.errors import DataError

    mixed = tmp_path / "mixed"
    for sub in ("images", "labels"):
        (mixed / sub).mkdir(parents=True)
        for p in sorted((data / sub).glob("*.png")):
            (mixed / sub / p.name).write_bytes(p.read_bytes())
    for name in ("meta.json", "train.txt", "val.txt"):
        if (data / name).exists():
            (mixed / name).write_bytes((data / name).read_bytes())
    for sub, resample in (("images", Image.BILINEAR), ("labels", Image.NEAREST)):
        p = mixed / sub / "val_00001.png"
        Image.open(p).resize((52, 40), resample).save(p)  # the second val image: another size
    cfg = tiny(mixed, tmp_path / "run", data_cfg={"val_batch_size": 2}, max_iters=2, val_every=1)
    with pytest.raises(DataError, match=r"differ in size .*set --data\.val_batch_size 1"):
        fit(cfg)
