"""``dualseg demo``: trivial baselines, the weights fallback, and a reduced end-to-end run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from dualseg.commands import demo
from dualseg.data import get_preset
from dualseg.engine import showcase
from dualseg.engine.baselines import baseline_models
from dualseg.engine.evaluation import evaluate
from dualseg.engine.showcase import VisualWriter, demo_weights
from dualseg.errors import WeightsNotFoundError


def _labels(tmp_path, maps):
    paths = []
    for i, m in enumerate(maps):
        p = tmp_path / f"l{i}.png"
        Image.fromarray(np.asarray(m, np.uint8)).save(p)
        paths.append(p)
    return paths


def test_baselines_most_frequent_and_per_position(tmp_path) -> None:
    meta = get_preset("synthetic")
    top = np.zeros((8, 8), np.uint8)  # sky (0) on top, road (2) below
    top[4:] = 2
    other = top.copy()
    other[:, :] = 2
    other[0, 0] = 255  # ignore pixels are never counted
    paths = _labels(tmp_path, [top, top, other])
    models = baseline_models(paths, meta, grid=8)
    x = torch.zeros(1, 3, 16, 16)  # another size: the prior is resized
    per_pos = models["majority_per_position"](x).argmax(1)[0]
    assert (per_pos[:8] == 0).all() and (per_pos[8:] == 2).all()
    assert (models["most_frequent_class"](x).argmax(1) == 2).all()

    target = torch.from_numpy(top).long()[None]
    m = evaluate(
        models["majority_per_position"], [(torch.zeros(1, 3, 8, 8), target)], num_classes=8
    )
    assert m["miou"] == pytest.approx(1.0)


def test_missing_imagenet_weights_fall_back_to_random_init(monkeypatch, capsys) -> None:
    # Import the models package before patching, so that its own (module-level) binding of
    # resolve_weights stays the real one for the tests that run after this one.
    import dualseg.models  # noqa: F401

    def missing(*args, **kwargs):
        raise WeightsNotFoundError("not here")

    monkeypatch.setattr("dualseg.weights.resolve_weights", missing)  # read when called
    assert demo_weights("dualseg_mobilenet_v2", "imagenet") is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "random init" in err
    assert demo_weights("dualseg_mobilenet_v2", "none") is None


@pytest.mark.slow
def test_reduced_demo_beats_trivial_baselines(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    argv = [
        *("--out", str(out), "--size", "96", "128", "--n-train", "200", "--n-val", "8"),
        *("--iters", "60", "--batch-size", "4", "--renet-hidden", "32", "--n-show", "2"),
        *("--renet-layers", "1", "--refine-steps", "5", "--refine-prototypes", "20"),
    ]
    assert demo.main(argv) == 0
    record = json.loads((out / "metrics.json").read_text())
    model = record["metrics"]
    best = max(record["baselines"].values(), key=lambda r: r["miou"])
    # clearly better than the best image-blind baseline (measured: +7 mIoU points after 60 steps)
    assert model["miou"] > best["miou"] + 0.04, (model["miou"], best["miou"])
    assert model["pixel_acc"] > best["pixel_acc"]
    assert model["boundary_f1"] > best["boundary_f1"]
    # method B ran on top and was scored on the same held-out images
    ref = record["refinement"]
    assert ref["base"]["miou"] == pytest.approx(model["miou"])
    assert 0.0 <= ref["refined"]["miou"] <= 1.0
    c = ref["refine"]
    assert 0 <= c["fixed"] + c["broke"] <= c["changed"] <= c["pixels"]
    for name in ("panel.png", "curves.png", "last.pt", "config.yaml", "refiner.pt"):
        assert (out / name).is_file(), name
    preds = sorted(p.name for p in (out / "predictions" / "overlay").iterdir())
    assert preds == [f"val_{i:05d}.png" for i in range(8)]
    summary = capsys.readouterr().out
    assert "baseline: majority per position" in summary and "vs the best baseline" in summary
    assert "model + method B refinement" in summary


class _TinySet:
    """What the demo's panel writer reads from a dataset: meta, samples, load_pair."""

    def __init__(self, n: int) -> None:
        self.meta = get_preset("synthetic")
        self.samples = [(f"im{i}.png", f"lab{i}.png") for i in range(n)]

    def load_pair(self, i: int):
        image = np.full((8, 12, 3), 40 * i, np.uint8)
        return image, np.zeros((8, 12), np.uint8)


