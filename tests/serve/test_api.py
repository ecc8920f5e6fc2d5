"""JSON API of ``dualseg serve`` through FastAPI's TestClient (no network, no disk)."""

from __future__ import annotations

import base64
import io
import logging
import re

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from serve_fakes import BrightnessSegmenter, gradient_png

from dualseg.errors import ConfigError, OutputError
from dualseg.serve.app import create_app, upsample_probs


def _decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


@pytest.fixture
def client(segmenter) -> TestClient:
    return TestClient(create_app(segmenter, max_megapixels=0.01, max_upload_bytes=200_000))


def test_segment_good_image_returns_label_map_and_visuals(client, segmenter):
    png = gradient_png(48, 64)
    r = client.post("/api/segment", files={"file": ("ramp.png", png, "image/png")})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["width"], body["height"], body["num_classes"]) == (64, 48, 3)
    assert body["class_names"] == ["dark", "mid", "bright"]
    label = _decode(body["label_png"])
    image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    np.testing.assert_array_equal(label, segmenter.predict_proba(image).argmax(0))
    assert body["class_pixels"] == np.bincount(label.ravel(), minlength=3).tolist()
    color = _decode(body["color_png"])
    assert color.shape == (48, 64, 3)
    np.testing.assert_array_equal(color[0, 0], (0, 0, 255))  # dark -> palette[0]
    np.testing.assert_array_equal(color[0, -1], (255, 0, 0))  # bright -> palette[2]
    assert _decode(body["overlay_png"]).shape == (48, 64, 3)
    assert body["refined"] is None
    assert {"decode", "inference", "encode", "total"} <= set(body["timings_ms"])


