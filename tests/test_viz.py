"""Tests of dualseg.viz: colours, overlay arithmetic, panel layout, PNG files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from dualseg.viz import (
    GAP,
    TITLE_HEIGHT,
    colorize,
    denormalize,
    make_legend,
    make_panel,
    overlay,
    save_curves,
    save_panel,
)

PALETTE = [(128, 64, 128), (70, 130, 180), (220, 20, 60)]
NAMES = ["road", "sky", "person"]


def test_colorize_palette_and_ignore_black() -> None:
    lab = np.array([[0, 1, 2], [255, 2, 0]], dtype=np.uint8)
    rgb = colorize(lab, PALETTE)
    assert rgb.shape == (2, 3, 3) and rgb.dtype == np.uint8
    assert rgb[0].tolist() == [list(c) for c in PALETTE]
    assert rgb[1, 0].tolist() == [0, 0, 0]
    # torch tensors (int64) give the same picture
    np.testing.assert_array_equal(colorize(torch.from_numpy(lab).long(), PALETTE), rgb)


def test_colorize_rejects_values_without_colour() -> None:
    with pytest.raises(ValueError, match=r"label values \[3\]"):
        colorize(np.array([[0, 3]]), PALETTE)
    with pytest.raises(ValueError, match="HxW"):
        colorize(np.zeros((2, 2, 3), np.uint8), PALETTE)


def test_overlay_blends_and_keeps_ignore() -> None:
    img = np.full((2, 2, 3), 100, np.uint8)
    lab = np.array([[0, 1], [255, 2]])
    assert np.array_equal(overlay(img, lab, PALETTE, alpha=0.0), img)
    full = overlay(img, lab, PALETTE, alpha=1.0)
    assert full[0, 0].tolist() == list(PALETTE[0]) and full[1, 0].tolist() == [100, 100, 100]
    half = overlay(img, lab, PALETTE, alpha=0.5)
    assert half[0, 1].tolist() == [85, 115, 140]  # (100 + (70, 130, 180)) / 2
    assert half[1, 0].tolist() == [100, 100, 100]
    # grayscale images are accepted; sizes must match; images must be uint8
    assert overlay(img[:, :, 0], lab, PALETTE).shape == (2, 2, 3)
    with pytest.raises(ValueError, match="sizes differ"):
        overlay(img, lab[:1], PALETTE)
    with pytest.raises(TypeError, match="denormalize"):
        overlay(img.astype(np.float32), lab, PALETTE)


def test_denormalize_inverts_normalization() -> None:
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    rgb = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    x = (
        torch.from_numpy(rgb).permute(2, 0, 1).float() / 255 - torch.tensor(mean)[:, None, None]
    ) / torch.tensor(std)[:, None, None]
    np.testing.assert_array_equal(denormalize(x, mean, std), rgb)
    # defaults: the datasets' ImageNet statistics from dualseg.data.transforms
    np.testing.assert_array_equal(denormalize(x), rgb)


def test_make_panel_layout_is_pixel_exact() -> None:
    a = np.random.default_rng(1).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    b = colorize(np.array([[0, 1] * 25] * 20), PALETTE)  # 20 x 50
    panel = make_panel([a, b], ["image", "prediction"])
    assert panel.shape == (TITLE_HEIGHT + 30, 40 + GAP + 50, 3)
    np.testing.assert_array_equal(panel[TITLE_HEIGHT:, :40], a)
    np.testing.assert_array_equal(panel[TITLE_HEIGHT : TITLE_HEIGHT + 20, 40 + GAP :], b)
    # below the shorter tile and in the gap: white background
    assert (panel[TITLE_HEIGHT + 20 :, 40 + GAP :] == 255).all()
    assert (panel[:, 40 : 40 + GAP] == 255).all()
    # titles are drawn in dark ink over each tile
    assert (panel[:TITLE_HEIGHT, :40] < 128).any() and (
        panel[:TITLE_HEIGHT, 40 + GAP :] < 128
    ).any()


def test_long_titles_stay_over_their_tile() -> None:
    tiles = [np.zeros((20, 24, 3), np.uint8)] * 2
    panel = make_panel(tiles, ["a very long title for a narrow tile", "ok"])
    assert (panel[:TITLE_HEIGHT, 24 : 24 + GAP] == 255).all()  # nothing drawn in the gap
    assert (panel[:TITLE_HEIGHT, :24] < 128).any()  # but something drawn over the tile


def test_legend_swatches_and_panel_with_legend() -> None:
    legend = make_legend(NAMES, PALETTE, width=300)
    assert legend.shape[1] == 300 and legend.dtype == np.uint8
    for colour in PALETTE:
        assert (legend == colour).all(axis=2).sum() >= 100  # a swatch of about 12x12 px
    # narrow width wraps the entries onto more rows
    assert make_legend(NAMES, PALETTE, width=60).shape[0] > legend.shape[0]
    img = np.zeros((16, 16, 3), np.uint8)
    panel = make_panel([img, img], ["a", "b"], class_names=NAMES, palette=PALETTE)
    assert panel.shape[0] > TITLE_HEIGHT + 16 and panel.shape[1] == 32 + GAP
    assert (panel[TITLE_HEIGHT + 16 :] == PALETTE[2]).all(axis=2).any()
    with pytest.raises(ValueError, match="class names"):
        make_legend(NAMES[:2], PALETTE)
    with pytest.raises(ValueError, match="both"):
        make_panel([img], ["a"], class_names=NAMES)
    with pytest.raises(ValueError, match="one title per image"):
        make_panel([img, img], ["a"])


def test_save_panel_writes_png(tmp_path) -> None:
    img = np.random.default_rng(2).integers(0, 256, (24, 32, 3), dtype=np.uint8)
    lab = np.zeros((24, 32), np.int64)
    lab[:, 16:] = 2
    lab[0] = 255
    tiles = [img, colorize(lab, PALETTE), overlay(img, lab, PALETTE)]
    path = tmp_path / "out" / "panel.png"
    save_panel(
        path, tiles, ["image", "ground truth", "overlay"], class_names=NAMES, palette=PALETTE
    )
    with Image.open(path) as im:
        assert im.format == "PNG" and im.mode == "RGB"
        got = np.asarray(im)
    expected = make_panel(
        tiles, ["image", "ground truth", "overlay"], class_names=NAMES, palette=PALETTE
    )
    np.testing.assert_array_equal(got, expected)
    assert sorted(p.name for p in path.parent.iterdir()) == ["panel.png"]  # no temp files left


def test_save_curves_writes_png(tmp_path) -> None:
    history = [{"iteration": i, "loss": 2.0 / (i + 1), "lr": 0.01} for i in range(0, 100, 10)]
    history += [{"iteration": 50, "val_miou": 0.3}, {"iteration": 100, "val_miou": float("nan")}]
    path = tmp_path / "curves.png"
    save_curves(path, history, [("loss", "val_loss"), "val_miou", "missing"], title="run")
    with Image.open(path) as im:
        assert im.format == "PNG"
        assert im.size == (1500, 360)  # one 500x360 subplot per key group at dpi 100
        arr = np.asarray(im.convert("RGB"))
    assert (arr < 200).any()  # something was drawn
    with pytest.raises(ValueError, match="at least one key"):
        save_curves(tmp_path / "x.png", history, [])
    assert not (tmp_path / "x.png").exists()


def test_docstring_examples() -> None:
    import doctest

    import dualseg.viz

    result = doctest.testmod(dualseg.viz)
    assert result.attempted >= 1 and result.failed == 0
