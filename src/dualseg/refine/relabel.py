"""P2-P5 with a :class:`RefinerConfig`'s options, shared by ``BoundaryRefiner`` and the exported
refiner: Top-N candidates (P3) in the near-boundary band of the base prediction (P4), scored by
their prototype's distance to the pixel's embedding, then the decision (P5)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from dualseg.refine.config import RefinerConfig
from dualseg.refine.decision import Candidates, decide, gather_candidates


def prototype_scores(feats: Tensor, prototypes: Tensor) -> Tensor:
    """``s_k = |p_k|^2 - 2 e.p_k`` of embeddings ``feats [b,C,h,w]``: ``[b,K,h,w]``."""
    return prototype_row_scores(feats.movedim(1, -1), prototypes).movedim(-1, 1)


def prototype_row_scores(rows: Tensor, prototypes: Tensor) -> Tensor:
    """:func:`prototype_scores` of embeddings on the last dim (``[...,C]``): ``[...,K]``."""
    return rows.float() @ (-2 * prototypes).T + prototypes.pow(2).sum(1)


def collect(
    probs: Tensor, scores: Callable[[Tensor, Tensor], Tensor], present: Tensor,
    config: RefinerConfig, scale: float = 1.0, covered: tuple[float, float] | None = None,
) -> Candidates:  # fmt: skip
    """P2-P4 and P5's distances with ``config``'s Top-N and mask options."""
    return gather_candidates(
        probs, scores, present, top_n=config.top_n, radius=config.radius,
        edge_method=config.edge_method, scale=scale, covered=covered,
    )  # fmt: skip


def decide_as(c: Candidates, config: RefinerConfig) -> tuple[Tensor, Tensor]:
    """P5 with ``config``'s decision options (the claim by default)."""
    return decide(c, gate_margin=config.gate_margin, prior_weight=config.prior_weight,
                  min_prob=config.min_prob)  # fmt: skip


def relabel(
    probs: Tensor, scores: Callable[[Tensor, Tensor], Tensor], present: Tensor,
    config: RefinerConfig, *, scale: float = 1.0, covered: tuple[float, float] | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """P2-P5 on class scores ``probs [B,C,H,W]``: ``(labels [B,H,W] int64, changed bool)``."""
    return decide_as(collect(probs, scores, present, config, scale, covered), config)
