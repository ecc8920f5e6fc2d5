"""benchmarks/camvid_refine.py: method B reused only when fit as this call asks, its fit
resumable, and each refinement timed beside the base it refines."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from benchmark_helpers import load_benchmark
from dualseg.refine.shared import SharedFeatures

refine = load_benchmark("camvid_refine")


def test_reuse_refuses_a_refiner_fit_with_other_flags(camvid, tmp_path: Path) -> None:
    from dualseg.refine.refiner import RefinerConfig

    saved = RefinerConfig(steps=2000, input_scale=0.5, backbone_source="base-frozen")
    path = tmp_path / "refiner_peer.pt"
    assert refine.refiner_mismatch(saved, saved, path) is None
    wanted = RefinerConfig(steps=2000, input_scale=1.0, backbone_source="base-frozen")
    assert "input_scale = 0.5, this call asks 1.0" in refine.refiner_mismatch(saved, wanted, path)
    finer = RefinerConfig(
        steps=2000, input_scale=0.5, output_stride=8, backbone_source="base-frozen"
    )
    assert "output_stride = 16, this call asks 8" in refine.refiner_mismatch(saved, finer, path)
    args = camvid.parse_args(["--data", "d", "--refine-output-stride", "8"])
    assert args.refine_output_stride == 8
    decoder = RefinerConfig(
        steps=2000, input_scale=0.5, backbone_source="base-frozen", decoder_channels=48
    )
    assert "decoder_channels = 0, this call asks 48" in refine.refiner_mismatch(
        saved, decoder, path
    )
    args = camvid.parse_args(["--data", "d", "--refine-decoder-channels", "48"])
    assert args.refine_decoder_channels == 48


def test_refinement_is_timed_on_the_same_images_right_after_the_base(camvid) -> None:
    import torch

    class Refiner:  # records what it is given: the base's logits for each image
        def __init__(self) -> None:
            self.seen: list[torch.Tensor] = []

        def refine(self, images: torch.Tensor, scores: torch.Tensor, features: object) -> None:
            assert features is None  # a plain Conv2d has no backbone to share
            self.seen.append(scores)

        def shared_features(self, model: torch.nn.Module) -> SharedFeatures:
            return SharedFeatures(model)

    model = torch.nn.Conv2d(3, 4, 1).eval()
    loader = [(torch.randn(1, 3, 8, 8), None) for _ in range(6)]
    base_s, extra_s, shared = refine.time_inference(model, loader, 3, torch.device("cpu"))
    assert base_s > 0 and extra_s == 0.0 and not shared  # no refiner: nothing extra
    refiner = Refiner()
    assert not refine.time_inference(model, loader, 3, torch.device("cpu"), refiner)[2]
    assert len(refiner.seen) == 5  # 2 warm-up + 3 timed, each right after its own forward
    with torch.no_grad():
        assert torch.equal(refiner.seen[0], model(loader[0][0]))


def test_timing_says_whether_the_refiner_read_the_base_features(camvid) -> None:
    import torch

    class Base(torch.nn.Module):  # a model with a backbone: its output can be shared
        def __init__(self) -> None:
            super().__init__()
            self.backbone = torch.nn.Conv2d(3, 4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.backbone(x)

    class Refiner:
        def __init__(self, active: bool) -> None:
            self.active, self.given = active, []

        def refine(self, images: torch.Tensor, scores: torch.Tensor, features: object) -> None:
            self.given.append(features)

        def shared_features(self, model: torch.nn.Module) -> SharedFeatures:
            return SharedFeatures(model, active=self.active)

    model = Base().eval()
    loader = [(torch.randn(1, 3, 8, 8), None) for _ in range(5)]
    sharing = Refiner(active=True)
    assert refine.time_inference(model, loader, 3, torch.device("cpu"), sharing)[2]
    assert all(f is not None for f in sharing.given)
    own = Refiner(active=False)  # e.g. a refiner at another stride: runs its own backbone
    assert not refine.time_inference(model, loader, 3, torch.device("cpu"), own)[2]
    assert own.given == [None] * 5


def test_a_decision_chosen_by_another_metric_says_so(camvid) -> None:
    from dualseg.refine.refiner import RefinerConfig

    cfg = RefinerConfig(gate_margin=0.1, prior_weight=0.5)
    assert refine.decision_label(cfg) == "gate 0.1, prior 0.5 (chosen on dev)"
    by_edges = refine.decision_label(cfg, "boundary_f1")
    assert by_edges == "gate 0.1, prior 0.5 (chosen on dev by boundary F1)"
    args = camvid.parse_args(["--data", "d", "--refine-decision-metric", "boundary_f1"])
    assert args.refine_decision_metric == "boundary_f1"
    assert camvid.parse_args(["--data", "d"]).refine_decision_metric == "miou"
    assert camvid.parse_args(["--data", "d"]).refine_decision_max_broken_ratio is None
    args = camvid.parse_args(["--data", "d", "--refine-decision-max-broken-ratio", "0.5"])
    assert args.refine_decision_max_broken_ratio == 0.5
    within = "gate 0.1, prior 0.5 (chosen on dev, broken <= 0.5 x fixed)"
    assert refine.decision_label(cfg, "miou", 0.5) == within
    args = camvid.parse_args(["--data", "d", "--refine-decision-metric", "net_fixed"])
    net = "gate 0.1, prior 0.5 (chosen on dev by pixels fixed less twice those broken)"
    assert refine.decision_label(cfg, args.refine_decision_metric) == net


def test_a_reused_refiner_must_have_been_fit_on_the_same_inputs(camvid, tmp_path: Path) -> None:
    import json

    path = tmp_path / "refiner_peer.pt"
    record = path.with_suffix(".inputs.json")
    inputs = {"fit_split": "train_fit", "fit_list_sha256": "ab", "prototype_limit": None,
              "base": "f00d"}  # fmt: skip
    assert "does not record what it was fit on" in refine.inputs_mismatch(record, inputs, path)
    record.write_text(json.dumps(inputs))
    assert refine.inputs_mismatch(record, inputs, path) is None
    for key, value in (("fit_split", "train"), ("prototype_limit", 3), ("base", "beef")):
        message = refine.inputs_mismatch(record, {**inputs, key: value}, path)
        assert f"fit with {key} = " in message and "delete it to fit it again" in message


def test_method_b_keeps_its_training_state_and_reuse_continues_it(
    camvid, tmp_path: Path, monkeypatch
) -> None:
    """An interrupted fit of method B saves its state beside the refiner, and --reuse resumes it
    (on the same inputs), where every rerun started again at step 0."""
    from types import SimpleNamespace

    import torch

    from dualseg.data.synthetic import make_synthetic_dataset
    from dualseg.errors import Terminated

    data = tmp_path / "camvid"
    make_synthetic_dataset(data, n_train=2, n_val=1, size=(16, 16))
    (data / "meta.json").unlink()  # read with the camvid preset, as the benchmark does
    given = []

    class Refiner:
        @classmethod
        def fit(cls, *args, **kwargs):
            given.append(kwargs)
            raise Terminated

    monkeypatch.setattr(refine, "BoundaryRefiner", Refiner)
    out = tmp_path / "out"
    out.mkdir()
    meta = SimpleNamespace(class_names=[f"c{i}" for i in range(11)])
    for flags, resumed in (([], False), (["--reuse"], True)):
        args = camvid.parse_args(
            ["--data", str(data), "--out", str(out), "--refine-steps", "10", *flags]
        )
        with pytest.raises(Terminated):
            refine.fit_refiners(
                args, out, {"peer": torch.nn.Conv2d(3, 11, 1)}, meta, torch.device("cpu"), {}
            )
        assert given[-1]["checkpoint"] == out / "refiner_all.train.pt"
        assert given[-1]["resume"] is resumed
        assert given[-1]["fit_inputs"]["fit_split"] == "train"  # another split is refused


def test_dense_crf_is_timed_on_the_probabilities_right_after_the_base(camvid) -> None:
    import torch

    class CRF:  # as dualseg.refine.crf.CRFSettings: no backbone to share, probabilities in
        def __init__(self) -> None:
            self.seen: list[torch.Tensor] = []

        def refine(self, images: torch.Tensor, probs: torch.Tensor) -> None:
            self.seen.append(probs)
            time.sleep(0.01)  # more than the base's labels of a 4x8x8 map take

    model = torch.nn.Conv2d(3, 4, 1).eval()
    loader = [(torch.randn(1, 3, 8, 8), None) for _ in range(4)]
    crf = CRF()
    base_s, extra_s, shared = refine.time_inference(model, loader, 2, torch.device("cpu"), crf)
    assert base_s > 0 and extra_s > 0 and not shared and len(crf.seen) == 4
    with torch.no_grad():
        assert torch.allclose(crf.seen[0], model(loader[0][0]).softmax(1))


def test_what_a_refiner_adds_is_its_time_less_the_base_labels_it_takes_itself(
    camvid, monkeypatch
) -> None:
    import torch

    def slow_labels(scores: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return scores.max(1).indices

    class Refiner:  # 30 ms, its own labels among them
        def refine(self, images: torch.Tensor, probs: torch.Tensor) -> None:
            time.sleep(0.03)

    monkeypatch.setattr(refine, "class_labels", slow_labels)
    model = torch.nn.Conv2d(3, 4, 1).eval()
    loader = [(torch.randn(1, 3, 8, 8), None) for _ in range(5)]
    base_s, extra_s, _ = refine.time_inference(model, loader, 3, torch.device("cpu"), Refiner())
    assert base_s >= 0.02  # the forward and the labels
    assert 0 < extra_s < 0.025  # the refiner's 30 ms less the labels' 20 ms: ~10 ms


@pytest.mark.slow
def test_the_chosen_decision_is_saved_for_dualseg_eval(camvid, camvid_root, tmp_path) -> None:
    """refiner_NAME_chosen.pt decides as the dev sweep chose: dualseg eval --refiner scores
    the benchmark's row on any other images."""
    import torch

    from checkpoint_helpers import write_peer_checkpoint
    from dualseg.data import build_dataset
    from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint
    from dualseg.io import file_digest
    from dualseg.refine import BoundaryRefiner, RefinerConfig
    from dualseg.refine.base import model_fingerprint
    from dualseg.refine.calibrate import DECISION_KEYS, calibrated_on
    from dualseg.refine.embedding import build_embedding_net

    (tmp_path / "data").mkdir()
    lines = [ln.split() for ln in (camvid_root / "train.txt").read_text().splitlines()[:2]]
    dev = "".join(f"{camvid_root / a} {camvid_root / b}\n" for a, b in lines)
    (tmp_path / "data" / "dev.txt").write_text(dev)
    classes = build_dataset(camvid_root, split="val", preset="camvid").meta.class_names
    ckpt = write_peer_checkpoint(tmp_path / "peer.pt", classes)
    model, meta = build_model_from_checkpoint(load_checkpoint(ckpt), device="cpu")
    cfg = RefinerConfig(embed_dim=8, output_stride=16, aspp_rates=(2, 3), top_n=3, radius=3)
    net = build_embedding_net(cfg.backbone, embed_dim=8, output_stride=16, aspp_rates=(2, 3))
    k = len(classes)
    refiner = BoundaryRefiner(net, torch.randn(k, 8), torch.ones(k, dtype=torch.bool),
                              class_names=classes, config=cfg)  # fmt: skip
    args = camvid.parse_args(["--data", str(camvid_root), "--workers", "0"])
    results: dict = {}
    gated = refine.choose_decisions(args, tmp_path, {"peer": model.eval()}, {"peer": refiner},
                                    meta, torch.device("cpu"), results)  # fmt: skip
    chosen = results["decision_sweep_dev"]["peer"]["chosen"]
    loaded = BoundaryRefiner.load(tmp_path / "refiner_peer_chosen.pt")
    decided = {k: getattr(loaded.config, k) for k in DECISION_KEYS}
    assert decided == chosen == {k: getattr(gated["peer"].config, k) for k in DECISION_KEYS}
    # the sweep is recorded as refine fit records it: eval warns on these images and bases
    cal = loaded.calibration
    assert (cal["split"], cal["images"], cal["metric"]) == ("dev", 2, "miou")
    assert cal["image_digests"] == [file_digest(camvid_root / a) for a, _ in lines]
    assert cal["base_fingerprint"] == model_fingerprint(model)
    assert calibrated_on(cal, [camvid_root / lines[1][0]]) == 1
