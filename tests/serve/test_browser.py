"""End to end: uvicorn on loopback + the page in headless Debian Chromium (Playwright).

Skips cleanly when /usr/bin/chromium (or Playwright) is absent; never downloads a browser.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from serve_fakes import BrightnessSegmenter, TopRowRefiner, gradient_png

from dualseg.serve.app import create_app

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).is_file(), reason="Debian chromium is not installed (apt install chromium)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server_url() -> Iterator[str]:
    app = create_app(BrightnessSegmenter(), refiner=TopRowRefiner(), model_name="fake")
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("uvicorn did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_upload_in_chromium_shows_segmentation(server_url, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    image = tmp_path / "ramp.png"
    image.write_bytes(gradient_png(48, 64))
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(server_url + "/")
            page.wait_for_selector("#legend li")  # /api/info answered: 3 classes listed
            for img in ("#input-img", "#result-color", "#result-overlay"):  # no broken icons
                assert not page.is_visible(img)
            page.set_input_files("#file", str(image))
            for img in ("#result-color", "#result-overlay", "#result-changed"):
                page.wait_for_function(
                    "(sel) => { const i = document.querySelector(sel);"
                    " return i && i.complete && i.naturalWidth === 64; }",
                    arg=img,
                    timeout=20_000,
                )
            assert page.is_visible("#refined-fig")
            assert "inference" in page.inner_text("#timings")
            assert page.locator("#legend li.present").count() == 3
            assert "Changed pixels" in page.inner_text("#changed-caption")
            assert any(c.isdigit() for c in page.inner_text("#changed-caption"))
            # an upload that fails: the previous result is cleared, the reason shown
            bad = tmp_path / "notes.png"
            bad.write_bytes(b"hello, not a png")
            page.set_input_files("#file", str(bad))
            page.wait_for_selector("#status.error", timeout=20_000)
            status = page.inner_text("#status")
            assert "error 400" in status and "notes.png is not an image" in status
            assert "BytesIO" not in status
            assert page.locator("#legend li").count() == 3
            assert page.locator("#legend li.present").count() == 0
            assert page.inner_text("#changed-caption") == "Changed pixels (magenta)"
            assert not page.is_visible("#refined-fig") and not page.is_visible("#changed-fig")
            assert page.inner_text("#timings") == ""
            for img in ("#input-img", "#result-color", "#result-overlay"):
                page.wait_for_function(
                    "(sel) => !document.querySelector(sel).hasAttribute('src')", arg=img
                )
                assert not page.is_visible(img)
        finally:
            browser.close()