def test_panel_shows_method_b_with_changed_pixels_marked(tmp_path) -> None:
    from dualseg import viz

    writer = VisualWriter(_TinySet(4), tmp_path, n_show=2, batch_size=2)
    pred = torch.zeros(2, 8, 12, dtype=torch.long)
    refined = pred.clone()
    refined[0, 2:4, 5:7] = 2  # method B changed a 2x2 block of image 0 only
    for index in (0, 1):  # two batches of 2 images; the first 2 are shown
        writer(index, torch.zeros(2, 3, 8, 12), pred, pred, refined)
    writer.finish()
    panel = np.asarray(Image.open(tmp_path / "panel.png").convert("RGB"))
    tile_w = 12 + viz.GAP
    assert panel.shape[1] == 5 * 12 + 4 * viz.GAP  # image | gt | pred | overlay | method B
    row0 = panel[viz.TITLE_HEIGHT : viz.TITLE_HEIGHT + 8, 4 * tile_w : 4 * tile_w + 12]
    magenta = (row0 == viz.CHANGED_COLOR).all(-1)
    assert magenta[2:4, 5:7].all() and magenta.sum() == 4
    palette = get_preset("synthetic").palette
    assert (row0[0, 0] == palette[0]).all()  # unchanged pixels show method B's label colour
    # without a refiner the panel keeps its four columns
    plain = VisualWriter(_TinySet(2), tmp_path / "plain", n_show=1, batch_size=2)
    plain(0, torch.zeros(2, 3, 8, 12), pred, pred, None)
    plain.finish()
    assert Image.open(tmp_path / "plain" / "panel.png").size[0] == 4 * 12 + 3 * viz.GAP


def test_demo_takes_the_shared_amp_and_quiet_flags(tmp_path) -> None:
    from dualseg.data import get_preset

    meta = get_preset("synthetic")
    args = demo.build_parser().parse_args(["--amp", "--quiet", "--out", str(tmp_path)])
    cfg = demo._train_config(args, tmp_path, meta, None)
    assert cfg.train.amp == "auto" and cfg.train.quiet and not cfg.train.progress  # bf16 on CUDA
    # by default the demo trains as `dualseg train` does (auto); --no-amp keeps fp32
    default = demo._train_config(demo.build_parser().parse_args([]), tmp_path, meta, None)
    assert default.train.amp == "auto" and not default.train.quiet
    fp32 = demo._train_config(demo.build_parser().parse_args(["--no-amp"]), tmp_path, meta, None)
    assert fp32.train.amp == "none"


def _tiny_demo(out, *extra: str) -> list[str]:
    """A seconds-long demo run into ``out`` (no method B, random init)."""
    argv = ["demo", "--out", str(out), "--size", "32", "48"]
    if "--data" not in extra:  # the synthetic data's own options (refused with --data)
        argv += ["--n-train", "4", "--n-val", "2"]
    argv += ["--iters", "1", "--batch-size", "2", "--renet-hidden", "4", "--renet-layers", "0"]
    return [*argv, "--weights", "none", "--no-refine", "--n-show", "1", "--quiet", *extra]


