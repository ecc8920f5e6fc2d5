"""BoundaryRefiner's Python API refuses what would give a wrong refiner: no steps, labels that
are no class of its names, a device that is none; each is one error naming the fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dualseg.errors import ConfigError, DataError
from dualseg.refine import BoundaryRefiner, RefinerConfig


class Stripes(torch.utils.data.Dataset):
    """Normalized images with vertical stripes of labels 0..classes-1 (no ``meta``)."""

    def __init__(self, classes: int, n: int = 2, size: int = 32) -> None:
        self.n = n
        self.label = (torch.arange(size) * classes // size).expand(size, size).long()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.label.float().expand(3, -1, -1) / 4 - 0.5
        return image.contiguous(), self.label.clone()


def fit(dataset, names, **changes) -> BoundaryRefiner:
    cfg = RefinerConfig(embed_dim=4, steps=1, batch_size=2, num_triplets=16, radius=2)
    cfg = RefinerConfig(**{**cfg.to_dict(), **changes})
    return BoundaryRefiner.fit(dataset, class_names=names, config=cfg, progress=False)


def test_no_steps_is_refused_where_it_returned_an_untrained_refiner() -> None:
    with pytest.raises(ConfigError, match=r"steps must be >= 1, got 0"):
        fit(Stripes(3), ["a", "b", "c"], steps=0)


def test_labels_outside_the_class_names_are_refused_before_training() -> None:
    # labels 0..7 fitted for three names: triplets drew 3..7 as classes, prototypes dropped them
    with pytest.raises(DataError, match=r"label values \[3, 4, 5, 6, 7\].*3 class names"):
        fit(Stripes(8), ["a", "b", "c"])
    assert fit(Stripes(3), ["a", "b", "c"]).num_classes == 3
    # a dataset that names its classes: compared before any step (it failed after the fit,
    # blaming the palette)
    described = Stripes(3)
    described.meta = SimpleNamespace(class_names=tuple("abcdefgh"), palette=None)
    with pytest.raises(ConfigError, match="dataset has 8 classes and the refiner 3 class names"):
        fit(described, ["a", "b", "c"])


def test_a_device_that_is_none_is_one_config_error() -> None:
    with pytest.raises(ConfigError, match="device 'gpu' is not a device"):
        fit(Stripes(3), ["a", "b", "c"], steps=1).to("gpu")


def test_a_module_base_runs_in_eval_mode_and_gives_the_model_back_as_it_came() -> None:
    """ModuleBase set a model in train mode to eval for good, and a later .train() made its
    scores depend on the batch (BatchNorm of the batch) and move the running statistics."""
    from dualseg.refine.base import ModuleBase

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))
    model.train()
    base = ModuleBase(model, class_names=list("abcd"))
    assert model.training
    stats = model[1].running_mean.clone()
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(base.scores(x)[:1], base.scores(x[:1]))
    assert model.training and torch.equal(model[1].running_mean, stats)
    # torchvision's {"out": logits}: read; anything else: one line naming what it takes
    wrapped = ModuleBase(torch.nn.ModuleDict({"m": model}), class_names=list("abcd"))
    wrapped.module.forward = lambda x: {"out": model(x), "aux": None}
    torch.testing.assert_close(wrapped.scores(x), base.scores(x))
    wrapped.module.forward = lambda x: {"logits": model(x)}
    with pytest.raises(ConfigError, match=r"returned a dict with keys \['logits'\].*'out'"):
        wrapped.scores(x)


def test_a_batch_of_one_crop_is_refused_by_the_config() -> None:
    """Why the rule: one small crop (32 px at input scale 0.5) is a 1x1 map at output stride
    16, and training BatchNorm then sees one value per channel: a traceback at step 1."""
    import torch

    from dualseg.refine.fit import embedding_net

    net = embedding_net(RefinerConfig(embed_dim=8), weights=None).train()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        net(torch.randn(1, 3, 16, 16))
    net(torch.randn(2, 3, 16, 16))
    with pytest.raises(ConfigError, match=r"batch_size must be >= 2"):
        RefinerConfig(batch_size=1)


def test_channels_last_probabilities_are_named_as_such_not_resized() -> None:
    """H×W×C probabilities were answered with "resize ... (bilinear)", a fix that cannot help."""
    import numpy as np

    refiner = fit(Stripes(3), ["a", "b", "c"])
    image = np.zeros((32, 32, 3), np.uint8)
    probs = np.full((32, 32, 3), 1 / 3, np.float32)  # [H, W, C]
    with pytest.raises(DataError, match=r"channels-last \[H,W,C\].*\[C,H,W\]"):
        refiner.refine(image, probs)
    assert refiner.refine(image, probs.transpose(2, 0, 1)).shape == (32, 32)


def test_a_switch_cost_is_refused_below_zero_and_reaches_the_decision(monkeypatch) -> None:
    with pytest.raises(ConfigError, match=r"switch_cost must be >= 0 and finite, got -0.1"):
        RefinerConfig(switch_cost=-0.1)
    dataset = Stripes(3)
    refiner = fit(dataset, ["a", "b", "c"], switch_cost=0.3, min_prob=0.05)
    seen = {}

    def decide(c, **options):
        seen.update(options)
        return c.pred, c.pred != c.pred

    monkeypatch.setattr("dualseg.refine.refiner.decide", decide)
    refiner.refine(dataset[0][0][None], torch.full((1, 3, 32, 32), 1 / 3))
    assert seen == {"gate_margin": None, "prior_weight": 0.0, "min_prob": 0.05, "switch_cost": 0.3,
                    "blocked_switches": ()}  # fmt: skip
