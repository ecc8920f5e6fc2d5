"""``dualseg serve`` wiring with a real (tiny) checkpoint and refiner; uvicorn.run is captured."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient
from serve_fakes import gradient_png

from dualseg.cli import main
from dualseg.engine.checkpoint import save_checkpoint
from dualseg.errors import CheckpointError
from dualseg.models import build_model
from dualseg.refine import BoundaryRefiner, RefinerConfig, build_embedding_net

NAMES = ["road", "car", "sky"]


@pytest.fixture
def files(tmp_path):
    torch.manual_seed(0)
    kwargs = {"num_classes": 3, "renet_hidden": 8}
    model = build_model("dualseg_mobilenet_v2", weights=None, **kwargs)
    ckpt = tmp_path / "tiny.pt"
    save_checkpoint(
        ckpt,
        {
            "arch": "dualseg_mobilenet_v2",
            "model_kwargs": kwargs,
            "model": model.state_dict(),
            "class_names": NAMES,
            "palette": [[128, 64, 128], [0, 0, 142], [70, 130, 180]],
        },
    )
    cfg = RefinerConfig(embed_dim=8, radius=2)
    net = build_embedding_net(cfg.backbone, embed_dim=cfg.embed_dim)
    refiner = BoundaryRefiner(
        net, torch.randn(3, 8), torch.ones(3, dtype=torch.bool), class_names=NAMES, config=cfg
    )
    return ckpt, refiner.save(tmp_path / "refiner.pt")


@pytest.fixture
def captured(monkeypatch):
    import uvicorn

    calls = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.update(app=app, **kw))
    return calls


def test_serve_checkpoint_with_refiner(files, captured, capsys):
    ckpt, refiner = files
    assert main(["serve", "--checkpoint", str(ckpt), "--refiner", str(refiner)]) == 0
    assert captured["host"] == "127.0.0.1" and captured["port"] == 8000
    assert "http://127.0.0.1:8000/" in capsys.readouterr().out
    client = TestClient(captured["app"])
    info = client.get("/api/info").json()
    assert info["class_names"] == NAMES and info["refiner"] is True
    assert info["max_megapixels"] == 20 and info["max_upload_bytes"] == 25 * 2**20
    png = gradient_png(40, 48)
    body = client.post("/api/segment", files={"file": ("a.png", png, "image/png")}).json()
    assert body["width"] == 48 and body["refined"]["changed_pixels"] >= 0
    assert {"inference", "refine", "total"} <= set(body["timings_ms"])


def test_serve_flags_and_warnings(files, captured, capsys, tmp_path):
    ckpt, _ = files
    args = ["serve", "-c", str(ckpt), "--host", "0.0.0.0", "--port", "8123"]
    args += ["--max-megapixels", "0.5", "--max-upload-mb", "1", "--save-uploads", str(tmp_path)]
    assert main(args) == 0
    assert captured["host"] == "0.0.0.0" and captured["port"] == 8123
    assert "no login" in capsys.readouterr().err
    info = TestClient(captured["app"]).get("/api/info").json()
    assert info["max_megapixels"] == 0.5 and info["max_upload_bytes"] == 2**20


def test_serve_refuses_mismatched_refiner(files, captured, tmp_path):
    ckpt, _ = files
    cfg = RefinerConfig(embed_dim=4)
    other = BoundaryRefiner(
        build_embedding_net(cfg.backbone, embed_dim=4),
        torch.randn(2, 4),
        torch.ones(2, dtype=torch.bool),
        class_names=["x", "y"],
        config=cfg,
    ).save(tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="refiner was fit for 2"):
        from dualseg.commands.serve import main as serve_main

        serve_main(["-c", str(ckpt), "--refiner", str(other)])
    assert main(["serve", "-c", str(ckpt), "--refiner", str(other)]) == 1  # one-line error
    assert "app" not in captured
