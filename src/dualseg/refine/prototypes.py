"""Class prototypes (method B, training step 5): E_j = mean near-boundary embedding of label j."""

from __future__ import annotations

import torch
from torch import Tensor
from tqdm.auto import tqdm

from dualseg.errors import DataError
from dualseg.refine.boundary import near_boundary_mask
from dualseg.refine.embedding import EmbeddingNet, embed_pixels


def require_class_labels(labels: Tensor, num_classes: int, ignore_index: int, what: str) -> None:
    """Refuse label values that are neither a class nor ``ignore_index`` (the triplets would
    draw them as classes, the prototypes drop them)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= num_classes))
    if bool(bad.any()):
        values = torch.unique(labels[bad]).tolist()[:8]
        raise DataError(
            f"{what} hold label values {values}, neither a class of the {num_classes} class "
            f"names nor the ignore index {ignore_index}: map the labels (meta.json, "
            "--label-map, --ignore-index)"
        )


class PrototypeAccumulator:
    """Running per-class sums of embeddings; ``compute()`` gives the means."""

    def __init__(self, num_classes: int, dim: int, *, device: str | torch.device = "cpu") -> None:
        self.sums = torch.zeros(num_classes, dim, dtype=torch.float64, device=device)
        self.counts = torch.zeros(num_classes, dtype=torch.int64, device=device)

    def update(self, emb: Tensor, labels: Tensor) -> None:
        """Add embeddings ``[N,C]`` with labels ``[N]`` (labels outside ``[0, K)`` are skipped)."""
        labels = labels.to(self.counts.device).long()
        keep = (labels >= 0) & (labels < self.counts.numel())
        emb, labels = emb.detach().to(self.sums.device, torch.float64)[keep], labels[keep]
        self.sums.index_add_(0, labels, emb)
        self.counts += torch.bincount(labels, minlength=self.counts.numel())

    def compute(self) -> tuple[Tensor, Tensor]:
        """``(prototypes float32 [K,C], present bool [K])``; rows of absent classes are zero."""
        present = self.counts > 0
        protos = self.sums / self.counts.clamp(min=1).unsqueeze(1).to(torch.float64)
        return protos.float(), present


def compute_prototypes(emb: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """Prototypes of one in-memory set ``emb [N,C]``, ``labels [N]``."""
    acc = PrototypeAccumulator(num_classes, emb.shape[1], device=emb.device)
    acc.update(emb, labels)
    return acc.compute()


@torch.no_grad()
def stream_prototypes(
    net: EmbeddingNet, dataset: torch.utils.data.Dataset, num_classes: int, *, radius: int = 5,
    edge_method: str = "canny", input_scale: float, output_stride: int, ignore_index: int = 255,
    device: str | torch.device = "cpu", num_workers: int = 0, progress: bool = True,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Step 5 over ``dataset`` (one image at a time, any sizes): ``(prototypes, present)``."""
    net.eval()
    acc = PrototypeAccumulator(num_classes, net.embed_dim, device=device)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=num_workers)
    for images, labels in tqdm(loader, desc="prototypes", disable=not progress):
        images, labels = images.to(device), labels.to(device)
        require_class_labels(labels, num_classes, ignore_index, "the prototype images")
        edge = near_boundary_mask(
            labels, radius=radius, ignore_index=ignore_index, method=edge_method
        )
        if edge.any():
            acc.update(embed_pixels(net, images, edge, input_scale, output_stride), labels[edge])
    return acc.compute()
