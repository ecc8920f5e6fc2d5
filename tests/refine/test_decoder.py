"""Method B's embedding with a DeepLabV3+ decoder (dualseg.refine.decoder, beyond the claim)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dualseg.cli import main
from dualseg.errors import ConfigError
from dualseg.export.runtime import load_exported_refiner
from dualseg.models import build_model
from dualseg.refine import BoundaryRefiner, RefinerConfig, build_embedding_net
from dualseg.refine.embedding import init_backbone_from
from dualseg.refine.fit import embedding_net

RATES = (4, 6, 8, 12)  # the spec's ASPP rates


def test_the_embedding_is_at_stride_4_and_reads_the_stride_4_features() -> None:
    torch.manual_seed(0)
    net = build_embedding_net(
        "mobilenet_v2", embed_dim=8, output_stride=16, aspp_rates=RATES, decoder_channels=6
    )
    net.eval()
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        f = net.features(x)
    assert f.shape == (2, 8, 16, 24)  # H/4 x W/4, not H/16 x W/16
    tap = net.backbone.get_submodule(net.low_level)
    assert not tap._forward_hooks  # the hook lives for one forward only
    # the decoder's input really is the stride-4 tap: replace that block's output, see it move
    handle = tap.register_forward_hook(lambda _m, _a, out: torch.zeros_like(out))
    with torch.no_grad():
        zeroed = net.features(x)
    handle.remove()
    assert not torch.allclose(zeroed, f)


def test_no_decoder_is_the_claims_embedding_at_the_output_stride() -> None:
    net = build_embedding_net("mobilenet_v2", embed_dim=8, output_stride=16, aspp_rates=RATES)
    assert net.decoder is None and net.low_level is None
    assert net.features(torch.randn(1, 3, 64, 96)).shape == (1, 8, 4, 6)


def test_on_a_frozen_backbone_only_the_aspp_and_the_decoder_learn() -> None:
    torch.manual_seed(0)
    net = build_embedding_net(
        "resnet18",
        embed_dim=8,
        output_stride=8,
        aspp_rates=RATES,
        decoder_channels=4,
        freeze_backbone=True,
    )
    before = {k: v.clone() for k, v in net.backbone.state_dict().items()}
    net.train()
    net(torch.randn(2, 3, 64, 64)).square().mean().backward()
    assert all(p.grad is None for p in net.backbone.parameters())
    assert all(p.grad is not None for p in [*net.fuse.parameters(), *net.decoder.parameters()])
    for k, v in net.backbone.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_wrong_decoder_options_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="stride-4 tap"):
        build_embedding_net(
            "timm:efficientnet_lite0",
            embed_dim=8,
            output_stride=8,
            aspp_rates=RATES,
            decoder_channels=48,
        )
    for wrong in (-1, 4097):  # 100000 would run out of memory building the decoder
        with pytest.raises(ConfigError, match=rf"decoder_channels must be in 0\.\.4096 .*{wrong}"):
            RefinerConfig(decoder_channels=wrong)


def _case(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """An image and base probabilities with three vertical stripes (boundaries)."""
    rng = np.random.default_rng(seed)
    label = np.zeros((40, 56), np.int64)
    label[:, 20:], label[:, 38:] = 1, 2
    logits = rng.normal(0, 1.0, (3, 40, 56)).astype(np.float32)
    np.put_along_axis(logits, label[None], 3.0, axis=0)
    probs = np.exp(logits) / np.exp(logits).sum(0, keepdims=True)
    return rng.integers(0, 256, (40, 56, 3), dtype=np.uint8), probs


def test_a_refiner_with_a_decoder_saves_loads_and_exports(tmp_path) -> None:
    torch.manual_seed(0)
    cfg = RefinerConfig(embed_dim=8, input_scale=1.0, radius=3, top_n=3, decoder_channels=4)
    net = embedding_net(cfg).eval()
    with torch.no_grad():  # non-trivial decoder statistics, so the export sees them
        for m in net.decoder.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    protos = torch.randn(3, 8)
    refiner = BoundaryRefiner(
        net, protos, torch.ones(3, dtype=torch.bool), class_names=list("abc"), config=cfg
    )
    path = tmp_path / "refiner.pt"
    refiner.save(path)
    loaded = BoundaryRefiner.load(path)
    assert loaded.config.decoder_channels == 4 and loaded.net.decoder is not None
    image, probs = _case()
    want, changed = refiner.refine(image, probs, return_changed=True)
    assert changed.sum() > 0
    np.testing.assert_array_equal(loaded.refine(image, probs), want)
    refiner.save_pretrained(tmp_path / "shared")  # refiner.json + refiner.safetensors
    np.testing.assert_array_equal(
        BoundaryRefiner.load(tmp_path / "shared").refine(image, probs), want
    )
    out = tmp_path / "emb.onnx"
    assert main(["export", "--refiner", str(path), "--format", "onnx", "--out", str(out)]) == 0
    assert json.loads((tmp_path / "emb.json").read_text())["config"]["decoder_channels"] == 4
    np.testing.assert_array_equal(load_exported_refiner(out).refine(image, probs), want)


@torch.no_grad()
def test_a_refiner_with_a_decoder_reads_the_bases_features_with_the_same_labels() -> None:
    torch.manual_seed(0)
    base = build_model("deeplabv3_mobilenet_v2", num_classes=3, output_stride=16)
    for m in base.modules():  # BatchNorm statistics of random images (untrained: they vanish)
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = None
    base.train()(torch.randn(4, 3, 64, 96))
    base.eval()
    cfg = RefinerConfig(
        embed_dim=8, input_scale=1.0, radius=2, backbone_source="base-frozen", decoder_channels=4
    )
    net = embedding_net(cfg)
    init_backbone_from(net.backbone, base, strict=True)
    refiner = BoundaryRefiner(
        net, torch.randn(3, 8), torch.ones(3, dtype=torch.bool), class_names=list("abc"), config=cfg
    )
    x = torch.randn(2, 3, 64, 96)
    probs = torch.nn.functional.interpolate(
        torch.randn(2, 3, 4, 6) * 4, size=(64, 96), mode="bilinear", align_corners=False
    )
    own, own_changed = refiner.refine(x, probs, return_changed=True)
    with refiner.shared_features(base) as shared:
        base(x)
        kept = shared.take(x)
    assert kept is not None and kept.low is not None and kept.low.shape[-2:] == (16, 24)
    got, changed = refiner.refine(x, probs, return_changed=True, features=kept)
    assert own_changed.any()
    torch.testing.assert_close(got, own)
    torch.testing.assert_close(changed, own_changed)
    # without the stride-4 features (a caller's plain pair) it runs its own backbone: same labels
    torch.testing.assert_close(refiner.refine(x, probs, features=kept[:2]), own)


@pytest.mark.parametrize(
    ("size", "cells", "covered"),
    [
        ((40, 56), (10, 14), None),  # stride 4, unpadded
        ((37, 53), (10, 14), (40.0, 56.0)),  # padded to a multiple of the stride
        ((30, 45), (6, 9), (32.0, 48.0)),  # input scale 0.75: 5.33 px per cell
    ],
)
def test_sampled_cells_are_every_cell_the_bilinear_sample_reads(size, cells, covered) -> None:
    from dualseg.refine.embedding import EmbeddingNet

    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, *size, generator=g) < 0.01
    mask[1] = False
    mask[1, :, -1] = True  # the last column: the border clamp
    feats = torch.randn(2, 5, *cells, generator=g)
    at = EmbeddingNet.sampled_cells(mask, cells, covered)
    assert at.shape == (2, *cells) and 0 < int(at.sum()) < at.numel() / 2
    # a map that is right only at those cells (anything elsewhere) samples the same
    spoiled = feats.masked_fill(~at[:, None], 1e6)
    want = EmbeddingNet.sample(feats, mask, covered)
    torch.testing.assert_close(EmbeddingNet.sample(spoiled, mask, covered), want)


@torch.no_grad()
def test_the_decoder_at_a_few_cells_equals_the_whole_map_there() -> None:
    torch.manual_seed(0)
    net = build_embedding_net(
        "mobilenet_v2", embed_dim=8, output_stride=16, aspp_rates=RATES, decoder_channels=6
    )
    for m in net.modules():  # non-trivial statistics: the sparse path must use them alike
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    net.eval()
    local, low = net.backbone_features(torch.randn(2, 3, 64, 96))
    at = torch.rand(2, 16, 24) < 0.2
    at[0, 0, 0] = at[1, -1, -1] = True  # corners: the conv's zero padding
    rows = net.head_at(local, low, at)  # [M,C]
    dense = net.head(local, low)  # [B,C,16,24]
    assert rows.shape == (int(at.sum()), 8)
    torch.testing.assert_close(rows, dense.permute(0, 2, 3, 1)[at], atol=1e-5, rtol=1e-4)
    none = torch.zeros_like(at)  # no cell at all: no rows, no error
    assert net.head_at(local, low, none).shape == (0, 8)


@pytest.mark.parametrize(("size", "input_scale"), [((40, 56), 1.0), ((37, 53), 0.75)])
@torch.no_grad()
def test_a_refiner_with_a_decoder_gives_the_labels_of_the_whole_embedding_map(
    monkeypatch, size, input_scale
) -> None:
    from dualseg.refine.embedding import EmbeddingNet

    torch.manual_seed(0)
    cfg = RefinerConfig(embed_dim=8, input_scale=input_scale, radius=3, top_n=3, decoder_channels=4)
    refiner = BoundaryRefiner(
        embedding_net(cfg).eval(),
        torch.randn(3, 8),
        torch.ones(3, dtype=torch.bool),
        class_names=list("abc"),
        config=cfg,
    )
    h, w = size
    image, probs = _case(1)
    image, probs = image[:h, :w], np.ascontiguousarray(probs[:, :h, :w])
    # a batch of three: the second image has no boundary, so only the others are embedded
    x = torch.randn(3, 3, h, w)
    p = torch.from_numpy(np.stack([probs, np.full_like(probs, 1 / 3), probs[:, ::-1].copy()]))
    p[1, 0] += 0.1  # one class everywhere: no near-boundary pixel
    got, changed = refiner.refine(image, probs, return_changed=True)
    got_batch = refiner.refine(x, p)
    got_distance = refiner.candidates(x, p).distance  # what every decision reads
    assert changed.sum() > 0
    # the reference: every cell computed, by the whole-map head (no sampled cells, no forward_at)
    monkeypatch.setattr(
        EmbeddingNet,
        "sampled_cells",
        staticmethod(lambda m, size, covered=None: torch.ones(m.shape[0], *size, dtype=torch.bool)),
    )
    net = refiner.net
    monkeypatch.setattr(
        net, "head_at", lambda local, low, at: net.head(local, low).permute(0, 2, 3, 1)[at]
    )
    np.testing.assert_array_equal(got, refiner.refine(image, probs))
    torch.testing.assert_close(got_batch, refiner.refine(x, p))
    torch.testing.assert_close(got_distance, refiner.candidates(x, p).distance)


def test_candidates_called_outside_no_grad_keep_no_graph() -> None:
    torch.manual_seed(0)
    cfg = RefinerConfig(embed_dim=8, radius=3, top_n=3, decoder_channels=4)
    refiner = BoundaryRefiner(
        embedding_net(cfg).eval(), torch.randn(3, 8), torch.ones(3, dtype=torch.bool),
        class_names=list("abc"), config=cfg,
    )  # fmt: skip
    probs = (3 * torch.randn(1, 3, 40, 56)).softmax(1)
    got = refiner.candidates(torch.randn(1, 3, 40, 56), probs)
    assert got.distance.numel() > 0 and not got.distance.requires_grad
