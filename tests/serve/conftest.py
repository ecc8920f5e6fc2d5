"""Fixtures of the serve tests: fake segmenter and refiner (see serve_fakes.py), and a tiny
real checkpoint + refiner pair for the command-line tests."""

from __future__ import annotations

import pytest
import torch
from serve_fakes import NAMES, BrightnessSegmenter, TopRowRefiner

from checkpoint_helpers import contract
from dualseg.engine.checkpoint import save_checkpoint
from dualseg.models import build_model
from dualseg.refine import BoundaryRefiner, RefinerConfig, build_embedding_net


@pytest.fixture
def segmenter() -> BrightnessSegmenter:
    return BrightnessSegmenter()


@pytest.fixture
def refiner() -> TopRowRefiner:
    return TopRowRefiner()


@pytest.fixture
def files(tmp_path):
    """``(checkpoint, refiner)`` files: a tiny 3-class network and its method-B refiner."""
    torch.manual_seed(0)
    kwargs = {"num_classes": 3, "renet_hidden": 8}
    model = build_model("dualseg_mobilenet_v2", weights=None, **kwargs)
    ckpt = tmp_path / "tiny.pt"
    save_checkpoint(
        ckpt,
        {
            "arch": "dualseg_mobilenet_v2",
            "model_kwargs": kwargs,
            "model": model.state_dict(),
            "class_names": NAMES,
            "palette": [[128, 64, 128], [0, 0, 142], [70, 130, 180]],
            "label_contract": contract(NAMES, [[128, 64, 128], [0, 0, 142], [70, 130, 180]]),
        },
    )
    cfg = RefinerConfig(embed_dim=8, radius=2)
    net = build_embedding_net(
        cfg.backbone,
        embed_dim=cfg.embed_dim,
        output_stride=cfg.output_stride,
        aspp_rates=cfg.aspp_rates,
    )
    refiner = BoundaryRefiner(
        net, torch.randn(3, 8), torch.ones(3, dtype=torch.bool), class_names=NAMES, config=cfg
    )
    return ckpt, refiner.save(tmp_path / "refiner.pt")
