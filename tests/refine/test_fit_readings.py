"""refine fit's step-3 readings and the held-out gate sweep, through the CLI."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from checkpoint_helpers import write_peer_checkpoint
from dualseg.commands.refine import main as refine_main
from dualseg.data import build_dataset, make_synthetic_dataset
from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint
from dualseg.errors import CheckpointError, ConfigError
from dualseg.refine import BoundaryRefiner
from dualseg.refine.calibrate import CLAIM_DECISION
from dualseg.refine.fit import embedding_net
from dualseg.refine.formats import TRAIN_FORMAT, load_state


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("refine_readings")
    data = make_synthetic_dataset(root / "data", n_train=4, n_val=2, size=(48, 64), seed=0)
    names = build_dataset(data, split="val").meta.class_names
    base = write_peer_checkpoint(root / "base.pt", names)
    return data, base


@pytest.fixture(scope="module")
def dev_data(setup: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The setup data with a dev split carved from train: the decision is calibrated on images
    held out of the fit and apart from val, never on an evaluation split's."""
    data = Path(shutil.copytree(setup[0], tmp_path_factory.mktemp("dev") / "data"))
    carve_dev(data)
    return data


def carve_dev(data: Path, count: int = 2) -> None:
    """Move the last ``count`` train.txt pairs to dev.txt."""
    lines = (data / "train.txt").read_text().splitlines(keepends=True)
    (data / "train.txt").write_text("".join(lines[:-count]))
    (data / "dev.txt").write_text("".join(lines[-count:]))


def fit_args(data: Path, base: Path, out: Path) -> list[str]:
    args = ["fit", "--data", str(data), "--base", str(base), "--out", str(out)]
    args += ["--embed-dim", "8", "--steps", "2", "--batch-size", "2", "--crop-size", "32", "32"]
    args += ["--num-triplets", "64", "--radius", "2", "--device", "cpu", "--no-progress"]
    return [*args, "--log-every", "0", "--init-backbone", "none"]