def test_segment_raw_body_and_label_only(client):
    r = client.post(
        "/api/segment?images=false",
        content=gradient_png(),
        headers={"Content-Type": "image/png"},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["color_png"] is None and body["overlay_png"] is None
    assert _decode(body["label_png"]).shape == (48, 64)


def test_non_image_is_rejected_with_400_naming_the_file_not_a_buffer(client):
    r = client.post("/api/segment", files={"file": ("notes.png", b"hello, not a png", "image/png")})
    assert r.status_code == 400
    detail = r.json()["detail"]
    assert detail.startswith("notes.png is not an image") and "PNG, JPEG" in detail
    assert "BytesIO" not in detail and " at 0x" not in detail and "\n" not in detail
    cut = gradient_png()[:120]  # a PNG header, then nothing: fails while decoding
    raw = client.post("/api/segment", content=cut, headers={"Content-Type": "image/png"})
    assert raw.status_code == 400
    assert raw.json()["detail"].startswith("the upload is an unreadable or truncated image")
    assert "BytesIO" not in raw.json()["detail"]


def test_text_part_is_rejected_with_415(client):
    r = client.post("/api/segment", files={"file": ("notes.txt", b"hello", "text/plain")})
    assert r.status_code == 415
    assert "not an image" in r.json()["detail"]


def test_wrong_request_content_type_is_415(client):
    r = client.post("/api/segment", json={"image": "street.png"})
    assert r.status_code == 415
    assert "multipart/form-data" in r.json()["detail"]


def test_missing_file_field_is_400(client):
    r = client.post("/api/segment", files={"image": ("a.png", gradient_png(), "image/png")})
    assert r.status_code == 400
    assert "'file'" in r.json()["detail"]
    # the right field, but as text (no filename): said so, not "send it in the field 'file'"
    r = client.post(
        "/api/segment", data={"file": "a.png"}, files={"other": ("x", b"", "text/plain")}
    )
    assert r.status_code == 400
    assert "holds text, not a file" in r.json()["detail"]


def test_image_over_megapixel_limit_is_413(client):
    # 0.01 MP limit = 10,000 px; 120x100 = 12,000 px (small in bytes: one colour).
    buf = io.BytesIO()
    Image.new("RGB", (120, 100), (9, 9, 9)).save(buf, format="PNG")
    r = client.post("/api/segment", files={"file": ("big.png", buf.getvalue(), "image/png")})
    assert r.status_code == 413
    assert "megapixels" in r.json()["detail"]


def test_upload_over_byte_limit_is_413(client):
    noise = np.random.default_rng(0).integers(0, 256, (300, 300, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="BMP")  # 270 KB > 200 KB limit
    for kwargs in (
        {"files": {"file": ("noise.bmp", buf.getvalue(), "image/bmp")}},
        {"content": buf.getvalue(), "headers": {"Content-Type": "image/bmp"}},
    ):
        r = client.post("/api/segment", **kwargs)
        assert r.status_code == 413
        assert "MB" in r.json()["detail"]
    # chunked upload without Content-Length: counted while streaming in
    data = buf.getvalue()
    chunks = (data[i : i + 65536] for i in range(0, len(data), 65536))
    r = client.post("/api/segment", content=chunks, headers={"Content-Type": "image/bmp"})
    assert r.status_code == 413


def test_refiner_result_and_changed_pixels(segmenter, refiner):
    client = TestClient(create_app(segmenter, refiner=refiner))
    r = client.post("/api/segment", files={"file": ("ramp.png", gradient_png(48, 64), "image/png")})
    assert r.status_code == 200, r.text
    body = r.json()
    base = _decode(body["label_png"])
    refined = _decode(body["refined"]["label_png"])
    assert (refined[0] == 0).all() and (refined[1:] == base[1:]).all()
    assert body["refined"]["changed_pixels"] == int((base[0] != 0).sum()) > 0
    changed = _decode(body["refined"]["changed_png"])
    assert (changed[0, -1] == (255, 0, 255)).all()  # bright -> 0: highlighted in magenta
    assert "refine" in body["timings_ms"]
    assert client.get("/api/info").json()["refiner"] is True


def test_uploads_not_written_unless_asked(tmp_path, segmenter, monkeypatch):
    monkeypatch.chdir(tmp_path)
    client = TestClient(create_app(segmenter))
    r = client.post("/api/segment", content=gradient_png(), headers={"Content-Type": "image/png"})
    assert r.status_code == 200
    assert list(tmp_path.iterdir()) == []
    keep = tmp_path / "kept"
    client = TestClient(create_app(segmenter, save_uploads=keep))
    png = gradient_png()
    client.post("/api/segment", files={"file": ("a.png", png, "image/png")})
    (saved,) = keep.iterdir()
    assert saved.suffix == ".png" and saved.read_bytes() == png
    saved.unlink()  # a raw body has no file name: the suffix comes from the image's header
    client.post("/api/segment", content=png, headers={"Content-Type": "image/png"})
    (saved,) = keep.iterdir()
    assert saved.suffix == ".png" and saved.read_bytes() == png


def test_page_info_and_openapi(client):
    page = client.get("/")
    assert page.status_code == 200 and 'id="result-color"' in page.text
    info = client.get("/api/info").json()
    assert info["class_names"] == ["dark", "mid", "bright"] and info["refiner"] is False
    schema = client.get("/openapi.json").json()
    op = schema["paths"]["/api/segment"]["post"]
    assert "multipart/form-data" in op["requestBody"]["content"]
    assert {"200", "400", "413", "415"} <= set(op["responses"])
    assert "label_png" in schema["components"]["schemas"]["SegmentResponse"]["properties"]


def test_fake_segmenter_is_not_trivial():
    probs = BrightnessSegmenter().predict_proba(
        np.asarray(Image.open(io.BytesIO(gradient_png())).convert("RGB"))
    )
    assert set(np.unique(probs.argmax(0))) == {0, 1, 2}


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ({}, "has no content type"),  # httpx sends none for raw bytes
        ({"Content-Type": "image/svg+xml"}, "a vector drawing"),
        ({"Content-Type": "text/plain"}, "not an image"),
    ],
)
def test_raw_body_without_an_image_type_is_415_even_with_png_bytes(client, headers, why):
    r = client.post("/api/segment", content=gradient_png(), headers=headers)
    assert r.status_code == 415
    assert why in r.json()["detail"] and "image/png" in r.json()["detail"]


def test_svg_part_is_415_and_octet_stream_part_is_read_by_content(client):
    png = gradient_png()
    r = client.post("/api/segment", files={"file": ("a.svg", png, "image/svg+xml")})
    assert r.status_code == 415 and "vector drawing" in r.json()["detail"]
    # what browsers send for a file whose extension they do not know
    r = client.post("/api/segment", files={"file": ("a.data", png, "application/octet-stream")})
    assert r.status_code == 200, r.text


