"""Helpers that write tiny checkpoints into a test's tmp_path, and a tiny refiner (seeded: the
same model each call)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dualseg.data import DatasetMeta, get_preset, with_label_mapping
from dualseg.data.contract import LabelContract
from dualseg.engine.checkpoint import save_checkpoint
from dualseg.models import build_model
from dualseg.refine import BoundaryRefiner, RefinerConfig, build_embedding_net
from dualseg.viz import default_palette

SYNTHETIC = get_preset("synthetic")
SYNTHETIC_KWARGS = {"num_classes": SYNTHETIC.num_classes, "output_stride": 16, "renet_hidden": 8}


def contract(class_names: Sequence[str], palette: Sequence[Sequence[int]] | None = None) -> dict:
    """The label contract dualseg stores with a model of ``class_names`` read as indices."""
    colours = palette or default_palette(len(class_names))
    meta = DatasetMeta("test", tuple(class_names), tuple(tuple(c) for c in colours))
    return LabelContract(meta).to_dict()


def synthetic_contract(label_map: dict[int, int], ignore_value: int | str = "auto") -> dict:
    """The synthetic preset's contract of a model trained with ``--data.label_map`` (and
    ``--data.ignore_index``)."""
    mapped = with_label_mapping(SYNTHETIC, label_map=label_map, ignore_value=ignore_value)
    return LabelContract(mapped).to_dict()


def write_synthetic_checkpoint(path: Path, **overrides: Any) -> Path:
    """A random ``dualseg_mobilenet_v2`` for the synthetic preset, its weights jittered so that
    it predicts several classes, not one; ``overrides`` replace entries of the state."""
    torch.manual_seed(0)
    model = build_model("dualseg_mobilenet_v2", **SYNTHETIC_KWARGS)
    with torch.no_grad():  # make the random model predict several classes, not one
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    state = {
        "arch": "dualseg_mobilenet_v2",
        "model_kwargs": dict(SYNTHETIC_KWARGS),
        "model": model.state_dict(),
        "class_names": list(SYNTHETIC.class_names),
        "palette": [list(c) for c in SYNTHETIC.palette],
        "ignore_index": 255,
        "config": {"data": {"preset": "synthetic"}},
        "label_contract": LabelContract(SYNTHETIC).to_dict(),
    }
    state.update(overrides)
    return save_checkpoint(path, state)


def write_peer_checkpoint(path: Path, class_names: Sequence[str]) -> Path:
    """A random DeepLabV3-MobileNetV2 (the peer) predicting ``class_names``: a base model."""
    torch.manual_seed(0)
    model = build_model("deeplabv3_mobilenet_v2", num_classes=len(class_names))
    return save_checkpoint(
        path,
        {
            "arch": "deeplabv3_mobilenet_v2",
            "model_kwargs": {"num_classes": len(class_names)},
            "model": model.state_dict(),
            "class_names": list(class_names),
            "label_contract": contract(class_names),
        },
    )


def small_refiner(names: Sequence[str] = "abc") -> BoundaryRefiner:
    """A small refiner with the embedding net its config describes (random weights)."""
    torch.manual_seed(0)
    cfg = RefinerConfig(embed_dim=4, output_stride=16, top_n=2, radius=2)
    net = build_embedding_net(
        cfg.backbone, embed_dim=4, output_stride=16, aspp_rates=cfg.aspp_rates
    )
    present = torch.arange(len(names)) != 1
    return BoundaryRefiner(net, torch.randn(len(names), 4), present, class_names=names, config=cfg)
