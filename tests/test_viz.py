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
    save_figure,
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


def test_a_fractional_palette_is_refused_not_drawn_black() -> None:
    lab = np.array([[0, 1, 2]])
    with pytest.raises(ValueError, match=r"got fractions .*multiply by 255"):
        colorize(lab, [(0.5, 0.2, 0.5), (0.1, 0.5, 0.7), (0.9, 0.1, 0.2)])
    # whole numbers in any dtype are colours
    as_float = colorize(lab, np.asarray(PALETTE, np.float32))
    np.testing.assert_array_equal(as_float, colorize(lab, PALETTE))


def test_a_tile_that_is_no_uint8_image_says_what_to_do() -> None:
    with pytest.raises(TypeError, match=r"a label map\? colourize it first"):
        make_panel([np.zeros((4, 4), np.int64)], ["prediction"])
    with pytest.raises(TypeError, match=r"0\.\.1 float image"):
        overlay(np.zeros((2, 2, 3), np.float32), np.zeros((2, 2), np.int64), PALETTE)


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


def test_a_figure_that_fails_to_render_leaves_the_old_png(tmp_path, monkeypatch) -> None:
    from matplotlib.figure import Figure

    from dualseg.viz import curves_figure

    path = tmp_path / "curves.png"
    history = [{"iteration": i, "loss": 1.0 / (i + 1)} for i in range(5)]
    save_figure(curves_figure(history, ["loss"]), path)
    before = path.read_bytes()

    def fail(self, *args, **kwargs):  # a render stopped halfway (an error, a full disk)
        args[0].write(b"\x89PNG half")
        raise OSError("No space left on device")

    monkeypatch.setattr(Figure, "savefig", fail)
    with pytest.raises(OSError):
        save_figure(curves_figure(history, ["loss"]), path)
    assert path.read_bytes() == before  # the old picture, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png"]  # no temporary file


def test_docstring_examples() -> None:
    import doctest

    import dualseg.viz

    result = doctest.testmod(dualseg.viz)
    assert result.attempted >= 1 and result.failed == 0


def test_curves_label_axes_scale_fractions_and_keep_l2_on_its_own_axis(tmp_path) -> None:
    from dualseg.engine.runlog import save_curves as _save_curves
    from dualseg.viz import curves_figure

    history = [{"iteration": i, "loss": 1.0, "l1": 0.9, "l2": 1e-3} for i in (1, 10, 20)]
    history += [{"iteration": 10, "val_miou": 0.25}, {"iteration": 20, "val_miou": 0.5}]
    fig = curves_figure(
        history,
        ["loss", "l2", "val_miou"],
        ylabels=["loss", "L2", "mIoU (%)"],
        scale={"val_miou": 100},
        names={"val_miou": "mIoU"},
    )
    loss_ax, l2_ax, val_ax = fig.axes
    assert [a.get_ylabel() for a in fig.axes] == ["loss", "L2", "mIoU (%)"]
    assert all(a.get_xlabel() == "iteration" for a in fig.axes)
    (line,) = val_ax.get_lines()
    assert line.get_xdata().tolist() == [10, 20] and line.get_ydata().tolist() == [25, 50]
    assert l2_ax.get_ylim()[1] < 0.01 < loss_ax.get_ylim()[0]  # L2's own scale
    with pytest.raises(ValueError, match="2 y labels for 3"):
        curves_figure(history, ["loss", "l2", "val_miou"], ylabels=["a", "b"])
    _save_curves(tmp_path / "curves.png", history)  # the trainer's call: 3 subplots
    with Image.open(tmp_path / "curves.png") as im:
        assert im.size == (1500, 360)


def test_confusion_matrix_is_row_normalized_with_names_on_both_axes(tmp_path) -> None:
    from dualseg.viz import confusion_matrix_figure, save_confusion_matrix

    mat = np.array([[3, 1, 0], [0, 0, 0], [2, 0, 6]])  # "sky" never in the ground truth
    fig = confusion_matrix_figure(mat, NAMES)
    ax = fig.axes[0]
    shown = ax.images[0].get_array()
    np.testing.assert_allclose(shown[0], [75, 25, 0])
    np.testing.assert_allclose(shown[2], [25, 0, 75])
    assert shown.mask[1].all()  # no ground-truth pixel: an empty row, not 0 %
    assert [t.get_text() for t in ax.get_xticklabels()] == NAMES
    assert [t.get_text() for t in ax.get_yticklabels()] == NAMES
    assert ax.get_xlabel() == "predicted class" and ax.get_ylabel() == "ground-truth class"
    assert "75.0" in [t.get_text() for t in ax.texts]
    save_confusion_matrix(tmp_path / "cm.png", mat, NAMES)
    assert Image.open(tmp_path / "cm.png").format == "PNG"
    with pytest.raises(ValueError, match="2 class names for 3"):
        confusion_matrix_figure(mat, NAMES[:2])


def test_class_iou_bars_in_percent_and_absent_classes_marked(tmp_path) -> None:
    from dualseg.viz import class_iou_figure, save_class_iou

    fig = class_iou_figure({"base": [0.5, None, 0.25], "refined": [0.6, None, 0.3]}, NAMES)
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    np.testing.assert_allclose(heights, [50, 0, 25, 60, 0, 30])
    labels = [t.get_text() for t in ax.texts]
    assert labels.count("n/a") == 2 and "50.0" in labels
    assert ax.get_ylabel() == "IoU (%)"
    assert [t.get_text() for t in ax.get_xticklabels()] == NAMES
    save_class_iou(tmp_path / "iou.png", {"model": [0.5, 0.1, 0.2]}, NAMES)
    assert Image.open(tmp_path / "iou.png").format == "PNG"


def test_mark_changed_paints_only_the_changed_pixels() -> None:
    from dualseg.viz import CHANGED_COLOR, mark_changed

    pic = colorize(np.zeros((4, 5), np.int64), PALETTE)
    changed = np.zeros((4, 5), bool)
    changed[1, 2] = True
    out = mark_changed(pic, changed)
    assert out[1, 2].tolist() == list(CHANGED_COLOR)
    assert (out[~changed] == pic[~changed]).all() and (pic[1, 2] != CHANGED_COLOR).any()
