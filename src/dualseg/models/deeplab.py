"""The peer model: torchvision's DeepLabV3 head on method A's dilated backbone."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torchvision.models.segmentation.deeplabv3 import ASPPPooling, DeepLabHead

from dualseg.models.base import SegmentationModel, pad_to_multiple, upsample_crop


class DeepLabV3(SegmentationModel):
    """backbone → torchvision ``DeepLabHead`` → bilinear upsampling; the paper's rates by
    default: (12, 24, 36) at output stride 8, (6, 12, 18) at 16."""

    def __init__(
        self,
        backbone: nn.Module,
        backbone_channels: int,
        num_classes: int,
        *,
        output_stride: int = 8,
        rates: Sequence[int] | None = None,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        self.num_classes, self.output_stride = num_classes, output_stride
        self.in_channels = in_channels
        if rates is None:
            rates = (12, 24, 36) if output_stride == 8 else (6, 12, 18)
        self.rates = tuple(int(r) for r in rates)
        self.backbone = backbone
        self.head = DeepLabHead(backbone_channels, num_classes, self.rates)

    def _pooling_norm_trains(self) -> bool:
        """Whether the image-pooling BatchNorm trains (frozen ones, as in fine-tuning, do not)."""
        return any(
            isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
            for pool in self.head.modules()
            if isinstance(pool, ASPPPooling)
            for m in pool.modules()
        )

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        if x.shape[0] == 1 and self._pooling_norm_trains() and not torch.jit.is_tracing():
            # BatchNorm's own error names neither the model nor the fix
            raise ValueError(
                "DeepLabV3 in training mode needs 2 or more images per batch (its image-pooling "
                "BatchNorm sees one value per channel); use a larger batch, or model.eval()"
            )
        size = (x.shape[-2], x.shape[-1])
        x = pad_to_multiple(x, self.output_stride)
        scores = self.head(self.backbone(x))  # [B, C, H'/os, W'/os]
        return upsample_crop(scores, (x.shape[-2], x.shape[-1]), size)
