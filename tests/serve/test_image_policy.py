"""One image policy (``dualseg.data.readers.image_to_rgb``) for the CLI, the Python API and the
server: the same picture gives the same answer, or the same refusal, through each of them."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from dualseg.cli import main
from dualseg.engine.predict import load_model
from dualseg.errors import DataError
from dualseg.serve.app import create_app

REASON = "has transparent pixels (alpha < 255), so the colour under them is undefined"


def _scene(h: int = 40, w: int = 56) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def _rgba(alpha: int) -> Image.Image:
    rgb = _scene()
    a = np.full(rgb.shape[:2], 255, np.uint8)
    a[:5, :7] = alpha
    return Image.fromarray(np.dstack([rgb, a]), "RGBA")


def _rotated_png(path) -> Image.Image:
    """A PNG whose EXIF says 'rotate 90° clockwise to show' (orientation 6)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(_scene()).save(path, exif=exif)
    return Image.open(path)


def _server_labels(client: TestClient, data: bytes) -> np.ndarray:
    r = client.post(
        "/api/segment?images=false", content=data, headers={"Content-Type": "image/png"}
    )
    assert r.status_code == 200, r.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["label_png"]))))


def test_transparent_image_is_refused_the_same_way_everywhere(files, tmp_path, capsys):
    ckpt, _ = files
    glass = tmp_path / "glass.png"
    _rgba(alpha=0).save(glass)
    out = tmp_path / "out"
    assert main(["predict", str(glass), "-c", str(ckpt), "-o", str(out), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert REASON in err and "Traceback" not in err
    assert not (out / "labels" / "glass.png").exists()

    seg = load_model(ckpt)
    for image in (glass, Image.open(glass), np.asarray(Image.open(glass))):
        with pytest.raises(DataError, match=r"has transparent pixels \(alpha < 255\)"):
            seg.predict(image)

    r = TestClient(create_app(seg)).post(
        "/api/segment", content=glass.read_bytes(), headers={"Content-Type": "image/png"}
    )
    assert r.status_code == 400 and REASON in r.json()["detail"]


def test_opaque_alpha_and_exif_orientation_give_the_same_labels_everywhere(files, tmp_path):
    ckpt, _ = files
    seg = load_model(ckpt)
    client = TestClient(create_app(seg))
    opaque = tmp_path / "opaque.png"
    _rgba(alpha=255).save(opaque)
    rotated = tmp_path / "rotated.png"
    pil_rotated = _rotated_png(rotated)
    out = tmp_path / "out"
    args = ["predict", str(opaque), str(rotated), "-c", str(ckpt), "-o", str(out)]
    assert main([*args, "--device", "cpu"]) == 0

    expected_opaque = seg.predict(_scene())
    expected_rotated = seg.predict(np.ascontiguousarray(np.rot90(_scene(), k=-1)))
    assert expected_rotated.shape == (56, 40)  # shown upright: width and height swap
    cases = [
        (opaque, Image.open(opaque), np.asarray(Image.open(opaque)), expected_opaque),
        (rotated, pil_rotated, None, expected_rotated),  # arrays carry no EXIF
    ]
    for path, pil, array, expected in cases:
        cli = np.asarray(Image.open(out / "labels" / f"{path.stem}.png"))
        np.testing.assert_array_equal(cli, expected)
        np.testing.assert_array_equal(seg.predict(path), expected)
        np.testing.assert_array_equal(seg.predict(pil), expected)
        if array is not None:
            np.testing.assert_array_equal(seg.predict(array), expected)
        np.testing.assert_array_equal(_server_labels(client, path.read_bytes()), expected)
