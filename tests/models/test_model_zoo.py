"""The shared base test for every entry of MODELS: forward/backward, odd sizes, save/load,
predict/predict_proba. 64×64 inputs. The ResNet-34/50/101 models are too slow to run on two
cores: their forward runs on the meta device (shapes only, no arithmetic; backward is the same
code as ResNet-18's) and the largest one is built for real once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dualseg.errors import ConfigError
from dualseg.models import MODELS, backbone_of, build_model

RUN_ON_CPU = [
    "dualseg_resnet18",
    "dualseg_mobilenet_v2",
    "dualseg_timm",
    "deeplabv3_resnet18",
    "deeplabv3_mobilenet_v2",
]
ON_META = sorted(set(MODELS) - set(RUN_ON_CPU))
NUM_CLASSES = 3


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {name: build_model(name, num_classes=NUM_CLASSES) for name in RUN_ON_CPU}


@pytest.mark.parametrize("name", ON_META)
def test_large_models_on_meta_device(name: str) -> None:
    with torch.device("meta"):
        model = build_model(name, num_classes=NUM_CLASSES)
        x = torch.randn(1, 3, 64, 64)
    assert model.eval().predict(x).shape == (1, 64, 64)


def test_resnet101_builds_for_real() -> None:
    model = build_model("dualseg_resnet101", num_classes=NUM_CLASSES)
    n_params = sum(p.numel() for p in model.parameters())
    assert 2 * 42e6 < n_params < 2 * 52e6  # two ResNet-101 bodies + ReNets + ASPPs
    assert model.rgb.backbone.layer4[1].conv2.dilation == (4, 4)  # output stride 8


@pytest.mark.parametrize("name", RUN_ON_CPU)
def test_forward_backward_and_predict(name: str, models: dict, tmp_path: Path) -> None:
    model = models[name]
    model.train()
    x = torch.randn(2, 3, 64, 64)
    logits = model(x)
    assert logits.shape == (2, NUM_CLASSES, 64, 64)
    assert torch.isfinite(logits).all()
    logits.square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads)
    assert sum(g.abs().sum().item() for g in grads) > 0

    model.eval()
    with torch.no_grad():
        proba = model.predict_proba(x[:1])
        labels = model.predict(x[:1])
    assert proba.shape == (1, NUM_CLASSES, 64, 64)
    assert torch.allclose(proba.sum(1), torch.ones(1, 64, 64), atol=1e-5)
    assert labels.shape == (1, 64, 64) and labels.dtype == torch.int64
    assert torch.equal(labels, proba.argmax(1))

    # save/load round trip through a file into a freshly built model
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    fresh = build_model(name, num_classes=NUM_CLASSES).eval()
    fresh.load_state_dict(torch.load(path, weights_only=True))
    with torch.no_grad():
        assert torch.allclose(fresh(x[:1]), model(x[:1]), atol=1e-5)


@pytest.mark.parametrize("name", RUN_ON_CPU)
def test_channels_last_computes_the_same(name: str) -> None:
    # train.channels_last (on CPU too, since it runs the convolutions through oneDNN): the
    # memory format must change the speed only, not the outputs or the gradients
    # eval(): BatchNorm statistics frozen and dropout off, so the two steps are comparable;
    # gradients flow all the same
    torch.manual_seed(0)
    model = build_model(name, num_classes=NUM_CLASSES).eval()
    torch.manual_seed(0)
    twin = build_model(name, num_classes=NUM_CLASSES).eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 48, 64)
    out = model(x)
    out_cl = twin(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(out_cl, out, atol=1e-5, rtol=1e-4)
    out.square().mean().backward()
    out_cl.square().mean().backward()
    for (key, p), p_cl in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p_cl.grad, p.grad, atol=1e-5, rtol=1e-3, msg=key)


@pytest.mark.parametrize("size", [(33, 47), (97, 131)])
@pytest.mark.parametrize("name", ["dualseg_mobilenet_v2", "deeplabv3_mobilenet_v2"])
def test_odd_input_sizes(name: str, size: tuple[int, int], models: dict) -> None:
    model = models[name].eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, *size)).shape == (1, NUM_CLASSES, *size)


def test_checkpoint_kwargs_round_trip_through_json() -> None:
    kwargs = {
        "num_classes": 4,
        "output_stride": 16,
        "aspp_rates": (2, 3),
        "renet_layers": 1,
        "renet_hidden": 16,
        "coord_channels": False,
    }
    stored = json.loads(json.dumps(kwargs))  # what a checkpoint keeps: tuples become lists
    assert stored["aspp_rates"] == [2, 3]
    a = build_model("dualseg_resnet18", **kwargs)
    b = build_model("dualseg_resnet18", **stored)
    assert b.rgb.aspp.rates == (2, 3)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    assert all(sa[k].shape == sb[k].shape for k in sa)
    b.load_state_dict(sa)


def test_unknown_name_and_foreign_options_are_rejected() -> None:
    with pytest.raises(ConfigError, match="dualseg_resnet101"):
        build_model("dualseg_vgg", num_classes=2)
    with pytest.raises(ConfigError, match="renet_layers"):
        build_model("deeplabv3_mobilenet_v2", num_classes=2, renet_layers=1)
    with pytest.raises(ConfigError, match="deeplab_rates"):
        build_model("dualseg_mobilenet_v2", num_classes=2, deeplab_rates=(6, 12, 18))
    with pytest.raises(ConfigError, match="in_channels"):
        build_model("dualseg_mobilenet_v2", num_classes=2, in_channels=4)
    with pytest.raises(ConfigError, match="output_stride"):
        build_model("dualseg_mobilenet_v2", num_classes=2, output_stride=4)
    # options left at their defaults are fine for every model (engine configs pass them all)
    build_model("deeplabv3_mobilenet_v2", num_classes=2, renet_layers=2, gray_branch=True)


def test_backbone_of_names_the_weights_to_resolve() -> None:
    assert backbone_of("dualseg_resnet101") == "resnet101"
    assert backbone_of("deeplabv3_mobilenet_v2") == "mobilenet_v2"
    assert backbone_of("dualseg_timm") == "efficientnet_lite0"
    with pytest.raises(ConfigError):
        backbone_of("unet")


@pytest.mark.parametrize("name", RUN_ON_CPU)
def test_predict_runs_in_eval_mode_whatever_the_mode(name: str, models: dict) -> None:
    """predict / predict_proba answer one image the same alone or in a batch, leave the
    BatchNorm statistics alone, and hand the model back in the mode it was in (train-mode
    BatchNorm would mix the batch into each answer; DeepLabV3's pooling cannot run on one)."""
    model = models[name].train()
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    x = torch.randn(2, 3, 48, 64)
    alone, batch = model.predict(x[:1]), model.predict(x)
    assert torch.equal(alone[0], batch[0])
    torch.testing.assert_close(model.predict_proba(x[:1])[0], model.predict_proba(x)[0])
    assert model.training
    assert all(torch.equal(model.state_dict()[k], v) for k, v in stats.items())
    model.eval()
    model.predict(x[:1])
    assert not model.training


@pytest.mark.parametrize("name", RUN_ON_CPU)
def test_forward_refuses_what_it_cannot_read(name: str, models: dict) -> None:
    """One message that says the fix, not a convolution's shape error deep inside."""
    model = models[name].eval()
    x = torch.randn(1, 3, 32, 32)
    cases = [
        (TypeError, "normalized float pixels", (x * 255).to(torch.uint8)),  # raw pixels
        (ValueError, "built for 3-channel input, got 4", torch.randn(1, 4, 32, 32)),
        (ValueError, "built for 3-channel input, got 1", torch.randn(1, 1, 32, 32)),
        (TypeError, r"\[B, 3, H, W\].*shape \(3, 32, 32\)", x[0]),
        (TypeError, "got ndarray", x.numpy()),
        (ValueError, "empty image batch", torch.randn(1, 3, 0, 32)),
        (TypeError, "torch.float64 differs from the weights' torch.float32", x.double()),
    ]
    with torch.no_grad():
        for error, message, bad in cases:
            with pytest.raises(error, match=message):
                model(bad)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts: not refused
            assert model(x.bfloat16()).shape == (1, NUM_CLASSES, 32, 32)


def test_deeplab_training_on_one_image_says_why() -> None:
    model = build_model("deeplabv3_mobilenet_v2", num_classes=NUM_CLASSES).train()
    with pytest.raises(ValueError, match="2 or more images per batch"):
        model(torch.randn(1, 3, 32, 32))
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, NUM_CLASSES, 32, 32)
    # frozen BatchNorm in a model in train mode (fine-tuning; the speed benchmark's training
    # step at batch 1): nothing trains on one value per channel, so it runs
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eval()
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, NUM_CLASSES, 32, 32)


