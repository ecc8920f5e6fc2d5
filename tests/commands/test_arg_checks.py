"""Out-of-range numbers are refused while the command line is parsed: exit status 1, a last
line naming the flag and the value, and nothing loaded or written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from checkpoint_helpers import write_synthetic_checkpoint
from dualseg.cli import main as cli_main
from dualseg.data import make_synthetic_dataset


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("args")
    image = root / "image.png"
    Image.fromarray(np.zeros((32, 48, 3), np.uint8)).save(image)
    return {
        "ckpt": write_synthetic_checkpoint(root / "model.pt"),
        "data": Path(make_synthetic_dataset(root / "syn", n_train=1, n_val=1, size=(32, 48))),
        "image": image,
    }


def _refused_at_parsing(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--boundary-tolerance", "-1"), ("--trimap-width", "-2"), ("--workers", "-1")],
)
def test_eval_refuses_negative_widths_and_workers(files, tmp_path, capsys, flag, value) -> None:
    out = tmp_path / "eval"
    argv = ["eval", "-c", str(files["ckpt"]), "--data", str(files["data"]), "-o", str(out)]
    line = _refused_at_parsing([*argv, flag, value], capsys)
    assert line.startswith("dualseg eval: error: ")
    assert f"argument {flag}: must be >= 0, got {value}" in line
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--boundary-tolerance", "--trimap-width"])
def test_eval_refuses_a_band_wider_than_256_px(files, tmp_path, capsys, flag) -> None:
    """100000 padded every label map by 100000 px: an 80 GB allocation and a traceback."""
    from dualseg.errors import ConfigError
    from dualseg.metrics import BoundaryMetrics

    out = tmp_path / "eval"
    argv = ["eval", "-c", str(files["ckpt"]), "--data", str(files["data"]), "-o", str(out)]
    line = _refused_at_parsing([*argv, flag, "100000", "--device", "cpu", "-q"], capsys)
    assert f"argument {flag}: must be at most 256 pixels, got 100000" in line
    assert not out.exists()
    assert cli_main([*argv, flag, "256", "--device", "cpu", "-q"]) == 0
    with pytest.raises(ConfigError, match=r"0\.\.256 px"):
        BoundaryMetrics(2, tolerance=257)


@pytest.mark.parametrize("value", ["5", "-0.1", "nan", "half"])
def test_predict_refuses_an_alpha_outside_0_1_before_writing(files, tmp_path, capsys, value):
    out = tmp_path / "pred"
    argv = ["predict", str(files["image"]), "-c", str(files["ckpt"]), "-o", str(out)]
    line = _refused_at_parsing([*argv, "--alpha", value], capsys)
    assert line.startswith("dualseg predict: error: argument --alpha: ")
    assert "[0, 1]" in line and value in line
    assert not out.exists()


def test_predict_accepts_alpha_0_and_1(files, tmp_path) -> None:
    out = tmp_path / "pred"
    argv = ["predict", str(files["image"]), "-c", str(files["ckpt"]), "-o", str(out), "-q"]
    assert cli_main([*argv, "--alpha", "1"]) == 0
    assert (out / "overlay" / "image.png").is_file()


def test_refine_apply_refuses_a_negative_alpha_before_writing(files, tmp_path, capsys) -> None:
    out = tmp_path / "apply"
    argv = ["refine", "apply", str(files["image"]), "-r", "r.pt", "-b", str(files["ckpt"])]
    line = _refused_at_parsing([*argv, "-o", str(out), "--alpha", "-1"], capsys)
    assert "argument --alpha: must be in [0, 1], got -1" in line
    assert not out.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["refine", "fit", "--data", "missing", "--workers", "-1"],
        ["augment", "missing", "dst", "--count", "1", "--workers", "-1"],
    ],
)
def test_other_workers_flags_refuse_negatives(tmp_path, capsys, monkeypatch, argv) -> None:
    monkeypatch.chdir(tmp_path)
    line = _refused_at_parsing(argv, capsys)
    assert "argument --workers: must be >= 0, got -1" in line
    assert list(tmp_path.iterdir()) == []


def test_onnx_runtime_takes_threads_and_refuses_what_does_not_apply() -> None:
    """--onnx ignored --device, --threads and --amp: onnxruntime ran on every core."""
    import argparse

    import torch

    from dualseg.commands.common import onnx_runtime
    from dualseg.errors import ConfigError

    def args(**kw):
        return argparse.Namespace(**{"amp": False, "threads": 0, "device": "auto", **kw})

    cpu = torch.device("cpu")
    assert onnx_runtime(args(threads=2), cpu) == {"providers": None, "threads": 2}
    assert onnx_runtime(args(), cpu) == {"providers": None, "threads": None}
    with pytest.raises(ConfigError, match="--amp applies to --checkpoint models only"):
        onnx_runtime(args(amp=True), cpu)
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(ConfigError, match="needs onnxruntime-gpu"):
            onnx_runtime(args(device="cuda"), torch.device("cuda", 0))
        assert onnx_runtime(args(), torch.device("cuda", 0))["providers"] is None  # auto


@pytest.mark.parametrize(
    ("text", "said"), [("-3", "must be >= 1, got -3"), ("x", "expected an integer >= 1, got 'x'")]
)
def test_a_count_of_at_least_one_names_its_bound(text: str, said: str) -> None:
    import argparse

    from dualseg.commands.common import positive_int

    with pytest.raises(argparse.ArgumentTypeError, match=said):  # it said ">= 0" for -3
        positive_int(text)


@pytest.mark.parametrize("command", [["predict", "x.png", "-o", "o"], ["eval", "--data", "d"]])
def test_more_threads_than_openmp_can_start_is_refused_at_parsing(command, capsys) -> None:
    """--threads 100000 ended in an allocator failure blamed on the checkpoint read next."""
    line = _refused_at_parsing([*command, "-c", "m.pt", "--threads", "100000"], capsys)
    assert "argument --threads: must be at most 1024, got 100000" in line