def test_transparent_upload_is_refused_opaque_alpha_is_dropped(client, segmenter):
    rgba = np.zeros((32, 40, 4), np.uint8)
    rgba[..., :3] = np.linspace(0, 255, 40, dtype=np.uint8)[None, :, None]
    rgba[..., 3] = 255
    r = client.post("/api/segment", files={"file": ("opaque.png", _png(rgba), "image/png")})
    assert r.status_code == 200, r.text
    expected = segmenter.predict_proba(rgba[..., :3]).argmax(0)
    np.testing.assert_array_equal(_decode(r.json()["label_png"]), expected)
    rgba[:4, :4, 3] = 0  # a transparent corner: the colour under it is undefined
    r = client.post("/api/segment", files={"file": ("glass.png", _png(rgba), "image/png")})
    assert r.status_code == 400
    detail = r.json()["detail"]
    assert detail.startswith("glass.png: has transparent pixels") and "flatten it" in detail


class ShapeRecorder(BrightnessSegmenter):
    """Records the image sizes the app asks it to segment."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def predict_proba(self, image: np.ndarray) -> np.ndarray:
        self.seen.append(image.shape[:2])
        return super().predict_proba(image)


def test_large_image_is_inferred_at_the_working_size_and_answered_at_its_own(refiner):
    seg = ShapeRecorder()
    client = TestClient(create_app(seg, refiner=refiner, work_megapixels=0.001))  # 1,000 px
    png = gradient_png(60, 80)  # 4,800 px: inferred downscaled
    body = client.post("/api/segment", files={"file": ("big.png", png, "image/png")}).json()
    ((h, w),) = seg.seen
    assert h * w <= 1000 and abs(w / h - 80 / 60) < 0.1
    assert (body["working_height"], body["working_width"]) == (h, w)
    assert (body["height"], body["width"]) == (60, 80)
    label = _decode(body["label_png"])
    assert label.shape == (60, 80) and _decode(body["color_png"]).shape == (60, 80, 3)
    full = BrightnessSegmenter().predict_proba(
        np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    )
    assert (label == full.argmax(0)).mean() > 0.9  # the same classes, up to their edges
    refined = _decode(body["refined"]["label_png"])
    assert refined.shape == (60, 80) and (refined[0] == 0).all()  # the refiner's top row, upsampled
    assert body["refined"]["changed_pixels"] == int((refined != label).sum()) > 0
    # at or under the working size: the model sees the image itself
    seg.seen.clear()
    client.post("/api/segment", files={"file": ("small.png", gradient_png(20, 30), "image/png")})
    assert seg.seen == [(20, 30)]


def test_one_log_line_per_request(client, caplog):
    with caplog.at_level(logging.INFO, logger="dualseg.serve"):
        client.get("/api/info")
        client.post("/api/segment", content=b"x", headers={"Content-Type": "text/plain"})
    lines = [r.getMessage() for r in caplog.records if r.name == "dualseg.serve"]
    assert len(lines) == 2
    assert re.fullmatch(r"GET /api/info 200 \d+\.\d ms", lines[0])
    assert re.fullmatch(r"POST /api/segment 415 \d+\.\d ms", lines[1])


def test_unwritable_save_uploads_fails_when_the_app_is_made(tmp_path, segmenter):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(OutputError, match=r"--save-uploads .*file.sub: cannot create it"):
        create_app(segmenter, save_uploads=blocker / "sub")


@pytest.mark.parametrize("classes", [1, 3, 150])  # 150: more channels than one OpenCV call takes
def test_upsample_probs_is_the_engines_bilinear_resize(classes):
    torch = pytest.importorskip("torch")
    probs = np.random.default_rng(0).random((classes, 9, 13), dtype=np.float32)
    ours = upsample_probs(probs, (31, 40))
    theirs = torch.nn.functional.interpolate(
        torch.from_numpy(probs)[None], size=(31, 40), mode="bilinear", align_corners=False
    )[0].numpy()
    assert ours.shape == (classes, 31, 40)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_a_model_with_more_classes_than_a_label_map_holds_is_refused() -> None:
    from types import SimpleNamespace

    wide = SimpleNamespace(
        meta=SimpleNamespace(class_names=[f"c{i}" for i in range(300)], palette=[(0, 0, 0)] * 300)
    )
    with pytest.raises(ConfigError, match="300 classes"):
        create_app(wide)


def test_a_file_part_without_a_content_type_is_read(client):
    """Python's requests sends files={'file': open(p, 'rb')} with no type on the part."""
    body = (
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="ramp"\r\n\r\n'
        + gradient_png()
        + b"\r\n--XyZ--\r\n"
    )
    headers = {"Content-Type": "multipart/form-data; boundary=XyZ"}
    assert client.post("/api/segment", content=body, headers=headers).status_code == 200
    junk = body.replace(gradient_png(), b"not an image at all")
    r = client.post("/api/segment", content=junk, headers=headers)
    assert r.status_code == 400  # decoded, and refused as no image


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_a_png_colour_key_transparency_is_refused_like_alpha(client, mode):
    """tRNS: a browser shows the key colour as transparent; the colour under it is undefined."""
    image = Image.new(mode, (32, 40), (9, 9, 9) if mode == "RGB" else 9)
    buf = io.BytesIO()
    image.save(buf, format="PNG", transparency=(9, 9, 9) if mode == "RGB" else 9)
    r = client.post("/api/segment", files={"file": ("key.png", buf.getvalue(), "image/png")})
    assert r.status_code == 400 and "transparent pixels" in r.json()["detail"]
    buf = io.BytesIO()  # a key colour no pixel uses: opaque, segmented
    image.save(buf, format="PNG", transparency=(1, 2, 3) if mode == "RGB" else 1)
    r = client.post("/api/segment", files={"file": ("key.png", buf.getvalue(), "image/png")})
    assert r.status_code == 200, r.text


