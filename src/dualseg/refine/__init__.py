"""dualseg.refine — method B: boundary re-optimization of any segmentation model.

>>> from dualseg.refine import BoundaryRefiner                       # doctest: +SKIP
>>> refiner = BoundaryRefiner.load("refiner.pt")                     # doctest: +SKIP
>>> labels = refiner.refine(images, probs)   # [B,3,H,W] normalized, [B,C,H,W] -> [B,H,W]
>>> labels = refiner.refine(images, base=model)   # runs the base once (its taps too)
"""

from dualseg.refine.boundary import near_boundary_mask, semantic_boundary
from dualseg.refine.config import RefinerConfig
from dualseg.refine.embedding import EmbeddingNet, build_embedding_net, init_backbone_from
from dualseg.refine.prototypes import PrototypeAccumulator, compute_prototypes
from dualseg.refine.refiner import BoundaryRefiner
from dualseg.refine.taps import list_taps, pick_taps
from dualseg.refine.triplet import sample_triplets, triplet_hinge, triplet_loss, triplet_step

__all__ = [
    "BoundaryRefiner",
    "EmbeddingNet",
    "PrototypeAccumulator",
    "RefinerConfig",
    "build_embedding_net",
    "compute_prototypes",
    "init_backbone_from",
    "list_taps",
    "near_boundary_mask",
    "pick_taps",
    "sample_triplets",
    "semantic_boundary",
    "triplet_hinge",
    "triplet_loss",
    "triplet_step",
]
