"""What a model or refiner file describes is checked where it is read: input normalization
(every loader, and kept by a re-export), class-name / palette counts, model_kwargs, TTA scales,
the maps of a probability folder, and the palette a refiner stores."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import dualseg
from checkpoint_helpers import SYNTHETIC as META
from checkpoint_helpers import SYNTHETIC_KWARGS as KWARGS
from checkpoint_helpers import write_synthetic_checkpoint
from dualseg.cli import main as cli_main
from dualseg.commands.predict import save_probs
from dualseg.data import make_synthetic_dataset
from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint
from dualseg.engine.inference import InferenceOptions, infer_logits
from dualseg.engine.pretrained import CONFIG_NAME, read_pretrained, save_pretrained
from dualseg.errors import CheckpointError, ConfigError, DataError
from dualseg.io import atomic_save_image
from dualseg.refine import BoundaryRefiner, RefinerConfig, build_embedding_net
from dualseg.refine.base import ProbsFolderBase, load_base
from reliability_helpers import one_line

HALF = [0.5, 0.5, 0.5]
QUARTER = [0.25, 0.25, 0.25]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("meta") / "best.pt")


@pytest.fixture(scope="module")
def odd_norm(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pretrained folder whose model expects (x - 0.5) / 0.25, not ImageNet's statistics."""
    model, meta = build_model_from_checkpoint(load_checkpoint(ckpt))
    folder = tmp_path_factory.mktemp("odd") / "m"
    save_pretrained(
        model,
        folder,
        arch="dualseg_mobilenet_v2",
        model_kwargs=KWARGS,
        meta=meta,
        mean=HALF,
        std=QUARTER,
    )
    return folder


