"""Training options beyond S32 (class weights, OHEM) and mixed dataset roots, through fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualseg.commands.train import main as train_main
from dualseg.data import make_synthetic_dataset
from dualseg.engine.config import load_config
from dualseg.engine.train import fit
from dualseg.errors import ConfigError

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_synthetic.yaml"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four synthetic training pairs (no validation needed here)."""
    return make_synthetic_dataset(tmp_path_factory.mktemp("s"), n_train=4, n_val=1, size=(36, 44))


def _first_l1(out: Path) -> float:
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r["l1"] for r in records if "l1" in r)


def _run(data, out: Path, **optim) -> float:
    cfg = load_config(
        TINY,
        data={"root": str(data), "crop_size": [32, 32], "val_split": None},
        optim=optim,
        train={"out_dir": str(out), "max_iters": 1, "val_every": 0},
    )
    fit(cfg)
    return _first_l1(out)


def test_class_weights_and_ohem_change_the_first_loss_and_default_stays_s32(data, tmp_path):
    plain = _run(data, tmp_path / "plain")
    weighted = _run(data, tmp_path / "mf", class_weights="median_frequency")
    assert weighted > 0 and weighted != pytest.approx(plain, rel=1e-4)
    # a threshold no pixel is below, no minimum: no pixel counts, L1 is exactly 0
    assert _run(data, tmp_path / "none", ohem_thresh=1e-9, ohem_min_kept=0) == 0.0
    # at least every pixel kept: the plain mean again
    everything = _run(data, tmp_path / "all", ohem_thresh=1e-9, ohem_min_kept=10**6)
    assert everything == pytest.approx(plain, rel=1e-5)
    with pytest.raises(ConfigError, match="has 2 values"):
        _run(data, tmp_path / "bad", class_weights=[1.0, 2.0])
    with pytest.raises(ConfigError, match="ohem_thresh must be in"):
        _run(data, tmp_path / "bad2", ohem_thresh=1.5)
    # a minimum alone: OHEM stays off, so it did nothing without a word
    with pytest.raises(ConfigError, match="ohem_min_kept 100 does nothing without"):
        _run(data, tmp_path / "bad3", ohem_min_kept=100)


def test_cli_mixes_two_roots(data, tmp_path, capsys):
    other = make_synthetic_dataset(tmp_path / "other", n_train=2, n_val=1, size=(36, 44), seed=1)
    out = tmp_path / "run"
    argv = ["--config", str(TINY), "--data.root", f"[{data}, {other}]", "--data.val_split", "null"]
    argv += ["--data.crop_size", "[32,32]", "--train.out_dir", str(out), "--train.max_iters", "1"]
    argv += ["--train.val_every", "0", "--optim.class_weights", "median_frequency"]
    assert train_main([*argv, "--quiet"]) == 0
    resolved = load_config(out / "config.yaml")
    assert resolved.data.root == (str(data), str(other))
    assert resolved.optim.class_weights == "median_frequency"
    # --quiet: no log lines, only the human summary; the machine one is in summary.json
    text = capsys.readouterr().out
    assert text.startswith("training done: 1 iterations") and "loss" not in text
    assert "no validation ran" in text and f"run folder: {out}" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iteration"] == 1 and summary["stop_reason"] == "max_iters"
    assert resolved.train.quiet  # recorded: a resume from this config stays quiet


def test_weights_none_spelled_as_a_word_says_how_to_write_random_init(tmp_path, capsys):
    from dualseg.engine.options import validate

    for word in ("none", "None", "random"):
        with pytest.raises(ConfigError, match=r"--model\.weights null"):
            load_config(TINY, model={"weights": word})
    validate(load_config(TINY, model={"weights": None}))  # null: random init, accepted
    named = tmp_path / "none"  # a weights file that happens to be called so is still a file
    named.write_bytes(b"")
    validate(load_config(TINY, model={"weights": str(named)}))