def _files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_demo_refuses_a_folder_holding_another_run_and_checks_first(tmp_path, capsys) -> None:
    from dualseg.cli import main

    run = tmp_path / "run"  # a training run that `dualseg train` wrote, not the demo
    run.mkdir()
    for name in ("last.pt", "best.pt", "config.yaml", "metrics.jsonl"):
        (run / name).write_bytes(name.encode())
    before = _files(run)
    # a cheap check fails first, before the folder is looked at or touched
    assert main(_tiny_demo(run, "--batch-size", "8")) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--batch-size 8" in err and "--n-train 4" in err
    # the other run is refused, named, with the way out
    assert main(_tiny_demo(run)) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "last.pt" in err and "--overwrite" in err
    assert _files(run) == before
    # a cheap check also comes before a fresh folder is created
    assert main(_tiny_demo(tmp_path / "fresh", "--iters", "0")) == 1
    assert "--iters" in capsys.readouterr().err and not (tmp_path / "fresh").exists()
    assert "--overwrite" in demo.build_parser().format_help()
    # and so does a --weights file that is not there (a folder here)
    assert main([*_tiny_demo(tmp_path / "fresh"), "--weights", str(tmp_path)]) == 1
    assert "is a folder, not a file" in capsys.readouterr().err
    assert not (tmp_path / "fresh").exists()


def test_demo_refuses_a_new_out_whose_data_folder_is_someone_elses(tmp_path, capsys) -> None:
    from dualseg.cli import main

    out = tmp_path / "new"
    (out / "data").mkdir(parents=True)
    (out / "data" / "train.txt").write_text("images/mine.png labels/mine.png\n")
    assert main(_tiny_demo(out)) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "its data/ folder holds files dualseg demo did not write" in err
    assert "--overwrite" in err and not (out / showcase.DEMO_MARKER).exists()  # not marked as ours
    assert (out / "data" / "train.txt").read_text() == "images/mine.png labels/mine.png\n"
    assert sorted(p.name for p in out.iterdir()) == ["data"]


@pytest.mark.slow
def test_demo_reruns_into_its_own_folder_and_overwrite_replaces_another_run(
    tmp_path, capsys
) -> None:
    from dualseg.cli import main

    out = tmp_path / "demo"
    assert main(_tiny_demo(out)) == 0
    assert (out / showcase.DEMO_MARKER).is_file() and (out / "metrics.json").is_file()
    assert main(_tiny_demo(out, "--iters", "2")) == 0  # its own previous output: replaced
    assert json.loads((out / "metrics.json").read_text())["train"]["iters"] == 2
    # --overwrite replaces a training run
    run = tmp_path / "run"
    run.mkdir()
    (run / "last.pt").write_bytes(b"another run")
    assert main(_tiny_demo(run, "--overwrite")) == 0
    assert (run / "last.pt").read_bytes() != b"another run"


def _write_pairs(folder, n: int) -> None:
    (folder / "images").mkdir(parents=True)
    (folder / "labels").mkdir()
    for i in range(n):
        Image.fromarray(np.full((8, 12, 3), 30 * i, np.uint8)).save(folder / "images" / f"{i}.png")
        Image.fromarray(np.zeros((8, 12), np.uint8)).save(folder / "labels" / f"{i}.png")


def test_demo_refuses_data_whose_val_split_is_its_training_images(tmp_path, capsys) -> None:
    from dualseg.cli import main

    flat = tmp_path / "flat"  # images/ and labels/ only: that folder serves every split
    _write_pairs(flat, 3)
    out = tmp_path / "out"
    for extra in ((), ("--val-every", "1")):  # scored after training, or validated within it
        assert main(_tiny_demo(out, "--data", str(flat), "--preset", "camvid", *extra)) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and str(flat) in err and "--val-split" in err
        assert not out.exists()  # refused before the folder is created
    # separate train and val splits pass the check
    split = tmp_path / "split"
    _write_pairs(split / "train", 3)
    _write_pairs(split / "val", 2)
    showcase.check_splits_differ(
        split, get_preset("camvid"), layout="auto", train="train", val="val"
    )


