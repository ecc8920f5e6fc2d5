"""``dualseg serve`` wiring with a real (tiny) checkpoint and refiner; run_server is captured."""

from __future__ import annotations

import socket
import sys

import pytest
import torch
from fastapi.testclient import TestClient
from serve_fakes import NAMES, gradient_png

from dualseg.cli import main
from dualseg.commands import serve as serve_command
from dualseg.errors import CheckpointError
from dualseg.refine import BoundaryRefiner, RefinerConfig, build_embedding_net


@pytest.fixture
def captured(monkeypatch):
    """run_server records its arguments instead of serving; the port check records its
    address (whether a port is free on the test machine is not what these tests test)."""
    calls = {}
    monkeypatch.setattr(
        serve_command, "run_server", lambda _, app, **kw: calls.update(app=app, **kw)
    )
    monkeypatch.setattr(
        serve_command, "check_port", lambda host, port: calls.update(checked=(host, port))
    )
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
    assert captured["checked"] == ("0.0.0.0", 8123)
    info = TestClient(captured["app"]).get("/api/info").json()
    assert info["max_megapixels"] == 0.5 and info["max_upload_bytes"] == 2**20
    assert (info["work_megapixels"], info["workers"], info["queue_size"]) == (1.0, 2, 8)


def test_serve_load_flags_reach_the_app(files, captured):
    ckpt, _ = files
    args = ["serve", "-c", str(ckpt), "--work-megapixels", "0.001", "--workers", "3"]
    assert main([*args, "--queue-size", "0"]) == 0
    client = TestClient(captured["app"])
    info = client.get("/api/info").json()
    assert (info["work_megapixels"], info["workers"], info["queue_size"]) == (0.001, 3, 0)
    body = client.post(
        "/api/segment", content=gradient_png(40, 50), headers={"Content-Type": "image/png"}
    ).json()
    assert (body["width"], body["height"]) == (50, 40)
    assert body["working_width"] * body["working_height"] <= 1000 < 40 * 50


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--work-megapixels", "-1", "--work-megapixels: must be 0 (full size) or >= 0.001"),
        ("--work-megapixels", "1e-12", "--work-megapixels: must be 0 (full size) or >= 0.001"),
        ("--max-upload-mb", "1e-9", "--max-upload-mb: must be >= 0.01, got 1e-9"),
        ("--max-megapixels", "nan", "--max-megapixels: expected a finite number"),
        ("--workers", "0", "--workers: must be >= 1"),
        ("--queue-size", "-1", "--queue-size: must be >= 0"),
        ("--port", "70000", "--port: must be at most 65535"),
    ],
)
def test_serve_refuses_bad_load_flags(files, captured, capsys, flag, value, message):
    ckpt, _ = files
    with pytest.raises(SystemExit) as exit_:  # refused while the line is parsed
        main(["serve", "-c", str(ckpt), flag, value])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert "app" not in captured


def test_unwritable_save_uploads_is_one_line_before_loading(files, captured, capsys, tmp_path):
    ckpt, _ = files
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    target = blocker / "uploads"
    missing_ckpt = tmp_path / "never-read.pt"  # the folder is checked before the model loads
    assert main(["serve", "-c", str(missing_ckpt), "--save-uploads", str(target)]) == 1
    out = capsys.readouterr()
    assert f"--save-uploads {target}: cannot create it" in out.err
    assert len(out.err.strip().splitlines()) == 1 and "Traceback" not in out.err
    assert "http://" not in out.out and "app" not in captured
    assert blocker.read_text() == "not a folder"
    # a writable one is created up front and left clean (no probe file)
    fresh = tmp_path / "new" / "uploads"
    assert main(["serve", "-c", str(ckpt), "--save-uploads", str(fresh)]) == 0
    assert fresh.is_dir() and list(fresh.iterdir()) == []


def test_port_in_use_is_one_line_without_the_banner(files, capsys, monkeypatch):

    ckpt, _ = files
    monkeypatch.setattr(serve_command, "run_server", lambda *a, **k: pytest.fail("it served"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "-c", str(ckpt), "--port", str(port)]) == 1
    out = capsys.readouterr()
    assert f"cannot listen on 127.0.0.1:{port}" in out.err and "--port" in out.err
    assert len(out.err.strip().splitlines()) == 1
    assert "http://" not in out.out


