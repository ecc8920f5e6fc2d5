"""Class prototypes (method B step 5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dualseg.refine import EmbeddingNet, PrototypeAccumulator, near_boundary_mask
from dualseg.refine.prototypes import stream_prototypes


def test_streamed_prototypes_equal_naive_means() -> None:
    emb = torch.randn(300, 5)
    labels = torch.randint(0, 6, (300,))
    labels[labels == 4] = 2  # class 4 never seen
    acc = PrototypeAccumulator(6, 5)
    for chunk in range(0, 300, 37):
        acc.update(emb[chunk : chunk + 37], labels[chunk : chunk + 37])
    protos, present = acc.compute()
    assert present.tolist() == [True, True, True, True, False, True]
    for k in (0, 1, 2, 3, 5):
        torch.testing.assert_close(protos[k], emb[labels == k].mean(0))

    # the training-set pass: means of the upsampled embedding at the near-boundary pixels
    net = EmbeddingNet(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Identity(), 4).eval()
    images = torch.randn(3, 3, 20, 24)
    masks = torch.randint(0, 3, (3, 20, 24))
    protos, present = stream_prototypes(
        net, list(zip(images, masks)), 4, radius=1, input_scale=1.0, output_stride=2, progress=False
    )
    with torch.no_grad():
        full = F.interpolate(net.features(images), size=(20, 24), mode="bilinear")
    edge = near_boundary_mask(masks, radius=1)
    feats, lab = full.permute(0, 2, 3, 1)[edge], masks[edge]
    assert present.tolist() == [True, True, True, False]
    for k in range(3):
        torch.testing.assert_close(protos[k], feats[lab == k].mean(0), atol=1e-5, rtol=1e-5)


def test_coinciding_prototypes_are_found_and_a_healthy_set_passes() -> None:
    from dualseg.refine.fit import coinciding_prototypes

    names = ["road", "sky", "car", "tree"]
    healthy = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.7, 0.7], [0.3, 0.1]])
    present = torch.tensor([True, True, True, True])
    assert coinciding_prototypes(healthy, present, names) == []
    collapsed = healthy.clone()
    collapsed[2] = collapsed[0] + 1e-7  # car's prototype on road's
    collapsed[3] = collapsed[1]  # tree's on sky's
    assert coinciding_prototypes(collapsed, present, names) == [("road", "car"), ("sky", "tree")]
    # an absent class has no prototype to compare (a zero row, say)
    absent = torch.tensor([True, True, False, False])
    assert coinciding_prototypes(collapsed, absent, names) == []
