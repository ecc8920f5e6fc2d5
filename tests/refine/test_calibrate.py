"""Gated method B (beyond the claim): the τ sweep scores each gate exactly, and the choice
never falls below the base on the images that chose it."""

from __future__ import annotations

import pytest
import torch

from dualseg.refine.calibrate import choose_gate, gate_mask, sweep_gate


class RelabelEverything:
    """A stand-in refiner: every pixel of the left half becomes class ``to``."""

    def __init__(self, to: int) -> None:
        self.to = to

    def refine(self, images, probs, *, return_changed=False):
        pred = probs.max(1).indices
        new = pred.clone()
        new[..., : pred.shape[-1] // 2] = self.to
        return (new, new != pred) if return_changed else new


def probs_with_margin(margins: torch.Tensor) -> torch.Tensor:
    """Two-class probabilities [1,2,H,W] favouring class 1 by ``margins`` (top1 - top2)."""
    p1 = (1 + margins) / 2
    return torch.stack([1 - p1, p1])[None]


def test_gate_mask_is_top1_minus_top2_below_tau() -> None:
    margins = torch.tensor([[0.0, 0.1, 0.3, 0.9]])
    probs = probs_with_margin(margins)
    assert gate_mask(probs, 0.2).tolist() == [[[True, True, False, False]]]
    assert gate_mask(probs, 0.0).sum() == 0  # τ = 0 never relabels
    assert gate_mask(probs, None).all()  # the claim: no gate


def test_sweep_scores_each_gate_and_choice_is_never_below_the_base() -> None:
    # Base predicts class 1 everywhere. Ground truth: class 0 on the left half exactly where
    # the base is unsure (margin 0.1), class 1 where it is sure (margin 0.8).
    margins = torch.tensor([[0.1, 0.1, 0.8, 0.8], [0.8, 0.8, 0.8, 0.8]]).repeat(2, 1)
    label = torch.ones(4, 4, dtype=torch.long)
    label[0, :2] = label[2, :2] = 0
    probs = probs_with_margin(margins)
    batches = [(torch.zeros(1, 3, 4, 4), label[None])]
    rows = sweep_gate(
        RelabelEverything(0), lambda x: probs, batches, num_classes=2, gates=(0.0, 0.2, None)
    )
    by_gate = {r["gate_margin"]: r for r in rows}
    assert by_gate[0.0]["miou"] == by_gate["base"]["miou"] and by_gate[0.0]["changed"] == 0
    # τ = 0.2 fixes exactly the 4 unsure pixels: perfect.
    assert by_gate[0.2]["miou"] == pytest.approx(1.0) and by_gate[0.2]["changed"] == 4 / 16
    # no gate also relabels the sure left-half pixels (4 more), breaking them
    assert by_gate[None]["changed"] == 8 / 16 and by_gate[None]["miou"] < 1.0
    assert choose_gate(rows) == 0.2


def test_choice_falls_back_to_never_relabelling_when_refinement_only_hurts() -> None:
    label = torch.ones(1, 4, 4, dtype=torch.long)  # the base (class 1 everywhere) is right
    probs = probs_with_margin(torch.full((4, 4), 0.1))
    rows = sweep_gate(
        RelabelEverything(0),
        lambda x: probs,
        [(torch.zeros(1, 3, 4, 4), label)],
        num_classes=2,
        gates=(0.0, 0.5, None),
    )
    assert choose_gate(rows) == 0.0
    base = next(r for r in rows if r["gate_margin"] == "base")
    assert next(r for r in rows if r["gate_margin"] == 0.0)["miou"] == base["miou"]


def test_gate_mask_reads_logits_as_their_softmax() -> None:
    probs = probs_with_margin(torch.tensor([[0.05, 0.6]]))
    assert torch.equal(gate_mask(probs.log(), 0.2), gate_mask(probs, 0.2))