def test_serve_help_and_message_without_the_serve_extra(files, capsys, monkeypatch):
    # Hide fastapi as if it were not installed (None in sys.modules makes its import fail),
    # and forget the app module so that it is imported afresh.
    monkeypatch.setitem(sys.modules, "fastapi", None)
    monkeypatch.delitem(sys.modules, "dualseg.serve.app", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    assert "--work-megapixels" in capsys.readouterr().out
    ckpt, _ = files
    assert main(["serve", "-c", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert "'fastapi' is not installed" in err and "pip install 'dualseg[serve]'" in err
    assert len(err.strip().splitlines()) == 1
    # the Python API says the same
    with pytest.raises(ModuleNotFoundError, match=r"dualseg\[serve\]"):
        import dualseg.serve.app  # noqa: F401


def test_serve_refuses_mismatched_refiner(files, captured, tmp_path):
    ckpt, _ = files
    cfg = RefinerConfig(embed_dim=4)
    other = BoundaryRefiner(
        build_embedding_net(
            cfg.backbone, embed_dim=4, output_stride=cfg.output_stride, aspp_rates=cfg.aspp_rates
        ),
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


def test_serve_logs_one_line_per_request_on_stderr(files, monkeypatch, capsys):

    ckpt, _ = files
    monkeypatch.setattr(serve_command, "check_port", lambda host, port: None)

    # "serving" = two requests made while the server would be running
    def serve(_, app, **__):
        client = TestClient(app)
        client.get("/api/info")
        client.post("/api/segment", content=b"x", headers={"Content-Type": "text/plain"})

    monkeypatch.setattr(serve_command, "run_server", serve)
    assert main(["serve", "-c", str(ckpt)]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith(" ms") and " GET /api/info 200 " in lines[0]
    assert " POST /api/segment 415 " in lines[1]


def test_serve_runs_the_model_with_tta_and_slide(files, captured, monkeypatch):
    from dualseg.engine.predict import Segmenter

    seen = []
    real = Segmenter.predict_proba

    def spy(self, image, **options):
        seen.append(options)
        return real(self, image, **options)

    monkeypatch.setattr(Segmenter, "predict_proba", spy)
    ckpt, refiner = files
    args = ["serve", "-c", str(ckpt), "--refiner", str(refiner), "--tta-flip"]
    args += ["--tta-scales", "0.5", "1.0", "--mode", "slide", "--window", "32", "32"]
    assert main(args) == 0
    client = TestClient(captured["app"])
    png = gradient_png(40, 48)
    body = client.post("/api/segment", files={"file": ("a.png", png, "image/png")}).json()
    assert body["width"] == 48 and "refined" in body
    assert seen and seen[-1]["tta_flip"] is True and tuple(seen[-1]["tta_scales"]) == (0.5, 1.0)
    assert seen[-1]["mode"] == "slide" and tuple(seen[-1]["window"]) == (32, 32)


def test_serve_refuses_tta_for_an_onnx_model(tmp_path, capsys):
    fake = tmp_path / "m.onnx"
    fake.write_bytes(b"not onnx")
    assert main(["serve", "--onnx", str(fake), "--tta-flip"]) == 1
    err = capsys.readouterr().err
    assert "need --checkpoint" in err and "Traceback" not in err


def test_an_address_of_another_machine_is_named_as_such():
    """--host 192.0.2.1 (no address of this machine) was told to stop the program using the
    port: there is none."""
    from dualseg.errors import ConfigError

    with pytest.raises(ConfigError, match=r"192\.0\.2\.1: it is no address of this machine"):
        serve_command.check_port("192.0.2.1", 18999)


def test_serve_checks_an_exported_models_label_contract_against_the_refiners(
    files, captured, tmp_path, capsys
):
    """An exported model had no contract, so a refiner fitted on labels read otherwise (here
    12-bit images) was served beside it without a word."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from dualseg.export.export import export_checkpoint
    from dualseg.export.runtime import ExportedSegmenter

    ckpt, refiner_file = files
    onnx = tmp_path / "m.onnx"
    export_checkpoint(ckpt, onnx)
    contract = ExportedSegmenter(onnx).contract
    assert contract is not None and contract.class_names == tuple(NAMES)
    refiner = BoundaryRefiner.load(refiner_file)
    refiner.label_contract = {**contract.to_dict(), "bit_depth": 12}
    other = refiner.save(tmp_path / "12bit.pt")
    assert main(["serve", "--onnx", str(onnx), "--refiner", str(other)]) == 1
    err = capsys.readouterr().err
    assert "read otherwise" in err and "bit depth" in err and len(err.splitlines()) == 1
    assert "app" not in captured
    refiner.label_contract = contract.to_dict()  # the same contract: served
    same = refiner.save(tmp_path / "same.pt")
    assert main(["serve", "--onnx", str(onnx), "--refiner", str(same)]) == 0


def test_serve_warns_of_a_refiner_chosen_on_another_base(files, captured, tmp_path, capsys):
    """As ``eval --refiner`` and ``refine apply`` do; serve said nothing."""
    from dualseg.refine.base import checkpoint_base, model_fingerprint

    ckpt, refiner_file = files
    refiner = BoundaryRefiner.load(refiner_file)
    own = model_fingerprint(checkpoint_base(ckpt).module)
    for fingerprint, warned in ((own, False), ("0" * 16, True)):
        refiner.calibration = {"split": "dev", "images": 2, "base_fingerprint": fingerprint}
        saved = refiner.save(tmp_path / f"{fingerprint}.pt")
        assert main(["serve", "-c", str(ckpt), "--refiner", str(saved)]) == 0
        err = capsys.readouterr().err
        assert ("chosen on another base model than this one" in err) is warned
