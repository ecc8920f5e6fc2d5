"""One default per model option: written in build_model's signature, nowhere on the way."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from dualseg.engine.options import ModelConfig, model_kwargs
from dualseg.errors import ConfigError
from dualseg.models import build_model
from dualseg.models.factory import build_deeplabv3, build_dualseg

PLUMBING = {"arch", "weights", "allow_download"}


def test_an_unknown_model_name_is_one_config_error_listing_every_name() -> None:
    from dualseg.models import MODELS

    with pytest.raises(ConfigError, match=r"unknown model 'foo'; choose one of: ") as err:
        build_model("foo", num_classes=3)
    assert all(name in str(err.value) for name in MODELS)


def test_the_config_knows_every_model_name() -> None:
    from dualseg.engine.options import ARCH_NAMES
    from dualseg.models import MODELS

    assert tuple(MODELS) == ARCH_NAMES


def test_builders_take_every_value_from_build_model() -> None:
    for builder in (build_dualseg, build_deeplabv3):
        params = list(inspect.signature(builder).parameters.values())[1:]  # after the backbone
        assert all(p.default is inspect.Parameter.empty for p in params), builder.__name__
        assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params)
        accepted = set(inspect.signature(build_model).parameters)
        assert {p.name for p in params} <= accepted


def test_model_config_none_means_build_model_default() -> None:
    names = set(inspect.signature(build_model).parameters)
    for f in dataclasses.fields(ModelConfig):
        if f.name not in PLUMBING:
            assert f.name in names and f.default is None, f.name
    assert model_kwargs(ModelConfig(), 5) == {"num_classes": 5}


def test_model_kwargs_keep_tuples_and_rebuild_the_same_network() -> None:
    cfg = ModelConfig(arch="dualseg_mobilenet_v2", aspp_rates=(2, 3), renet_hidden=8)
    kwargs = model_kwargs(cfg, 3)
    assert kwargs["aspp_rates"] == (2, 3) and isinstance(kwargs["aspp_rates"], tuple)
    net = build_model(cfg.arch, **kwargs)
    assert net.rgb.aspp.rates == (2, 3) and net.rgb.context.renet1.hidden == 8


def test_claim_readings_reach_the_modules_by_name() -> None:
    from dualseg.models import build_model

    net = build_model(
        "dualseg_mobilenet_v2",
        num_classes=3,
        renet_hidden=4,
        renet_init="standard",
        upsample_order="logits_first",
    )
    assert net.upsample_order == "logits_first"
    renet = net.rgb.context.renet1
    assert renet.init == "standard" and min(p.min().item() for p in renet.parameters()) >= 0
    assert build_model("dualseg_mobilenet_v2", num_classes=3).upsample_order == "softmax_first"
    bounded = build_model("dualseg_mobilenet_v2", num_classes=3, renet_init_bound=0.01)
    assert max(p.abs().max().item() for p in bounded.gray.context.renet2.parameters()) <= 0.01
    with pytest.raises(ConfigError, match="upsample_order"):  # the peer keeps its own order
        build_model("deeplabv3_mobilenet_v2", num_classes=3, upsample_order="logits_first")


@pytest.mark.parametrize(
    ("option", "value", "kind"),
    [
        ("coord_channels", "no", "true or false"),  # a non-empty string would be true
        ("gray_branch", "false", "true or false"),
        ("renet_layers", True, "an int"),
        ("renet_hidden", 1.5, "an int"),
        ("output_stride", "8", "an int"),
        ("aspp_rates", 4, "a list of ints"),
        ("aspp_rates", "4,6", "a list of ints"),
        ("aspp_init_std", "0.01", "a number"),
        ("fusion", 1, "a string"),
    ],
)
def test_an_option_of_another_type_is_one_config_error(option, value, kind) -> None:
    with pytest.raises(ConfigError, match=f"model option {option} must be {kind}, got"):
        build_model("dualseg_mobilenet_v2", num_classes=3, **{option: value})


def test_negative_std_and_zero_input_channels_are_refused() -> None:
    for bad in ({"aspp_init_std": -1.0}, {"in_channels": 0}):
        with pytest.raises(ConfigError, match="in_channels must be >= 1 and aspp_init_std >= 0"):
            build_model("dualseg_mobilenet_v2", num_classes=3, **bad)


def test_a_timm_model_timm_cannot_build_is_one_config_error() -> None:
    pytest.importorskip("timm")
    with pytest.raises(ConfigError, match="timm cannot build it as a dilated feature extractor"):
        build_model("dualseg_timm", num_classes=3, timm_model="no_such_timm_model")


def test_renet_norm_puts_a_batchnorm_before_each_renet_layer_and_keeps_the_coordinates() -> None:
    import torch
    from torch import nn

    plain = build_model("dualseg_mobilenet_v2", num_classes=3, renet_hidden=4)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in plain.rgb.context.modules())
    net = build_model("dualseg_mobilenet_v2", num_classes=3, renet_hidden=4, renet_norm="batch")
    context = net.gray.context
    assert list(dict(context.named_children())) == [
        "norm1", "coord1", "renet1", "norm2", "coord2", "renet2"
    ]  # fmt: skip
    assert context.norm1.num_features == 320 and context.norm2.num_features == 8
    # the norm sees the features only: a faint input leaves it at unit scale, the three
    # coordinate channels (claim 4) come after it unchanged
    torch.manual_seed(0)
    x = 0.01 * torch.randn(2, 320, 5, 7)
    head = nn.Sequential(context.norm1, context.coord1).train()
    out = head(x)
    assert out.shape == (2, 323, 5, 7)
    assert abs(out[:, :320].std().item() - 1.0) < 0.05
    torch.testing.assert_close(out[:, 320:], context.coord1(x)[:, 320:])
    assert net(torch.randn(1, 3, 32, 48)).shape == (1, 3, 32, 48)
    with pytest.raises(ConfigError, match="renet_norm must be one of"):
        build_model("dualseg_mobilenet_v2", num_classes=3, renet_norm="layer")
    with pytest.raises(ConfigError, match="renet_norm"):  # the peer has no ReNet
        build_model("deeplabv3_mobilenet_v2", num_classes=3, renet_norm="batch")


def test_renet_skip_hands_the_aspp_the_backbone_features_beside_the_renet_output() -> None:
    import torch

    torch.manual_seed(0)
    plain = build_model("dualseg_mobilenet_v2", num_classes=3, renet_hidden=4, aspp_style="v3")
    skip = build_model(
        "dualseg_mobilenet_v2", num_classes=3, renet_hidden=4, aspp_style="v3", renet_skip=True
    )
    assert plain.rgb.aspp[0].convs[0][0].in_channels == 8
    assert skip.rgb.aspp[0].convs[0][0].in_channels == 320 + 8  # [backbone, ReNet] channels
    # the claim's network inside: the same weights, the backbone's slice of every widened
    # ASPP input weight zeroed, gives the same output as the network without the skip
    state = {}
    for key, value in plain.state_dict().items():
        wide = skip.state_dict()[key]
        if wide.shape != value.shape:
            value = torch.cat([torch.zeros_like(wide[:, :320]), value], dim=1)
        state[key] = value
    skip.load_state_dict(state)
    x = torch.randn(1, 3, 32, 48)
    torch.testing.assert_close(skip.eval()(x), plain.eval()(x))
    with pytest.warns(UserWarning, match=r"renet_skip=True \(with renet_layers=0\)"):
        build_model("dualseg_mobilenet_v2", num_classes=3, renet_layers=0, renet_skip=True)


def test_an_option_another_option_switches_off_is_said() -> None:
    with pytest.warns(UserWarning, match=r"renet_hidden=4 \(with renet_layers=0\) has no effect"):
        build_model("dualseg_mobilenet_v2", num_classes=3, renet_layers=0, renet_hidden=4)
    with pytest.warns(UserWarning, match=r"aspp_init_std=1\.0 \(with aspp_style='v3'\)"):
        build_model("dualseg_mobilenet_v2", num_classes=3, aspp_style="v3", aspp_init_std=1.0)