def _one_line_error(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    err = one_line(capsys)
    for needle in needles:
        assert needle in err, err
    return err


def _edited(folder: Path, tmp_path: Path, **changes: object) -> Path:
    """A copy of the pretrained ``folder`` with config.json entries replaced."""
    out = tmp_path / "edited"
    out.mkdir()
    config = json.loads((folder / CONFIG_NAME).read_text())
    config.update(changes)
    (out / CONFIG_NAME).write_text(json.dumps(config))
    (out / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    return out


# ------------------------------------------------------------------ 1. input normalization
def test_eval_refuses_a_model_with_other_normalization(
    odd_norm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = make_synthetic_dataset(tmp_path / "data", n_train=1, n_val=1, size=(32, 32))
    argv = ["eval", "-c", str(odd_norm), "--data", str(data), "--device", "cpu"]
    assert cli_main([*argv, "--out", str(tmp_path / "ev")]) == 1
    _one_line_error(capsys, str(odd_norm / CONFIG_NAME), "normalization mean=[0.5, 0.5, 0.5]")
    assert not (tmp_path / "ev" / "metrics.json").exists()


def test_refine_bases_refuse_a_model_with_other_normalization(odd_norm: Path) -> None:
    """refine fit --base and refine apply --base both open the base with load_base."""
    with pytest.raises(CheckpointError, match="expects input normalization mean") as err:
        load_base(odd_norm)
    assert str(odd_norm / CONFIG_NAME) in str(err.value) and "\n" not in str(err.value)


def test_reexport_keeps_the_normalization(
    odd_norm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "again"
    argv = ["export", "-c", str(odd_norm), "--format", "pretrained", "-o", str(out)]
    assert cli_main(argv) == 0
    norm = json.loads((out / CONFIG_NAME).read_text())["normalization"]
    assert norm["mean"] == HALF and norm["std"] == QUARTER
    with pytest.raises(CheckpointError, match="expects input normalization mean"):
        dualseg.load_model(out)  # the guard survives the re-export


def test_onnx_export_carries_the_normalization(odd_norm: Path, tmp_path: Path) -> None:
    """The exported runtime normalizes with the model's own statistics, not ImageNet's."""
    from dualseg.engine.pretrained import load_state
    from dualseg.export.runners import read_export_info
    from dualseg.export.runtime import ExportedSegmenter

    onnx = tmp_path / "m.onnx"
    argv = ["export", "-c", str(odd_norm), "--format", "onnx", "-o", str(onnx), "--dynamic"]
    assert cli_main(argv) == 0
    info = read_export_info(onnx)
    assert info["mean"] == HALF and info["std"] == QUARTER

    model, _ = build_model_from_checkpoint(load_state(odd_norm))
    rgb = np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    x = (torch.from_numpy(rgb).permute(2, 0, 1)[None].float() / 255 - HALF[0]) / QUARTER[0]
    with torch.no_grad():
        want = model.eval()(x).softmax(1)[0].numpy()
    np.testing.assert_allclose(ExportedSegmenter(onnx).predict_proba(rgb), want, atol=1e-4)


def test_a_checkpoint_reexports_with_the_default_normalization(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "from_pt"
    assert cli_main(["export", "-c", str(ckpt), "--format", "pretrained", "-o", str(out)]) == 0
    assert read_pretrained(out)["normalization"]["mean"] == [0.485, 0.456, 0.406]
    assert dualseg.load_model(out).num_classes == META.num_classes


# ------------------------------------------------------------------ 2. class-name / palette counts
def test_class_names_or_palette_of_another_count_are_refused_at_load(
    odd_norm: Path, ckpt: Path, tmp_path: Path
) -> None:
    model, meta = build_model_from_checkpoint(load_checkpoint(ckpt))
    good = save_pretrained(model, tmp_path / "good", arch="dualseg_mobilenet_v2",
                           model_kwargs=KWARGS, meta=meta)  # fmt: skip
    folder = _edited(good, tmp_path, class_names=list(META.class_names[:5]))
    with pytest.raises(CheckpointError) as err:
        dualseg.load_model(folder)
    msg = str(err.value)
    assert str(folder / CONFIG_NAME) in msg and "5 class names" in msg and "8 classes" in msg
    assert "\n" not in msg

    pt = write_synthetic_checkpoint(tmp_path / "short.pt", palette=[[1, 2, 3]] * 6)
    with pytest.raises(CheckpointError, match=r"short\.pt describes 6 palette colours for a "
                       r"model of 8 classes"):  # fmt: skip
        dualseg.load_model(pt)
    with pytest.raises(CheckpointError, match="6 palette colours"):
        load_base(pt)


# ------------------------------------------------------------------ 3. model_kwargs
def test_model_kwargs_of_a_newer_version_or_not_a_dict_are_one_line_errors(
    odd_norm: Path, tmp_path: Path
) -> None:
    kwargs = {**KWARGS, "future_option": 3, "another_one": True}
    folder = _edited(odd_norm, tmp_path, model_kwargs=kwargs)
    with pytest.raises(CheckpointError) as err:
        build_model_from_checkpoint(read_pretrained(folder))
    msg = str(err.value)
    assert str(folder / CONFIG_NAME) in msg and "another_one, future_option" in msg
    (folder / CONFIG_NAME).write_text(
        json.dumps({**json.loads((folder / CONFIG_NAME).read_text()), "model_kwargs": [1, 2]})
    )
    with pytest.raises(CheckpointError, match=r"config\.json: model_kwargs must be a dict"):
        build_model_from_checkpoint(read_pretrained(folder))

    pt = write_synthetic_checkpoint(tmp_path / "new.pt", model_kwargs={**KWARGS, "future": 1})
    with pytest.raises(CheckpointError, match=r"new\.pt: model_kwargs holds option\(s\) future"):
        dualseg.load_model(pt)


# ------------------------------------------------------------------ 4. TTA scales
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.0, -1.0, 0.001, 20.0])
def test_tta_scales_must_be_finite_and_in_range(bad: float) -> None:
    with pytest.raises(ConfigError, match=r"--tta-scales must be factors from 0\.1 to 8"):
        InferenceOptions(tta_scales=(1.0, bad))
    model = torch.nn.Conv2d(3, 2, 1)
    with pytest.raises(ConfigError, match="--tta-scales"):
        infer_logits(model, torch.zeros(1, 3, 8, 8), tta_scales=(bad,))


def test_predict_tta_scales_nan_is_one_line(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image = tmp_path / "x.png"
    atomic_save_image(image, np.zeros((16, 16, 3), np.uint8))
    argv = ["predict", str(image), "-c", str(ckpt), "-o", str(tmp_path / "out")]
    assert cli_main([*argv, "--device", "cpu", "--tta-scales", "1", "nan"]) == 1
    _one_line_error(capsys, "--tta-scales must be factors from 0.1 to 8", "nan")


# ------------------------------------------------------------------ 5. probability folders
def _probs(cls: int, size: int = 8, n: int = 3) -> np.ndarray:
    p = np.full((n, size, size), 0.1, np.float32)
    p[cls] = 0.8
    return p


@pytest.fixture
def two_x(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A/x.png and B/x.png, and the folder predict --probs writes for them: x.npz (A's,
    class 0 everywhere) and x_1.npz (B's, class 1 everywhere)."""
    a, b = tmp_path / "A" / "x.png", tmp_path / "B" / "x.png"
    for path in (a, b):
        atomic_save_image(path, np.zeros((8, 8, 3), np.uint8))
    probs = tmp_path / "probs"
    save_probs(probs / "probs" / "x.npz", _probs(0), "abc", str(a))
    save_probs(probs / "probs" / "x_1.npz", _probs(1), "abc", str(b))
    return a, b, probs


def test_probability_maps_are_matched_by_their_source(two_x: tuple[Path, Path, Path]) -> None:
    a, b, probs = two_x
    base = ProbsFolderBase(probs)
    images = torch.zeros(1, 3, 8, 8)
    assert base.scores(images, ["x"], sources=[str(b)]).argmax(1).unique().tolist() == [1]
    assert base.scores(images, ["x"], sources=[str(a)]).argmax(1).unique().tolist() == [0]
    # by name alone, "x" is ambiguous: refused, not guessed
    with pytest.raises(DataError, match=r"x\.npz, x_1\.npz all hold probabilities of images "
                       r"named x\.png"):  # fmt: skip
        base.scores(images, ["x"])


def test_a_map_whose_image_is_gone_matches_only_the_same_pixels(tmp_path, monkeypatch) -> None:
    """predict --probs ran on A/x.png, which is gone; refine apply runs on B's x.png from B's
    folder: the bare name must not match the stored .../A/x.png (it did: the refined labels
    were A's), while the same picture moved elsewhere still does."""
    from dualseg.imaging import rgb_digest

    rng = np.random.default_rng(0)
    pixels_a, pixels_b = (rng.integers(0, 256, (8, 8, 3), dtype=np.uint8) for _ in range(2))
    gone = tmp_path / "A" / "x.png"
    probs = tmp_path / "probs"
    save_probs(probs / "x.npz", _probs(0), "abc", str(gone), image_sha1=rgb_digest(pixels_a))
    atomic_save_image(tmp_path / "B" / "x.png", pixels_b)
    atomic_save_image(tmp_path / "moved" / "x.png", pixels_a)
    base, images = ProbsFolderBase(probs), torch.zeros(1, 3, 8, 8)
    monkeypatch.chdir(tmp_path / "B")
    with pytest.raises(DataError, match=r"holds the probabilities of .*A/x\.png, not of x\.png"):
        base.scores(images, ["x"], sources=["x.png"])
    monkeypatch.chdir(tmp_path / "moved")
    assert base.scores(images, ["x"], sources=["x.png"]).argmax(1).unique().tolist() == [0]


@pytest.mark.parametrize("damage", ["truncated", "empty", "npy"])
def test_an_unreadable_probability_file_is_one_error_naming_it(tmp_path, damage) -> None:
    probs = tmp_path / "probs"
    save_probs(probs / "x.npz", _probs(0), "abc", "x.png")
    bad = probs / "y.npz"
    whole = (probs / "x.npz").read_bytes()
    if damage == "truncated":
        bad.write_bytes(whole[: len(whole) // 2])
    elif damage == "empty":
        bad.write_bytes(b"")
    else:  # a .npy renamed .npz
        np.save(tmp_path / "y.npy", _probs(0))
        bad.write_bytes((tmp_path / "y.npy").read_bytes())
    with pytest.raises(
        DataError, match=r"y\.npz: not a readable probability file .*predict --probs"
    ):
        ProbsFolderBase(probs)


def test_same_named_images_of_a_folder_input_still_match_by_name(tmp_path: Path) -> None:
    """predict photos/ names photos/A/x.png "A/x" and photos/B/x.png "B/x": no ambiguity."""
    probs = tmp_path / "probs"
    save_probs(probs / "A" / "x.npz", _probs(0), "abc", "photos/A/x.png")
    save_probs(probs / "B" / "x.npz", _probs(1), "abc", "photos/B/x.png")
    scores = ProbsFolderBase(probs).scores(torch.zeros(2, 3, 8, 8), ["A/x", "B/x"])
    assert scores.argmax(1).flatten(1).max(1).values.tolist() == [0, 1]


def test_a_map_stored_for_another_image_is_refused(two_x: tuple[Path, Path, Path]) -> None:
    a, b, probs = two_x
    (probs / "probs" / "x_1.npz").unlink()  # only A/x.png's map is left
    base = ProbsFolderBase(probs)
    with pytest.raises(DataError) as err:
        base.scores(torch.zeros(1, 3, 8, 8), ["x"], sources=[str(b)])
    msg = str(err.value)
    assert f"holds the probabilities of {a}, not of {b}" in msg and "\n" not in msg
    # by name only (old callers) the one map of that name is still used
    assert base.scores(torch.zeros(1, 3, 8, 8), ["x"]).argmax(1).unique().tolist() == [0]


def test_every_maps_class_names_are_checked(two_x: tuple[Path, Path, Path]) -> None:
    a, _, probs = two_x
    save_probs(probs / "probs" / "y.npz", _probs(0), ["a", "b", "other"], str(a))
    with pytest.raises(DataError, match=r"y\.npz holds classes \('a', 'b', 'other'\) but "):
        ProbsFolderBase(probs)


def _refiner(palette: object = None) -> BoundaryRefiner:
    torch.manual_seed(0)
    cfg = RefinerConfig(embed_dim=4, output_stride=16, top_n=2, radius=2)
    net = build_embedding_net(
        cfg.backbone, embed_dim=4, output_stride=16, aspp_rates=cfg.aspp_rates
    )
    present = torch.tensor([True, True, True])
    return BoundaryRefiner(
        net, torch.randn(3, 4), present, class_names="abc", config=cfg, palette=palette
    )


def test_refine_apply_never_uses_the_other_images_map(
    two_x: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """refine apply B/x.png with x.npz (A's) and x_1.npz (B's): B's labels, or a refusal."""
    _, b, probs = two_x
    refiner = _refiner().save(tmp_path / "refiner.pt")
    out = tmp_path / "refined"
    argv = ["refine", "apply", str(b), "-r", str(refiner), "-b", str(probs), "-o", str(out)]
    code = cli_main([*argv, "--device", "cpu", "--quiet"])
    if code == 0:  # matched by source: B's map, class 1 everywhere (no boundary to refine)
        from PIL import Image

        assert np.unique(np.asarray(Image.open(out / "labels" / "x.png"))).tolist() == [1]
    else:
        _one_line_error(capsys, "x.npz")


# ------------------------------------------------------------------ 6. the refiner's palette
def test_refiner_palette_round_trips_and_old_refiners_have_none(tmp_path: Path) -> None:
    colours = [(10, 20, 30), (40, 50, 60), (70, 80, 90)]
    refiner = _refiner(colours)
    assert BoundaryRefiner.load(refiner.save(tmp_path / "r.pt")).palette == tuple(colours)
    assert BoundaryRefiner.load(refiner.save_pretrained(tmp_path / "rf")).palette == tuple(colours)
    old = _refiner()  # what refiners saved before the palette was stored load as
    assert BoundaryRefiner.load(old.save(tmp_path / "old.pt")).palette is None
    with pytest.raises(ConfigError, match="one RGB colour per class"):
        _refiner(colours[:2])


def test_refine_fit_stores_the_datasets_palette(tmp_path: Path) -> None:
    data = make_synthetic_dataset(tmp_path / "data", n_train=2, n_val=1, size=(32, 32))
    out = tmp_path / "refiner.pt"
    argv = ["refine", "fit", "--data", str(data), "--out", str(out), "--embed-dim", "4"]
    argv += ["--steps", "1", "--batch-size", "2", "--crop-size", "32", "32", "--radius", "2"]
    argv += ["--num-triplets", "16", "--device", "cpu", "--no-progress", "--log-every", "0"]
    assert cli_main([*argv, "--init-backbone", "none"]) == 0
    assert BoundaryRefiner.load(out).palette == META.palette
