"""Images over Pillow's limit in slide mode: read in row bands (TIFF segment by segment) and
labelled as whole-image slide mode labels them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dualseg import viz
from dualseg.cli import main as cli_main
from dualseg.commands import predict as predict_command
from dualseg.engine.large_images import Rows, open_rows, slide_labels
from dualseg.errors import DataError
from dualseg.imaging import read_image

SLIDE = {"window": (32, 32), "stride": (20, 20)}


def _rgb(h: int = 70, w: int = 90) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _tiff(path: Path, array: np.ndarray, **layout) -> Path:
    tifffile = pytest.importorskip("tifffile")
    tifffile.imwrite(path, array, **layout)
    return path


@pytest.mark.parametrize(
    "layout",
    [
        {"tile": (16, 16), "compression": "zlib"},
        {"rowsperstrip": 7},  # uncompressed, contiguous: memory-mapped
        {"rowsperstrip": 7, "compression": "zlib"},
    ],
    ids=["tiled", "strips", "zlib-strips"],
)
def test_banded_labels_equal_whole_image_slide_mode(seg, tmp_path, layout) -> None:
    path = _tiff(tmp_path / "a.tif", _rgb(), **layout)
    whole = seg.predict(path, mode="slide", tile_batch=3, **SLIDE)
    with open_rows(path) as rows:
        assert type(rows).__name__ == "TiffRows"
        assert (rows.rows(0, 70) == read_image(path)).all()
        # batches of 3 tiles span two origin rows: the rows of both stay open
        labels = slide_labels(seg.model, rows, tile_batch=3, device=seg.device, **SLIDE)
    assert labels.dtype == np.uint8 and labels.shape == (70, 90)
    np.testing.assert_array_equal(labels, whole)  # the same tiles, sums and order: exact


def test_a_band_decodes_only_the_tiles_it_meets(tmp_path) -> None:
    path = _tiff(tmp_path / "a.tif", _rgb(), tile=(16, 16), compression="zlib")
    with open_rows(path) as rows:
        page, decoded = rows.page, []
        real = page.decode
        page.__dict__["decode"] = lambda data, i, **kw: decoded.append(i) or real(data, i, **kw)
        band = rows.rows(20, 40)  # tile rows 1 and 2 of 5, 6 tiles across
        assert decoded == list(range(6, 18))
        assert (band == read_image(path)[20:40]).all()
        rows.rows(30, 50)  # tile rows 1..3: only row 3 is new
        assert decoded[12:] == list(range(18, 24))


def test_16_bit_tiff_reads_as_read_image_does(tmp_path) -> None:
    grey = np.random.default_rng(1).integers(0, 4096, (70, 90)).astype(np.uint16)  # 12-bit
    path = _tiff(tmp_path / "g.tif", grey, rowsperstrip=5, compression="zlib")
    for depth in (None, 16):
        with open_rows(path, bit_depth=depth) as rows:
            assert type(rows).__name__ == "TiffRows"
            whole = read_image(path, bit_depth=depth)
            assert (rows.rows(0, 35) == whole[:35]).all() and (rows[35:70] == whole[35:]).all()
    assert read_image(path)[..., 0].max() > 240  # scaled by 4095, not by 65535
    dark = _tiff(tmp_path / "d.tif", grey % 200 + 1, tile=(16, 16))  # 8-bit or 16-bit data?
    with pytest.raises(DataError) as whole_err:
        read_image(dark)
    with pytest.raises(DataError) as band_err:
        open_rows(dark)
    assert str(band_err.value) == str(whole_err.value)


def test_rotated_or_unbandable_images_are_decoded_whole(tmp_path, monkeypatch) -> None:
    rotated = _tiff(tmp_path / "r.tif", _rgb(), tile=(16, 16), extratags=[(274, 3, 1, 6, True)])
    with open_rows(rotated) as rows:
        assert type(rows) is Rows and rows.size == (90, 70)  # EXIF 6: rotated as read_image does
        assert (rows.rows(0, 90) == read_image(rotated)).all()
    Image.fromarray(_rgb()).save(tmp_path / "a.png")
    assert type(open_rows(tmp_path / "a.png")) is Rows  # PNG: no tiles
    tiled = _tiff(tmp_path / "t.tif", _rgb(), tile=(16, 16))
    monkeypatch.setitem(sys.modules, "tifffile", None)  # the extra not installed
    with open_rows(tiled) as rows:
        assert type(rows) is Rows and (rows[0:70] == read_image(tiled)).all()


@pytest.mark.parametrize("suffix", [".tif", ".png"])
def test_predict_over_pillows_limit_writes_whole_image_slide_results(
    ckpt, seg, tmp_path, monkeypatch, capsys, suffix
) -> None:
    path = tmp_path / f"big{suffix}"
    if suffix == ".tif":
        _tiff(path, _rgb(), tile=(16, 16), compression="zlib")
    else:
        Image.fromarray(_rgb()).save(path)
    rgb = read_image(path)
    expected = seg.predict(rgb, mode="slide", **SLIDE)
    calls = []
    real = predict_command.slide_labels
    monkeypatch.setattr(
        predict_command, "slide_labels", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 70x90 is over Pillow's limit now
    out = tmp_path / "out"
    argv = ["predict", str(path), "-c", str(ckpt), "-o", str(out), "--quiet", "--mode", "slide",
            "--window", "32", "32", "--stride", "20", "20", "--max-megapixels", "1"]  # fmt: skip
    for flag in ("--probs", "--tta-flip"):  # they need the whole image's probabilities
        assert cli_main([*argv, flag]) == 1
        err = capsys.readouterr().err.strip()
        assert flag[:5] in err and "big" in err and "\n" not in err and "Traceback" not in err
    assert not out.exists() or not any(out.rglob("*.png"))
    assert cli_main(argv) == 0 and calls == [1]  # read in bands
    monkeypatch.undo()  # read the PNGs back under Pillow's own limit
    saved = {f: np.array(Image.open(out / f / "big.png")) for f in ("labels", "color", "overlay")}
    palette = seg.meta.palette
    np.testing.assert_array_equal(saved["labels"], expected)
    np.testing.assert_array_equal(saved["color"], viz.colorize(expected, palette))
    np.testing.assert_array_equal(saved["overlay"], viz.overlay(rgb, expected, palette))
