"""One default per model option: written in build_model's signature, nowhere on the way."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from dualseg.engine.config import ModelConfig, model_kwargs
from dualseg.errors import ConfigError
from dualseg.models import build_model
from dualseg.models.factory import build_deeplabv3, build_dualseg

PLUMBING = {"arch", "weights", "allow_download"}


def test_the_config_checks_know_every_model_name() -> None:
    from dualseg.engine.config import ARCH_NAMES, Config, ModelConfig, validate
    from dualseg.models import MODELS

    assert tuple(MODELS) == ARCH_NAMES  # config.py cannot import the (torch) models package
    with pytest.raises(ConfigError, match=r"model\.arch.*'foo'.*dualseg_resnet18"):
        validate(Config(model=ModelConfig(arch="foo")))


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


def test_an_option_another_option_switches_off_is_said() -> None:
    with pytest.warns(UserWarning, match=r"renet_hidden=4 \(with renet_layers=0\) has no effect"):
        build_model("dualseg_mobilenet_v2", num_classes=3, renet_layers=0, renet_hidden=4)
    with pytest.warns(UserWarning, match=r"aspp_init_std=1\.0 \(with aspp_style='v3'\)"):
        build_model("dualseg_mobilenet_v2", num_classes=3, aspp_style="v3", aspp_init_std=1.0)