def test_create_app_refuses_a_refiner_of_other_classes_and_limits_past_pillows(segmenter):
    from serve_fakes import TopRowRefiner

    from dualseg.errors import CheckpointError
    from dualseg.imaging import pillow_max_pixels

    with pytest.raises(CheckpointError, match="differ"):
        create_app(segmenter, refiner=TopRowRefiner(("bright", "mid", "dark")))
    with pytest.raises(ConfigError, match="decompression-bomb limit"):
        create_app(segmenter, max_megapixels=2 * pillow_max_pixels() / 1e6)


def test_a_colour_key_that_cannot_be_matched_is_refused(client):
    """A 16-bit RGB PNG's tRNS key is 16-bit while Pillow returns 8-bit pixels: unknowable."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    w, h = 8, 6
    raw = b"".join(b"\x00" + b"\x12\x34" * 3 * w for _ in range(h))  # every pixel the key
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
    png += chunk(b"tRNS", struct.pack(">HHH", 0x1234, 0x1234, 0x1234))
    png += chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    r = client.post("/api/segment", files={"file": ("deep.png", png, "image/png")})
    assert r.status_code == 400 and "transparency colour key" in r.json()["detail"]


def test_pillows_limit_is_read_when_the_app_is_made(segmenter, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 300_000_000)  # a user raised it
    create_app(segmenter, max_megapixels=150)


def test_the_working_size_holds_the_pixel_bound_for_very_thin_images() -> None:
    from dualseg.serve.app import working_size

    assert working_size(1, 20_000_000, 1e6) == (1, 1_000_000)  # was (1, 4472135): 4.5x over
    assert working_size(20_000_000, 2, 1e6) == (1_000_000, 1)
    h, w = working_size(3000, 4000, 1e6)
    assert h * w <= 1e6 and abs(h / w - 0.75) < 0.01  # ordinary images: aspect kept
    assert working_size(30, 40, 1e6) == (30, 40) and working_size(30, 40, 0) == (30, 40)
    assert working_size(19, 1000, 190) == (1, 100)  # within the bound as it is: aspect kept


def test_an_upload_that_cannot_be_saved_is_still_segmented(
    tmp_path, segmenter, monkeypatch, caplog
):
    """A full disk under --save-uploads answered 500 with no reason, and no segmentation."""
    import dualseg.serve.app as app_module

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(app_module, "save_upload", full)
    client = TestClient(create_app(segmenter, save_uploads=tmp_path / "kept"))
    with caplog.at_level(logging.WARNING, logger="dualseg.serve"):
        r = client.post("/api/segment", files={"file": ("a.png", gradient_png(), "image/png")})
    assert r.status_code == 200 and "label_png" in r.json()
    assert "upload not saved (No space left on device)" in caplog.text