def test_a_model_for_other_input_channels_is_refused_where_rgb_is_fed(tmp_path: Path) -> None:
    from dualseg.data import DatasetMeta
    from dualseg.engine.predict import Segmenter
    from dualseg.export.export import export_model

    model = build_model("deeplabv3_mobilenet_v2", num_classes=2, in_channels=1).eval()
    assert model(torch.randn(1, 1, 32, 32)).shape == (1, 2, 32, 32)  # its own input works
    meta = DatasetMeta(name="x", class_names=("a", "b"), palette=((0, 0, 0), (255, 255, 255)))
    with pytest.raises(ConfigError, match="built for 1-channel input"):
        Segmenter(model, meta)
    with pytest.raises(ConfigError, match="built for 1-channel input"):
        export_model(model, tmp_path / "m.onnx", class_names=["a", "b"])
    assert not (tmp_path / "m.onnx").exists()


def test_class_labels_are_argmax_to_the_tie_and_nan() -> None:
    """Every base prediction reads class_labels (max's index, several times faster than argmax
    on the CPU): it must be argmax exactly, first class on ties, NaN as a maximum."""
    from dualseg.models.base import class_labels

    torch.manual_seed(0)
    scores = torch.randint(0, 3, (2, 5, 24, 30)).float()  # ties everywhere
    scores[0, 3, 2, 4] = scores[1, 1, 0, 0] = scores[1, 4, 0, 0] = float("nan")
    scores[0, :, 5, 5] = float("-inf")
    for s in (scores, scores[:, :, 2:], scores.contiguous(memory_format=torch.channels_last)):
        assert torch.equal(class_labels(s), s.argmax(1))