@pytest.mark.parametrize("mapping", ["255:1", "0:0,255:1"])
def test_label_map_is_read_as_written_in_yaml_and_on_the_command_line(tmp_path, mapping):
    """YAML 1.1 reads 255:1 as the base-60 number 15301: ``label_map: 255:1`` (the fix the
    0/255-mask message gives) was refused as "'15301' is not valid; it takes text"."""
    from dualseg.engine.config import parse_command

    config = tmp_path / "map.yaml"
    config.write_text(f"data:\n  label_map: {mapping}\noptim:\n  lr: 1e-3\n")
    assert load_config(config).data.label_map == mapping
    from_file = parse_command(["--config", str(TINY), "--config", str(config)])[0]
    assert (from_file.data.label_map, from_file.optim.lr) == (mapping, 1e-3)
    for flag in (["--data.label_map", mapping], [f"--data.label_map={mapping}"]):
        assert parse_command(["--config", str(TINY), *flag])[0].data.label_map == mapping


def test_a_number_written_with_colons_is_refused_not_read_in_base_60(tmp_path) -> None:
    """jsonargparse read --train.max_iters 1:30 as YAML 1.1's base-60 90 and trained 90
    iterations without a word; a number field refuses digits joined by colons."""
    from dualseg.engine.config import parse_command

    said = r"train\.max_iters: '1:30' is not valid; it takes an integer"
    with pytest.raises(ConfigError, match=said):
        parse_command(["--config", str(TINY), "--train.max_iters", "1:30"])
    config = tmp_path / "colons.yaml"
    config.write_text("train:\n  max_iters: 1:30\n")
    with pytest.raises(ConfigError, match=said):
        parse_command(["--config", str(TINY), "--config", str(config)])
    with pytest.raises(ConfigError, match=r"data\.crop_size: '1:30' is not valid"):
        parse_command(["--config", str(TINY), "--data.crop_size", "[1:30, 2]"])
    cfg = parse_command(["--config", str(TINY), "--train.max_iters", "90"])[0]
    assert cfg.train.max_iters == 90


def test_a_nan_evaluation_is_not_the_best_and_spends_no_patience() -> None:
    from dualseg.engine.runlog import Progress

    p = Progress()
    assert not p.update_monitor(float("nan"), higher_is_better=True, min_delta=0.0)
    assert p.best_monitored is None and p.bad_evals == 0
    assert p.update_monitor(0.3, higher_is_better=True, min_delta=0.0)  # a real value: the best
    assert not p.update_monitor(float("nan"), higher_is_better=True, min_delta=0.0)
    assert p.best_monitored == 0.3 and p.bad_evals == 0


