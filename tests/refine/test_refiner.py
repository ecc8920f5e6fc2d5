"""BoundaryRefiner inference (method B P2-P5) on a constructed case."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dualseg.errors import CheckpointError, DataError
from dualseg.refine import BoundaryRefiner, EmbeddingNet, RefinerConfig, near_boundary_mask


class FixedFeatures(nn.Module):
    """A 'backbone' whose features are a given map at input size (ignores the image)."""

    def __init__(self, features: Tensor) -> None:
        super().__init__()
        self.register_buffer("map", features)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return self.map.expand(x.shape[0], -1, -1, -1)


def _case() -> tuple[BoundaryRefiner, Tensor, Tensor, Tensor]:
    """Left half class 0 (Top-2 {0, 2}), right half class 1 (Top-2 {1, 3}); prototype k =
    10·e_k; embeddings = own prototype except a few planted pixels. Returns the refiner, the
    probabilities, the embedding map and the expected changed mask."""
    h = w = 32
    order_left, order_right = torch.tensor([0.6, 0.0, 0.3, 0.1]), torch.tensor([0.0, 0.6, 0.1, 0.3])
    probs = torch.where(torch.arange(w) < 16, order_left[:, None], order_right[:, None])
    probs = probs[:, None, :].expand(4, h, w)[None].clone()  # [1,4,H,W]
    protos = 10 * torch.eye(4)
    emb = torch.where(torch.arange(w) < 16, protos[0][:, None], protos[1][:, None])
    emb = emb[:, None, :].expand(4, h, w).clone()  # [4,H,W]
    expected = torch.zeros(h, w, dtype=torch.bool)
    emb[:, 0:10, 14] = protos[2][:, None]  # in band, 2 in Top-2 -> becomes 2
    expected[0:10, 14] = True
    emb[:, 10:20, 14] = (protos[1] + 0.1 * protos[0])[:, None]  # nearest is 1, not in Top-2 -> 0
    emb[:, 0:10, 2] = protos[2][:, None]  # like the first group but outside the band
    emb[:, 20:30, 17] = protos[3][:, None]  # right side, in band, 3 in Top-2 -> becomes 3
    expected[20:30, 17] = True
    net = EmbeddingNet(FixedFeatures(emb[None]), nn.Identity(), 4)
    refiner = BoundaryRefiner(
        net,
        protos,
        torch.ones(4, dtype=torch.bool),
        class_names="abcd",
        config=RefinerConfig(embed_dim=4, top_n=2, radius=2),
    )
    return refiner, probs, emb, expected


def test_refiner_changes_exactly_the_expected_pixels(tmp_path: Path) -> None:
    refiner, probs, _, expected = _case()
    images = torch.zeros(1, 3, 32, 32)
    labels, changed = refiner.refine(images, probs, return_changed=True)
    assert labels.dtype == torch.int64 and labels.shape == (1, 32, 32)
    assert torch.equal(changed[0], expected)
    assert (labels[0][expected] == torch.tensor([2] * 10 + [3] * 10)).all()
    band = near_boundary_mask(probs.argmax(1), radius=2)
    assert not (changed & ~band).any()
    top2 = probs.topk(2, dim=1).indices
    assert ((top2 == labels[:, None]).any(1)).all()  # never a label outside the Top-N
    # logits give the same result (only the order of the scores matters)
    assert torch.equal(refiner.refine(images, probs.clamp(min=1e-6).log()), labels)

    # a class without prototype is never chosen: the planted 2s stay 0
    refiner.present[2] = False
    labels2, changed2 = refiner.refine(images, probs, return_changed=True)
    assert (labels2 != 2).all() and torch.equal(changed2[0], expected & (torch.arange(32) > 16))
    refiner.present[2] = True

    # one file, weights_only: the loaded refiner gives the same labels
    path = refiner.save(tmp_path / "refiner.pt")
    blank = EmbeddingNet(FixedFeatures(torch.zeros(1, 4, 32, 32)), nn.Identity(), 4)
    loaded = BoundaryRefiner.load(path, net=blank)
    assert loaded.class_names == ("a", "b", "c", "d") and loaded.config.top_n == 2
    assert torch.equal(loaded.refine(images, probs), labels)


def test_refiner_bad_inputs_are_clear_errors_or_no_ops(tmp_path: Path) -> None:
    refiner, probs, _, _ = _case()
    with pytest.raises(DataError, match="do not match"):
        refiner.refine(torch.zeros(1, 3, 30, 32), probs)
    with pytest.raises(CheckpointError, match="predicts 3 classes"):
        refiner.refine(torch.zeros(1, 3, 32, 32), probs[:, :3])
    with pytest.raises(CheckpointError, match="class names differ"):
        refiner.check_classes(["a", "b", "x", "d"], 4)
    with pytest.raises(CheckpointError, match="not a dualseg refiner"):
        torch.save({"a": torch.zeros(1)}, tmp_path / "x.pt")
        BoundaryRefiner.load(tmp_path / "x.pt")
    # no near-boundary pixel (one class everywhere): unchanged, embedding model never run
    flat = torch.zeros(1, 4, 32, 32)
    flat[:, 1] = 1
    labels, changed = refiner.refine(torch.zeros(1, 3, 32, 32), flat, return_changed=True)
    assert (labels == 1).all() and not changed.any() and refiner.net.backbone.calls == 0


def test_nearest_prototype_equals_brute_force_on_the_upsampled_embedding() -> None:
    """P5 reads a K-channel score map; it must pick what full C-dim distances pick."""
    from dualseg.models import ASPP

    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(3, 16, 3, stride=4, padding=1), nn.ReLU())
    net = EmbeddingNet(backbone, ASPP(16, 8, (1, 2)), 8).eval()
    for m in net.fuse.modules():  # ASPP's N(0, 0.01^2) init is nearly flat: spread it out
        if isinstance(m, nn.Conv2d):
            nn.init.normal_(m.weight, std=0.5)
    k, h, w = 6, 37, 45  # odd sizes: bilinear weights at non-integer positions
    protos = torch.randn(k, 8)
    present = torch.tensor([True, True, False, True, True, True])
    refiner = BoundaryRefiner(
        net,
        protos,
        present,
        class_names="abcdef",
        config=RefinerConfig(embed_dim=8, top_n=3, radius=3, input_scale=1.0, output_stride=4),
    )
    images = torch.randn(2, 3, h, w)
    probs = torch.randn(2, k, h, w).softmax(1)
    labels, changed = refiner.refine(images, probs, return_changed=True)

    with torch.no_grad():  # the full bilinear upsampling of the input padded to the stride
        emb = net(F.pad(images, (0, 3, 0, 3)))[..., :h, :w]  # [B,C,H,W]: 40x48 cropped
    d = torch.cdist(emb.permute(0, 2, 3, 1).reshape(-1, 8), protos).view(2, h, w, k)
    d = d.masked_fill(~present, float("inf"))
    top = probs.topk(3, dim=1).indices.permute(0, 2, 3, 1)  # [B,H,W,N]
    best = top.gather(3, d.gather(3, top).argmin(3, keepdim=True))[..., 0]
    pred = probs.argmax(1)
    edge = near_boundary_mask(pred, radius=3, ignore_index=None)
    # a pixel whose base label has no prototype keeps it (it used to take another candidate:
    # a class absent from the fit data vanished wherever it was near a boundary)
    kept = edge & ~present[pred]
    assert kept.sum() > 100 and (best[kept] != 2).all()
    expected = torch.where(edge & present[pred], best, pred)
    assert changed.any() and torch.equal(labels, expected)
    assert (labels[kept] == 2).all()


def test_tied_scores_keep_the_argmax_outside_the_band() -> None:
    """Pred is P2's argmax (first class on ties), as the base model's own prediction is."""
    refiner, probs, _, _ = _case()
    tied = probs.clone()
    tied[:, :, :, 16:] = 0.25  # right half: all four classes tie
    labels, changed = refiner.refine(torch.zeros(1, 3, 32, 32), tied, return_changed=True)
    pred = tied.argmax(1)
    band = near_boundary_mask(pred, radius=2, ignore_index=None)
    assert torch.equal(labels[~band], pred[~band])
    assert torch.equal(changed, labels != pred)


def test_the_batch_form_refuses_raw_pixels_and_warns_on_unnormalized_images() -> None:
    refiner, probs, _, _ = _case()
    raw = torch.full((1, 3, 32, 32), 128, dtype=torch.uint8)
    with pytest.raises(DataError, match=r"ImageNet-normalized float images, got torch\.uint8"):
        refiner.refine(raw, probs)
    with pytest.warns(UserWarning, match="looks like RGB before ImageNet normalization"):
        refiner.refine(torch.rand(1, 3, 32, 32), probs)
    # 0..255 floats cannot be normalized images: refused, where they were relabelled silently
    with pytest.raises(DataError, match=r"values up to 255 are no ImageNet-normalized"):
        refiner.refine(torch.full((1, 3, 32, 32), 255.0).index_fill(3, torch.tensor([0]), 0), probs)
    # numpy probabilities give numpy labels, whether the images are a tensor or an array
    image = torch.zeros(1, 3, 32, 32)
    for images in (image, image.numpy()):
        out = refiner.refine(images, probs.numpy())
        assert isinstance(out, np.ndarray) and out.shape == (1, 32, 32)


def test_save_replaces_a_refiner_and_refuses_any_other_file(tmp_path: Path) -> None:
    from checkpoint_helpers import write_synthetic_checkpoint
    from dualseg.errors import OutputError

    refiner, _, _, _ = _case()
    first = refiner.save(tmp_path / "r.pt")
    assert refiner.save(first) == first  # its own earlier file: replaced
    model = write_synthetic_checkpoint(tmp_path / "model.pt")
    before = model.read_bytes()
    with pytest.raises(OutputError, match=r"not a method-B refiner \(dualseg-checkpoint"):
        refiner.save(model)
    assert model.read_bytes() == before
    with pytest.raises(OutputError, match="is a folder"):
        refiner.save(tmp_path)
    (tmp_path / "cut.pt").write_bytes(b"PK\x03\x04 cut short")  # an interrupted save
    refiner.save(tmp_path / "cut.pt")


def test_broken_probabilities_and_weights_are_refused_not_relabelled(tmp_path: Path) -> None:
    """NaN ranks as no class: a diverged base or refiner would relabel at random, silently."""
    refiner, probs, _, _ = _case()
    images = torch.zeros(1, 3, 32, 32)
    broken = probs.clone()
    broken[0, :, 5:15, 10:20] = float("nan")
    with pytest.raises(DataError, match="NaN or infinite"):
        refiner.refine(images, broken)
    with pytest.raises(DataError, match="NaN or infinite"):
        refiner.refine(images, probs.log().clamp_min(-float("inf")) * float("inf"))
    path = refiner.save(tmp_path / "r.pt")
    state = torch.load(path, weights_only=True)
    state["prototypes"][1, 0] = float("nan")
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"r\.pt holds NaN or infinite values \(prototypes"):
        BoundaryRefiner.load(path)


def test_base_features_a_refiner_cannot_read_are_refused() -> None:
    """Only a base-frozen refiner at input scale 1 embeds the base's backbone output; reading
    it anyway gave other labels without an error."""
    from dualseg.errors import ConfigError
    from dualseg.refine import build_embedding_net

    net = build_embedding_net(
        "mobilenet_v2", embed_dim=8, output_stride=8, aspp_rates=(4, 6, 8, 12)
    )
    protos, present = torch.randn(2, 8), torch.ones(2, dtype=torch.bool)
    images = torch.randn(1, 3, 32, 32)
    probs = torch.zeros(1, 2, 32, 32)
    probs[:, 0, :, :16], probs[:, 1, :, 16:] = 1, 1
    feats = (torch.randn(1, 320, 4, 4), (32, 32))  # the stride-8 MobileNetV2 output
    for config in (
        RefinerConfig(embed_dim=8, p1_blur_sigma=0, backbone_source="independent", input_scale=1),
        RefinerConfig(embed_dim=8, p1_blur_sigma=0, backbone_source="base-frozen", input_scale=0.5),
    ):
        refiner = BoundaryRefiner(net, protos, present, class_names="ab", config=config)
        with pytest.raises(ConfigError, match="pass features=None"):
            refiner.refine(images, probs, features=feats)
    config = RefinerConfig(
        embed_dim=8, p1_blur_sigma=0, backbone_source="base-frozen", input_scale=1, output_stride=8
    )
    refiner = BoundaryRefiner(net, protos, present, class_names="ab", config=config)
    with pytest.raises(DataError, match="head reads 320 channels"):  # another backbone's
        refiner.refine(images, probs, features=(torch.randn(1, 17, 4, 4), (32, 32)))
    assert refiner.refine(images, probs, features=feats).shape == (1, 32, 32)


def test_a_base_without_class_names_is_said_so_not_called_different() -> None:
    refiner, _, _, _ = _case()
    with pytest.raises(
        CheckpointError, match=r"stores no class names \(they read class_0 \.\. class_3\)"
    ):
        refiner.check_classes([f"class_{i}" for i in range(4)], 4)