@pytest.mark.slow
def test_base_frozen_backbone_is_the_base_models_and_the_gate_is_calibrated(
    setup: tuple[Path, Path], dev_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data, base = dev_data, setup[1]
    out = tmp_path / "refiner.pt"
    argv = [*fit_args(data, base, out), "--backbone-source", "base-frozen"]
    argv += ["--mining", "semi-hard", "--mining-pool", "4"]
    argv += ["--decoder-channels", "8"]  # beyond the claim: a stride-4 decoder
    argv += ["--calibrate-split", "dev", "--calibrate-metric", "boundary_f1"]
    argv += ["--calibrate-max-broken-ratio", "0.5"]
    assert refine_main(argv) == 0
    refiner = BoundaryRefiner.load(out)
    assert refiner.config.backbone_source == "base-frozen"
    assert (refiner.config.mining, refiner.config.mining_pool) == ("semi-hard", 4)
    assert refiner.config.decoder_channels == 8 and refiner.net.decoder is not None
    # frozen: the embedding's backbone still holds the base model's backbone weights
    model, _ = build_model_from_checkpoint(load_checkpoint(base))
    theirs = model.backbone.state_dict()
    for key, value in refiner.net.backbone.state_dict().items():
        assert torch.equal(value, theirs[key]), key
    # the sweep chose the decision on the held-out split, by the metric asked for among the
    # settings within the broken ratio asked for, and kept its table
    cal = refiner.calibration
    assert (cal["split"], cal["images"], cal["metric"]) == ("dev", 2, "boundary_f1")
    assert cal["max_broken_ratio"] == 0.5
    within = [r for r in cal["rows"] if r["gate_margin"] != "base"]
    best = max(r["boundary_f1"] for r in within if r["broken"] <= 0.5 * r["fixed"])
    cfg = refiner.config
    chosen = [
        r
        for r in cal["rows"]
        if all(r.get(k, v) == getattr(cfg, k) for k, v in CLAIM_DECISION.items())
    ]
    assert len(chosen) == 1 and chosen[0]["boundary_f1"] == best
    out = capsys.readouterr().out
    assert "decision sweep on dev" in out and "chosen: " in out
    assert "breaking at most 0.5 pixel per pixel fixed" in out.split("chosen: ")[1]
    assert out.count("<- chosen") == 1


def test_base_readings_need_a_base_checkpoint(setup: tuple[Path, Path], tmp_path: Path) -> None:
    data, _ = setup
    argv = ["fit", "--data", str(data), "--out", str(tmp_path / "r.pt")]
    with pytest.raises(Exception, match="base"):
        refine_main([*argv, "--backbone-source", "base-frozen"])
    with pytest.raises(Exception, match="--base"):
        refine_main([*argv, "--calibrate-split", "dev"])
    with pytest.raises(ConfigError, match=r"^--calibrate-max-broken-ratio needs --calibrate-split"):
        refine_main([*argv, "--calibrate-max-broken-ratio", "0.5"])
    both = ["--calibrate-metric", "boundary_f1", "--calibrate-max-broken-ratio", "0.5"]
    with pytest.raises(ConfigError, match=r"ratio need --calibrate-split: they choose among"):
        refine_main([*argv, *both])
    with pytest.raises(SystemExit):  # refused at parsing, with argparse's one line
        refine_main([*argv, "--calibrate-max-broken-ratio", "-1"])


def test_calibration_note_when_refinement_did_not_help(tmp_path: Path) -> None:
    from dualseg.refine import RefinerConfig

    cfg = RefinerConfig(embed_dim=4, gate_margin=0.0)
    refiner = BoundaryRefiner(
        embedding_net(cfg),
        torch.zeros(2, 4),
        torch.ones(2, dtype=torch.bool),
        class_names=("a", "b"),
        config=cfg,
    )
    assert refiner.calibration_note() is None  # no held-out check was made
    refiner.calibration = {"split": "dev", "images": 3, "rows": []}
    refiner.save(tmp_path / "r.pt")
    loaded = BoundaryRefiner.load(tmp_path / "r.pt")
    assert "no setting raised the mIoU of the base" in loaded.calibration_note()  # before metric
    assert "'dev'" in loaded.calibration_note()
    loaded.calibration = {**refiner.calibration, "metric": "boundary_f1"}
    assert "no setting raised the boundary F1 of the base" in loaded.calibration_note()
    loaded.calibration["max_broken_ratio"] = 0.5
    within = "no setting breaking at most 0.5 pixel per pixel fixed raised the boundary F1 of"
    assert within in loaded.calibration_note()
    loaded.calibration = {**refiner.calibration, "metric": "net_fixed"}  # it may raise mIoU
    paid = "found that no setting fixed more than twice the pixels it broke for the base model"
    assert paid in loaded.calibration_note()
    # a pretrained folder (refiner.json + refiner.safetensors) keeps the sweep too
    refiner.calibration["rows"] = [
        {"gate_margin": None, "miou": 0.5, "pixel_acc": 0.8, "boundary_f1": 0.4, "changed": 0.1},
        {"gate_margin": 0.0, "miou": 0.6, "pixel_acc": 0.9, "boundary_f1": 0.5, "changed": 0.0},
    ]
    folder = BoundaryRefiner.load(refiner.save_pretrained(tmp_path / "folder"))
    assert folder.calibration == refiner.calibration
    assert folder.config.gate_margin == 0.0 and "'dev'" in folder.calibration_note()
    loaded.config = RefinerConfig(embed_dim=4, gate_margin=0.2)
    assert loaded.calibration_note() is None


def test_time_budget_stops_the_triplet_steps_early_and_resume_goes_on(
    setup: tuple[Path, Path], tmp_path: Path
) -> None:
    data, _ = setup
    out, ckpt = tmp_path / "r.pt", tmp_path / "r.train.pt"
    argv = ["fit", "--data", str(data), "--out", str(out), "--embed-dim", "8", "--steps", "5"]
    argv += ["--batch-size", "2", "--crop-size", "32", "32", "--num-triplets", "64"]
    argv += ["--radius", "2", "--no-progress", "--log-every", "0", "--init-backbone", "none"]
    argv += ["--checkpoint", str(ckpt)]
    # a budget far below one step's time: exactly one step is made, and recorded as made
    assert refine_main([*argv, "--time-budget", "1e-6"]) == 0
    assert BoundaryRefiner.load(out).config.steps == 1
    state = load_state(ckpt, TRAIN_FORMAT, "checkpoint")
    assert state["step"] == 1 and [h["step"] for h in state["history"]] == [1]
    # resumed without a budget, it makes the remaining steps
    out.unlink()
    assert refine_main([*argv, "--resume"]) == 0
    state = load_state(ckpt, TRAIN_FORMAT, "checkpoint")
    assert [h["step"] for h in state["history"]] == [1, 2, 3, 4, 5]
    assert BoundaryRefiner.load(out).config.steps == 5
    # fewer steps than made already: refused, not recorded as a 3-step refiner of 5 steps
    with pytest.raises(CheckpointError, match=r"trained 5 steps already.*--steps 5 or more"):
        refine_main([*argv[:-2], "--steps", "3", "--checkpoint", str(ckpt), "--resume"])


def one_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_an_existing_refiner_needs_overwrite_or_resume(
    setup: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from dualseg.cli import main

    data, base = setup
    out, state = tmp_path / "r.pt", tmp_path / "r.train.pt"
    argv = ["refine", *fit_args(data, base, out)]
    assert main(argv) == 0 and out.is_file() and state.is_file()
    kept = (out.read_bytes(), state.read_bytes())
    capsys.readouterr()
    assert main(argv) == 1
    err = one_line(capsys)
    assert str(out) in err and "--overwrite" in err and "--resume" in err
    # the training state alone is an earlier fit too
    moved = out.rename(tmp_path / "elsewhere.pt")
    assert main(argv) == 1
    err = one_line(capsys)
    assert str(state) in err and "--resume" in err and "--overwrite" in err
    moved.rename(out)
    assert (out.read_bytes(), state.read_bytes()) == kept
    # --overwrite fits a new refiner from step 0 (not a resumed one) in their place
    assert main([*argv, "--overwrite", "--steps", "3"]) == 0
    history = load_state(state, TRAIN_FORMAT, "checkpoint")["history"]
    assert [h["step"] for h in history] == [1, 2, 3]
    assert BoundaryRefiner.load(out).config.steps == 3
    # --resume continues the state; both flags at once are refused
    assert main([*argv, "--resume", "--steps", "4"]) == 0
    assert load_state(state, TRAIN_FORMAT, "checkpoint")["step"] == 4
    capsys.readouterr()
    assert main([*argv, "--resume", "--overwrite"]) == 1
    assert "pass one of them" in one_line(capsys)


def test_resume_on_other_data_crops_or_base_is_refused(
    setup: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from dualseg.cli import main

    data, base = setup
    out, state = tmp_path / "r.pt", tmp_path / "r.train.pt"
    argv = ["refine", *fit_args(data, base, out), "--backbone-source", "base-frozen"]
    assert main(argv) == 0
    kept = state.read_bytes()
    other_base = tmp_path / "other.pt"
    other_base.write_bytes(base.read_bytes())
    capsys.readouterr()
    changes = {  # a flag changed on --resume: what the one-line refusal names
        ("--crop-size", "24", "24"): "crop_size",
        ("--scale-range", "0.5", "1.0"): "scale_range",
        ("--base", str(other_base)): "base",
        ("--split", "val"): "split",
    }
    for change, key in changes.items():
        assert main([*argv, *change, "--resume", "--steps", "3"]) == 1, change
        err = one_line(capsys)
        assert str(state) in err and f"{key}:" in err and "same ones" in err, err
        assert state.read_bytes() == kept  # nothing trained on the other inputs
    # --init-backbone base dropped on the resume: --base is then not read
    first = ["refine", *fit_args(data, base, tmp_path / "i.pt")]
    assert main([*first, "--init-backbone", "base"]) == 0
    capsys.readouterr()
    assert main([*first, "--resume", "--steps", "3"]) == 1
    assert "base: " in (err := one_line(capsys)) and "None now" in err, err
    # a training option changed: the refusal names it (it said "another configuration")
    assert main([*argv, "--margin", "0.5", "--resume", "--steps", "3"]) == 1
    err = one_line(capsys)
    assert "other options (margin 1.0 -> 0.5)" in err and state.read_bytes() == kept, err
    # the same inputs resume, and the inference options, which training never reads, may change
    assert main([*argv, "--resume", "--steps", "3", "--top-n", "2", "--gate-margin", "0.2"]) == 0
    assert load_state(state, TRAIN_FORMAT, "checkpoint")["step"] == 3
    refiner = BoundaryRefiner.load(out)
    assert refiner.config.top_n == 2 and refiner.config.gate_margin == 0.2


def test_resume_without_a_training_state_says_so(
    setup: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from dualseg.cli import main

    data, base = setup
    out = tmp_path / "r.pt"
    argv = ["refine", *fit_args(data, base, out), "--resume"]
    # nothing to continue and nothing to lose: a new fit, and one line saying so
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"no training state {tmp_path / 'r.train.pt'}" in err and "step 0" in err
    # a refiner without its state: --resume cannot continue it, and would replace it
    (tmp_path / "r.train.pt").unlink()
    kept = out.read_bytes()
    assert main(argv) == 1
    err = one_line(capsys)
    assert str(out) in err and "--overwrite" in err
    assert out.read_bytes() == kept


def test_the_calibrate_split_is_checked_before_the_fit(
    setup: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch
) -> None:
    import shutil

    from dualseg.cli import main

    def never(*args, **kwargs):
        raise AssertionError("BoundaryRefiner.fit ran before the calibrate split was checked")

    monkeypatch.setattr(BoundaryRefiner, "fit", staticmethod(never))
    data, base = setup
    out = tmp_path / "r.pt"
    argv = ["refine", *fit_args(data, base, out)]
    # a split that does not exist: named by its own flag
    assert main([*argv, "--layout", "list", "--calibrate-split", "dev"]) == 1
    err = one_line(capsys)
    assert "no split 'dev'" in err and "as --calibrate-split" in err and "--split" not in err
    # with layout auto too: the root names its own splits, so its flat images/ folder does not
    # stand in for a missing one
    assert main([*argv, "--calibrate-split", "dev"]) == 1
    err = one_line(capsys)
    assert "no split 'dev'" in err and "as --calibrate-split" in err
    # the training split itself is no held-out split
    assert main([*argv, "--calibrate-split", "train"]) == 1
    err = one_line(capsys)
    assert "--calibrate-split train" in err and "--split" in err and "held out" in err
    # Top-1: one candidate per pixel, so the refiner could change nothing; said up front
    assert main([*argv, "--top-n", "1", "--calibrate-split", "train"]) == 1
    assert "--top-n 1 leaves each pixel one candidate" in capsys.readouterr().err
    # more Top-N than classes: said once the data's classes are known, before the fit
    with pytest.raises(AssertionError, match="ran before"):
        main([*argv, "--top-n", "50"])
    assert "Top-N 50 is more than the" in capsys.readouterr().err
    # nor is a split that holds training images
    copy = shutil.copytree(data, tmp_path / "data")
    both = (copy / "train.txt").read_text() + (copy / "val.txt").read_text()
    (copy / "trainval.txt").write_text(both)
    argv = ["refine", *fit_args(copy, base, out), "--layout", "list"]
    assert main([*argv, "--calibrate-split", "trainval"]) == 1
    err = one_line(capsys)
    assert "4 of the 6 --calibrate-split trainval images" in err
    # nor the val images under another name: tuned on, then scored there as a clean result
    (copy / "holdout.txt").write_text((copy / "val.txt").read_text())
    assert main([*argv, "--calibrate-split", "holdout"]) == 1
    err = one_line(capsys)
    assert "2 of the 2 --calibrate-split holdout images are also in the val split" in err, err
    # decision flags the sweep would replace without a word
    assert main([*argv, "--calibrate-split", "holdout", "--gate-margin", "0.9",
                 "--min-prob", "0.5"]) == 1  # fmt: skip
    err = one_line(capsys)
    assert "--gate-margin and --min-prob and --calibrate-split both set the decision" in err
    assert not out.exists() and not (tmp_path / "r.train.pt").exists()


def test_calibration_reads_a_probability_folder_base(
    setup: tuple[Path, Path], dev_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--base as 'predict --probs' maps: the sweep reads each held-out image's own map (as
    probabilities, not softmaxed again); a map missing for a held-out image is refused before
    the fit, not after it."""
    from dualseg.cli import main

    data, base = dev_data, setup[1]
    val = [str(image) for image, _ in build_dataset(data, split="dev").samples]
    probs = tmp_path / "probs"
    assert (
        main(["predict", "--checkpoint", str(base), "--probs", *val[:1], "--out", str(probs)]) == 0
    )
    out = tmp_path / "refiner.pt"
    argv = [*fit_args(data, probs, out), "--calibrate-split", "dev"]
    capsys.readouterr()
    assert main(["refine", *argv]) == 1
    err = capsys.readouterr().err
    assert "no probabilities for image" in err and Path(val[1]).stem in err
    assert not out.exists() and not list(tmp_path.glob("refiner.train*"))  # nothing fitted

    assert (
        main(
            [
                "predict",
                "--checkpoint",
                str(base),
                "--probs",
                *val,
                "--out",
                str(probs),
                "--overwrite",
            ]
        )
        == 0
    )
    assert refine_main(argv) == 0
    cal = BoundaryRefiner.load(out).calibration
    assert (cal["split"], cal["images"]) == ("dev", 2)
    # the base row scores the folder's maps as they are: the checkpoint's own prediction
    from_model = tmp_path / "from_model.pt"
    assert refine_main([*fit_args(data, base, from_model), "--calibrate-split", "dev"]) == 0
    ref = BoundaryRefiner.load(from_model).calibration
    assert cal["rows"][0]["gate_margin"] == ref["rows"][0]["gate_margin"] == "base"
    assert cal["rows"][0]["miou"] == pytest.approx(ref["rows"][0]["miou"])


def test_inputs_are_compared_only_when_both_sides_record_them(tmp_path: Path, caplog) -> None:
    from dualseg.refine.fit import _require_same_inputs

    path = tmp_path / "r.train.pt"
    given = {"data": "/d", "crop_size": [32, 32]}
    _require_same_inputs(path, None, None)  # a Python fit resuming a Python fit
    _require_same_inputs(path, given, None)  # a Python fit resuming a CLI fit: nothing to check
    _require_same_inputs(path, None, given)
    _require_same_inputs(path, given, dict(given))
    with pytest.raises(CheckpointError, match=r"crop_size: \[32, 32\] then, \[24, 24\] now"):
        _require_same_inputs(path, given, {**given, "crop_size": [24, 24]})


def test_an_interrupted_fit_saves_its_state_and_resume_goes_on(
    setup: tuple[Path, Path], tmp_path: Path, monkeypatch
) -> None:
    """Ctrl-C lost every step since the last periodic save (up to 199 by default)."""
    import os
    import signal

    import dualseg.refine.fit as fit_module
    from dualseg.cli import main

    data, base = setup
    out, state = tmp_path / "r.pt", tmp_path / "r.train.pt"
    real_step, calls = fit_module.triplet_step, []

    def step_then_ctrl_c(*args, **kwargs):
        calls.append(1)
        stats = real_step(*args, **kwargs)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # arrives mid-fit, as a terminal's Ctrl-C
        return stats

    monkeypatch.setattr(fit_module, "triplet_step", step_then_ctrl_c)
    argv = ["refine", *fit_args(data, base, out), "--steps", "5"]
    assert main(argv) == 130
    assert load_state(state, TRAIN_FORMAT, "checkpoint")["step"] == 2 and not out.exists()
    monkeypatch.setattr(fit_module, "triplet_step", real_step)
    assert main([*argv, "--resume"]) == 0
    assert load_state(state, TRAIN_FORMAT, "checkpoint")["step"] == 5 and out.exists()


def test_top_n_over_the_classes_is_noted_only_when_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch
) -> None:
    """The default Top-N (5) on a four-class dataset is no request for more candidates than
    classes: the note is for a --top-n the user gave."""
    from dualseg.cli import main
    from reliability_helpers import FOUR, class_maps, write_dataset

    def never(*args, **kwargs):
        raise AssertionError("BoundaryRefiner.fit ran")

    monkeypatch.setattr(BoundaryRefiner, "fit", staticmethod(never))
    maps = class_maps(2, 4)
    data = write_dataset(tmp_path / "four", {"train": maps, "val": maps}, meta=FOUR)
    argv = ["refine", "fit", "--data", str(data), "--out", str(tmp_path / "r.pt")]
    argv += ["--crop-size", "32", "32", "--device", "cpu", "--init-backbone", "none"]
    with pytest.raises(AssertionError, match="fit ran"):
        main(argv)
    assert "is more than the" not in capsys.readouterr().err
    with pytest.raises(AssertionError, match="fit ran"):
        main([*argv, "--top-n", "6"])
    assert "Top-N 6 is more than the 4 classes" in capsys.readouterr().err