@pytest.mark.parametrize("clip", [None, 1e-3])
def test_clip_grad_norm_bounds_the_update_and_none_leaves_it(clip) -> None:
    import torch
    from torch import nn

    from dualseg.engine.train import train_one_epoch

    torch.manual_seed(0)
    model = nn.Conv2d(3, 2, 1)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # plain SGD: update = -grad
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)

    def criterion(logits, labels):
        loss = nn.functional.cross_entropy(logits, labels)
        return loss, {"l1": loss.detach(), "l2": torch.zeros(()), "loss": loss.detach()}

    loader = [(10 * torch.randn(2, 3, 4, 4), torch.randint(0, 2, (2, 4, 4)))]
    device = torch.device("cpu")
    train_one_epoch(
        model, loader, optimizer, scheduler, criterion, device=device, clip_grad_norm=clip
    )
    step = torch.sqrt(sum(((p - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    if clip is None:
        assert step.item() > 0.1  # the raw gradient of a badly scaled input is large
    else:
        assert step.item() == pytest.approx(clip, rel=1e-4)


def test_clip_grad_norm_must_be_positive(data, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"optim\.clip_grad_norm must be > 0"):
        _run(data, tmp_path / "clip", clip_grad_norm=0.0)


def test_resume_on_a_dataset_whose_classes_were_renamed_is_refused(data, tmp_path, capsys):
    import shutil

    root = Path(shutil.copytree(data, tmp_path / "data"))
    out = tmp_path / "run"
    argv = ["--config", str(TINY), "--data.root", str(root), "--data.val_split", "null"]
    argv += ["--data.crop_size", "[32,32]", "--train.out_dir", str(out), "--train.max_iters", "1"]
    assert train_main([*argv, "--data.preset", "null"]) == 0  # the classes of its meta.json
    meta = json.loads((root / "meta.json").read_text())
    meta["class_names"] = meta["class_names"][::-1]  # same count, every channel renamed
    meta["palette"] = meta["palette"][::-1]
    (root / "meta.json").write_text(json.dumps(meta))
    before = (out / "last.pt").read_bytes()
    capsys.readouterr()
    from dualseg.cli import main as cli_main

    assert cli_main(["train", "--resume", str(out / "last.pt"), "--train.max_iters", "2"]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]  # after the data check's progress line
    assert last.startswith("dualseg train: error:") and "does not fit this run" in last
    assert "the dataset's: ['sign', 'pole'" in last
    assert (out / "last.pt").read_bytes() == before  # nothing trained on the renamed classes


def test_resume_on_a_training_split_that_gained_pairs_says_so(data, tmp_path, capsys):
    import shutil

    from dualseg.cli import main as cli_main

    root = Path(shutil.copytree(data, tmp_path / "data"))
    out = tmp_path / "run"
    argv = ["train", "--config", str(TINY), "--data.root", str(root), "--data.val_split", "null"]
    argv += ["--data.crop_size", "[32,32]", "--train.out_dir", str(out), "--train.max_iters", "1"]
    assert cli_main(argv) == 0
    resume = ["train", "--resume", "auto", "--train.out_dir", str(out)]
    assert cli_main([*resume, "--train.max_iters", "2"]) == 0  # the same data: nothing said
    assert "training pairs" not in "".join(capsys.readouterr())
    train_list = root / "train.txt"
    val_lines = (root / "val.txt").read_text()
    train_list.write_text(train_list.read_text() + val_lines)  # val images now in training
    assert cli_main([*resume, "--train.max_iters", "3"]) == 0
    err = "".join(capsys.readouterr())
    assert "settings changed since that checkpoint" in err and "training pairs: '4 (" in err
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    changed = [r["changed"] for r in records if "changed" in r]
    assert changed and "training pairs" in changed[-1]


def test_a_peer_cannot_train_on_batches_of_one_and_is_told_before_any_output() -> None:
    """DeepLabV3's image-pooling BatchNorm sees one value per channel on one image: the run
    ended in torchvision's traceback after writing its folder."""
    import inspect

    from dualseg.engine.options import validate
    from dualseg.models import build_model

    hidden = inspect.signature(build_model).parameters["renet_hidden"].default  # the peer's
    peer = {"arch": "deeplabv3_mobilenet_v2", "renet_hidden": hidden}
    validate(load_config(TINY, model=peer))
    with pytest.raises(ConfigError, match=r"data\.batch_size 1 cannot train deeplabv3_"):
        validate(load_config(TINY, model=peer, data={"batch_size": 1}))


def test_the_spec_config_stops_when_the_objective_stops_decreasing() -> None:
    """S33: "until the objective stops decreasing". The spec's ResNet-101 config had patience
    off and watched val mIoU, so it always ran its 40,000 iterations."""
    from dualseg.engine.config import load_config

    cfg = load_config(TINY.parent / "camvid_resnet101.yaml")
    assert cfg.train.patience is not None and cfg.train.monitor in ("auto", "val_loss")


def test_a_crop_larger_than_every_training_image_is_warned_about(data, tmp_path, capsys):
    from dualseg.cli import main
    from dualseg.engine.options import DataConfig
    from dualseg.engine.preflight import padded_crop

    d = DataConfig(crop_size=(480, 640), scale_range=(0.5, 2.0))
    assert "use a crop of at most [200, 400]" in padded_crop(d, (100, 200))
    assert padded_crop(d, (240, 320)) is None  # reached at scale 2
    out = tmp_path / "run"
    argv = ["train", "--config", str(TINY), "--data.root", str(data), "--quiet",
            "--data.crop_size", "[480, 640]", "--train.max_iters", "1",
            "--train.out_dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "data.crop_size [480, 640] is larger than every training image" in (
        capsys.readouterr().err
    )
