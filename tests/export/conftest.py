"""Shared exports for the export tests: one small checkpoint, exported once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from export_case import ARCH, CLASS_NAMES, MODEL_KWARGS, PALETTE

from checkpoint_helpers import contract
from dualseg.engine.checkpoint import save_checkpoint
from dualseg.models import build_model


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """A dualseg checkpoint of a tiny random-weight method-A network (BN stats perturbed so
    that eval-mode batch norm is not the identity)."""
    torch.manual_seed(0)
    model = build_model(ARCH, weights=None, **MODEL_KWARGS)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pt"
    save_checkpoint(
        path,
        {
            "arch": ARCH,
            "model_kwargs": MODEL_KWARGS,
            "model": model.state_dict(),
            "class_names": CLASS_NAMES,
            "palette": PALETTE,
            "label_contract": contract(CLASS_NAMES, PALETTE),
        },
    )
    return path


@pytest.fixture(scope="session")
def onnx_dynamic(checkpoint, tmp_path_factory) -> Path:
    """The checkpoint exported through the CLI: ONNX, logits, dynamic batch/height/width."""
    from dualseg.cli import main

    out = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    args = ["export", "--checkpoint", str(checkpoint), "--format", "onnx", "--out", str(out)]
    assert main([*args, "--dynamic", "--no-verify"]) == 0
    return out


@pytest.fixture(scope="session")
def torch_model(checkpoint):
    from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint

    model, meta = build_model_from_checkpoint(load_checkpoint(checkpoint))
    return model.eval(), meta


@pytest.fixture(scope="session")
def onnx_static(torch_model, tmp_path_factory) -> Path:
    """A static export (batch 1, 48x80) returning probabilities."""
    from dualseg.export.export import export_model

    model, meta = torch_model
    return export_model(
        model,
        tmp_path_factory.mktemp("onnx_static") / "static.onnx",
        class_names=meta.class_names,
        palette=meta.palette,
        output="probs",
        dynamic=False,
        example_size=(48, 80),
    )