def test_demo_predictions_of_images_sharing_a_name_are_all_kept(tmp_path) -> None:
    """--data whose val list holds d1/a.png and d2/a.png: the second overwrote the first."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from dualseg.data import get_preset
    from dualseg.engine.showcase import VisualWriter

    samples = [(f"/x/d{i}/a.png", f"/x/d{i}/a_label.png") for i in (1, 2)]
    image, label = np.zeros((4, 6, 3), np.uint8), np.zeros((4, 6), np.uint8)
    dataset = SimpleNamespace(
        samples=samples, meta=get_preset("synthetic"), load_pair=lambda i: (image, label)
    )
    writer = VisualWriter(dataset, tmp_path, n_show=0, batch_size=2)
    pred = torch.zeros(2, 4, 6, dtype=torch.int64)
    writer(0, torch.zeros(2, 3, 4, 6), torch.zeros(2, 4, 6), pred, None)
    written = sorted(p.name for p in (tmp_path / "predictions" / "labels").iterdir())
    assert written == ["a.png", "a_1.png"]


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (("--data", "DATA", "--n-train", "8"), "--n-train does not apply to --data"),
        (("--preset", "camvid"), "--preset does not apply to the synthetic data"),
        (("--val-split", "test"), "--val-split does not apply to the synthetic data"),
        (
            ("--data", "DATA", "--preset", "synthetic", "--val-split", "train"),
            "is the same images as split 'train'",
        ),
    ],
)
def test_demo_refuses_options_its_data_source_would_drop(tmp_path, capsys, extra, said) -> None:
    """Dropped without a word before; --val-split test failed only after the training."""
    from dualseg.cli import main

    data = tmp_path / "data"
    _write_pairs(data / "train", 2)
    _write_pairs(data / "val", 1)
    out = tmp_path / "out"
    argv = _tiny_demo(out, *(str(data) if a == "DATA" else a for a in extra))
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert said in err and err.count("\n") == 0 and not out.exists()


def test_a_rerun_leaves_no_figure_of_the_earlier_model(tmp_path) -> None:
    """--n-show 0 on a re-run kept the earlier run's panel beside the new model's metrics."""
    from dualseg.cli import main

    out = tmp_path / "out"
    assert main(_tiny_demo(out)) == 0 and (out / "panel.png").is_file()
    stale = out / "predictions" / "labels" / "gone.png"
    stale.write_bytes(b"an image of the earlier run")
    assert main(_tiny_demo(out, "--n-show", "0")) == 0
    assert not (out / "panel.png").exists() and not stale.exists()
    assert (out / "predictions" / "labels").is_dir() and (out / "metrics.json").is_file()


@pytest.mark.parametrize(
    ("signum", "code", "said"), [(2, 130, "interrupted"), (15, 143, "terminated")]
)
def test_a_demo_interrupted_while_training_stops_there(tmp_path, monkeypatch, capsys, signum, code,
                                                       said) -> None:  # fmt: skip
    """fit turns Ctrl-C / SIGTERM into a saved checkpoint and returns: the demo went on to
    evaluate and refine the half-trained model, exited 0 and said it trained every iteration."""
    from dualseg.cli import main

    out = tmp_path / "demo"
    assert main(_tiny_demo(out)) == 0
    import dualseg.engine.train as engine_train

    real_fit = engine_train.fit

    def interrupted(cfg, **kwargs):
        summary = real_fit(cfg, **kwargs)
        return {**summary, "stop_reason": "interrupted", "signal": signum}

    monkeypatch.setattr(engine_train, "fit", interrupted)  # the demo imports it when it runs
    capsys.readouterr()
    assert main(_tiny_demo(out)) == code
    assert capsys.readouterr().err.strip().endswith(f"dualseg: {said}")
    assert not (out / "metrics.json").exists()  # the earlier run's, about a model now replaced
    # nor any other figure of the earlier model (they stayed beside the new one)
    assert not (out / "panel.png").exists() and not (out / "predictions").exists()


def test_a_predictions_folder_the_demo_did_not_write_is_refused(tmp_path, capsys) -> None:
    """The demo replaces its predictions/ folder: someone else's was deleted without a word."""
    from dualseg.cli import main

    out = tmp_path / "mine"
    (out / "predictions").mkdir(parents=True)
    (out / "predictions" / "NOTES.txt").write_text("my notes")
    assert main(_tiny_demo(out)) == 1
    err = capsys.readouterr().err
    assert "holds files dualseg demo did not write (predictions)" in err
    assert (out / "predictions" / "NOTES.txt").read_text() == "my notes"
