"""Method B on the base model's own features: a frozen backbone keeps weights and statistics."""

from __future__ import annotations

import torch

from dualseg.refine.embedding import build_embedding_net


def test_frozen_backbone_keeps_weights_and_bn_statistics_while_the_head_learns() -> None:
    torch.manual_seed(0)
    net = build_embedding_net(
        "mobilenet_v2",
        embed_dim=8,
        output_stride=16,
        aspp_rates=(4, 6, 8, 12),
        freeze_backbone=True,
    )
    before = {k: v.clone() for k, v in net.backbone.state_dict().items()}
    head_before = {k: v.clone() for k, v in net.fuse.state_dict().items()}
    trainable = [p for p in net.parameters() if p.requires_grad]
    assert trainable and all(not p.requires_grad for p in net.backbone.parameters())
    opt = torch.optim.SGD(trainable, lr=0.1)
    net.train()
    assert not net.backbone.training and net.fuse.training
    loss = net(torch.randn(2, 3, 64, 64)).square().mean()
    loss.backward()
    opt.step()
    for k, v in net.backbone.state_dict().items():  # weights and running_mean/var alike
        assert torch.equal(v, before[k]), k
    assert any(not torch.equal(v, head_before[k]) for k, v in net.fuse.state_dict().items())
