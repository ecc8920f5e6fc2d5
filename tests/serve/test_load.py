"""``dualseg serve`` under load: inference runs on a bounded pool of worker threads.

A fake slow model blocks on images wider than 100 px until the test releases it, so the order of
events is fixed by the test, not by timing (timeouts are only generous safety nets).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient
from serve_fakes import BrightnessSegmenter, gradient_png

from dualseg.serve.app import create_app

PNG = {"Content-Type": "image/png"}


class SlowSegmenter(BrightnessSegmenter):
    """Images wider than 100 px wait for ``release``: a big image that takes long."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def predict_proba(self, image: np.ndarray) -> np.ndarray:
        if image.shape[1] > 100:
            self.started.set()
            assert self.release.wait(timeout=60), "the test never released the slow model"
        return super().predict_proba(image)


@pytest.fixture
def slow() -> Iterator[SlowSegmenter]:
    seg = SlowSegmenter()
    yield seg
    seg.release.set()  # never leave a worker blocked, whatever the test did


def _wait_busy(client: TestClient, busy: int) -> None:
    """Until /api/info reports ``busy`` requests in the pool (the event loop stays free)."""
    deadline = time.monotonic() + 30
    while client.get("/api/info").json()["busy"] != busy:
        assert time.monotonic() < deadline, f"the pool never held {busy} requests"
        time.sleep(0.01)


def test_small_request_is_answered_while_a_big_one_is_processed(slow):
    with TestClient(create_app(slow)) as client, ThreadPoolExecutor(1) as background:
        big = background.submit(
            client.post, "/api/segment", content=gradient_png(48, 128), headers=PNG
        )
        assert slow.started.wait(timeout=30)
        small = client.post("/api/segment", content=gradient_png(24, 32), headers=PNG)
        assert small.status_code == 200 and small.json()["width"] == 32
        assert not big.done()  # the big one is still being segmented
        slow.release.set()
        response = big.result(timeout=60)
        assert response.status_code == 200 and response.json()["width"] == 128


def test_full_queue_is_503_with_retry_after_and_frees_up(slow):
    app = create_app(slow, workers=1, queue_size=1)
    with TestClient(app) as client, ThreadPoolExecutor(2) as background:
        running = background.submit(
            client.post, "/api/segment", content=gradient_png(48, 128), headers=PNG
        )
        assert slow.started.wait(timeout=30)
        waiting = background.submit(
            client.post, "/api/segment", content=gradient_png(24, 32), headers=PNG
        )
        _wait_busy(client, 2)  # one running, one waiting: the queue is full
        refused = client.post("/api/segment", content=gradient_png(24, 32), headers=PNG)
        assert refused.status_code == 503
        assert int(refused.headers["Retry-After"]) >= 1
        detail = refused.json()["detail"]
        assert detail.startswith("the server is busy") and "--queue-size 1" in detail
        assert not waiting.done()  # queued behind the slow one, not refused
        slow.release.set()
        assert running.result(timeout=60).status_code == 200
        assert waiting.result(timeout=60).status_code == 200
        _wait_busy(client, 0)
        again = client.post("/api/segment", content=gradient_png(24, 32), headers=PNG)
        assert again.status_code == 200


def test_a_job_whose_client_has_gone_never_runs():
    """Clients that gave up kept their jobs in the queue: each ran (a minute for a big image)
    and the server answered 503 to everyone else meanwhile."""
    import asyncio

    from fastapi import HTTPException

    from dualseg.serve.app import _Workers

    async def scenario() -> None:
        pool = _Workers(1, 5)
        release, ran = threading.Event(), []
        first = asyncio.ensure_future(pool.run(release.wait, 30))
        while pool.pending == 0:
            await asyncio.sleep(0.01)

        async def gone() -> bool:
            return True

        with pytest.raises(HTTPException) as refused:
            await pool.run(ran.append, "ran", gone=gone)
        assert refused.value.status_code == 499 and ran == [] and pool.pending == 1
        release.set()
        assert await first is True
        assert pool.pending == 0
        pool.shutdown()

    asyncio.run(scenario())


def test_closing_answers_the_waiting_requests_and_lets_the_running_one_finish(slow):
    """Ctrl-C: uvicorn waits for every open request, so the server worked through the whole
    queue before it stopped; the waiting ones are now answered 503 at once."""
    app = create_app(slow, workers=1, queue_size=2)
    with TestClient(app) as client, ThreadPoolExecutor(2) as background:
        running = background.submit(
            client.post, "/api/segment", content=gradient_png(48, 128), headers=PNG
        )
        assert slow.started.wait(timeout=30)
        waiting = background.submit(
            client.post, "/api/segment", content=gradient_png(24, 32), headers=PNG
        )
        _wait_busy(client, 2)
        app.state.workers.close()
        answer = waiting.result(timeout=30)
        assert answer.status_code == 503 and "shutting down" in answer.json()["detail"]
        late = client.post("/api/segment", content=gradient_png(24, 32), headers=PNG)
        assert late.status_code == 503
        slow.release.set()
        assert running.result(timeout=60).status_code == 200


def test_the_app_sees_a_waiting_clients_disconnect(slow):
    """Through the whole app (its request-log middleware included, which hid the disconnect
    when it was Starlette's BaseHTTPMiddleware): a waiting request whose client has gone is
    answered 499 and never runs."""
    import asyncio

    app = create_app(slow, workers=1, queue_size=2)
    body = gradient_png(24, 32)
    with TestClient(app) as client, ThreadPoolExecutor(1) as background:
        running = background.submit(
            client.post, "/api/segment", content=gradient_png(48, 128), headers=PNG
        )
        assert slow.started.wait(timeout=30)
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        sent = []

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/api/segment", "raw_path": b"",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
            "headers": [(b"content-type", b"image/png"), (b"content-length", b"%d" % len(body))],
        }  # fmt: skip
        asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=30))
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
        slow.release.set()
        assert running.result(timeout=60).status_code == 200
        _wait_busy(client, 0)
