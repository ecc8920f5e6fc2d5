"""benchmarks/model_speed.py --parts: the parts it times must be the model's whole pipeline, each
fed what it gets in the model, else the breakdown (and the bounds drawn from it) would miss work."""

from __future__ import annotations

import pytest
import torch

from benchmark_helpers import load_benchmark
from dualseg.models import build_model


@pytest.fixture(scope="module")
def speed():
    return load_benchmark("model_speed")


@pytest.mark.parametrize(
    ("name", "kind"), [("dualseg_mobilenet_v2", "dualseg"), ("deeplabv3_mobilenet_v2", "deeplabv3")]
)
def test_the_timed_parts_chain_into_the_models_scores(speed, name: str, kind: str) -> None:
    torch.manual_seed(0)
    model = build_model(name, num_classes=3, output_stride=16).eval()
    x = torch.randn(1, 3, 64, 96)
    parts = speed.PARTS[kind]
    inputs = speed.part_inputs(model, x, parts)
    assert set(inputs) == set(parts)
    with torch.no_grad():
        for branch in ("rgb.", "gray.") if kind == "dualseg" else ("",):
            # each part's recorded input is the previous part's output
            feats = model.get_submodule(branch + "backbone")(inputs[branch + "backbone"])
            nxt = ("context", "aspp") if kind == "dualseg" else ("head",)
            torch.testing.assert_close(inputs[branch + nxt[0]], feats)
            if kind == "dualseg":
                ctx = model.get_submodule(branch + "context")(feats)
                torch.testing.assert_close(inputs[branch + "aspp"], ctx)
