"""A tap refiner on a dualseg checkpoint: refine fit --base-features auto, then eval --refiner."""

from __future__ import annotations

from checkpoint_helpers import SYNTHETIC, write_peer_checkpoint
from dualseg.cli import main
from dualseg.data import make_synthetic_dataset
from dualseg.refine import BoundaryRefiner


def test_eval_reads_a_tap_refiner_on_the_base_in_every_mode(tmp_path, capsys) -> None:
    data = make_synthetic_dataset(tmp_path / "data", n_train=2, n_val=1, size=(64, 64))
    ckpt = write_peer_checkpoint(tmp_path / "peer.pt", SYNTHETIC.class_names)
    out = tmp_path / "r.pt"
    argv = ["refine", "fit", "--data", str(data), "--base", str(ckpt), "--out", str(out)]
    argv += ["--base-features", "auto", "--decoder-channels", "4", "--embed-dim", "4"]
    argv += ["--steps", "1", "--batch-size", "2", "--crop-size", "64", "64", "--radius", "2"]
    argv += ["--num-triplets", "16", "--aspp-rates", "1", "2", "--device", "cpu", "--no-progress"]
    assert main([*argv, "--log-every", "0"]) == 0
    taps = BoundaryRefiner.load(out).taps
    assert taps.names == ("backbone.features.3", "backbone.features.17") and taps.strides[0] == 4
    evaluate = ["eval", "-c", str(ckpt), "--data", str(data), "--refiner", str(out), "--quiet"]
    assert main(evaluate) == 0
    assert main([*evaluate, "--tta-flip"]) == 0  # the base runs once more for the taps
    assert main(["export", "--refiner", str(out), "--out", str(tmp_path / "r.onnx")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "exported refiner cannot run" in err
