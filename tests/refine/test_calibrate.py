"""Method B's decision readings beyond the claim (gate, prior weight, probability floor,
switch cost): each decides exactly as documented, the sweep scores each setting exactly, and
the choice never falls below the base on the images that chose it."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from dualseg.errors import ConfigError
from dualseg.refine.calibrate import (
    CLAIM_DECISION,
    blocked_at,
    calibrate_decision,
    choose_decision,
    decision_grid,
    net_fixed,
    sweep_decision,
    switch_counts,
)
from dualseg.refine.config import switch_pairs
from dualseg.refine.decision import (
    Candidates,
    are_probabilities,
    decide,
    describe_decision,
    gather_candidates,
    prototype_scale,
    switch_names,
)
from dualseg.refine.fit_run import format_sweep
from dualseg.refine.refiner import BoundaryRefiner, RefinerConfig


def candidates(pred: torch.Tensor, edge: torch.Tensor, labels, distance, probs) -> Candidates:
    """Candidates for hand-written decisions: ``labels``/``distance``/``probs`` are [M,N]."""
    p = torch.tensor(probs, dtype=torch.float32)
    return Candidates(
        pred=pred,
        edge=edge,
        labels=torch.tensor(labels),
        distance=torch.tensor(distance, dtype=torch.float32),
        log_prob=p.log(),
        margin=p[:, 0] - p[:, 1],
    )


def three_pixels() -> Candidates:
    # pixel 0: base sure of 0 (0.9 vs 0.05), prototype of 1 nearer
    # pixel 1: base unsure (0.5 vs 0.45), prototype of 1 much nearer
    # pixel 2: base sure of 0, candidate 2 is improbable (0.02) but nearest
    pred = torch.zeros(1, 1, 3, dtype=torch.long)
    edge = torch.ones(1, 1, 3, dtype=torch.bool)
    return candidates(
        pred,
        edge,
        labels=[[0, 1], [0, 1], [0, 2]],
        distance=[[1.0, 0.5], [1.0, 0.0], [1.0, 0.2]],
        probs=[[0.9, 0.05], [0.5, 0.45], [0.9, 0.02]],
    )


def test_the_claim_takes_the_nearest_candidate_everywhere() -> None:
    out, changed = decide(three_pixels())
    assert out.tolist() == [[[1, 1, 2]]] and changed.all()


def test_prior_weight_moves_from_nearest_prototype_to_the_base() -> None:
    c = three_pixels()
    # λ = 0.5: pixel 0: 1.0 + 0.5·0.105 = 1.05 vs 0.5 + 0.5·3.0 = 2.0 -> keeps 0;
    # pixel 1: 1.35 vs 0.40 -> 1; pixel 2: 1.05 vs 0.2 + 0.5·3.9 = 2.16 -> keeps 0
    assert decide(c, prior_weight=0.5)[0].tolist() == [[[0, 1, 0]]]
    assert decide(c, prior_weight=100.0)[0].tolist() == [[[0, 0, 0]]]  # the base


def test_gate_and_floor() -> None:
    c = three_pixels()
    assert decide(c, gate_margin=0.2)[0].tolist() == [[[0, 1, 0]]]  # only the unsure pixel
    assert decide(c, gate_margin=0.0)[1].sum() == 0  # τ = 0 never relabels
    assert decide(c, min_prob=0.03)[0].tolist() == [[[1, 1, 0]]]  # candidate 2 (0.02) dropped


def test_switch_cost_relabels_only_where_another_label_is_nearer_by_more() -> None:
    c = three_pixels()  # the other label is nearer by 0.5, 1.0 and 0.8
    assert decide(c, switch_cost=0.6)[0].tolist() == [[[0, 1, 2]]]
    assert decide(c, switch_cost=0.9)[0].tolist() == [[[0, 1, 0]]]
    assert decide(c, switch_cost=1.0)[1].sum() == 0  # a tie keeps the base's label
    # with the prior and the floor: scores 1.05 vs 2.0, 1.35 vs 0.4, 1.05 vs inf (floor)
    assert decide(c, prior_weight=0.5, min_prob=0.03, switch_cost=0.9)[0].tolist() == [[[0, 1, 0]]]
    assert decide(c, prior_weight=0.5, switch_cost=1.0)[1].sum() == 0


def test_the_base_label_is_found_whatever_its_top_n_rank() -> None:
    # tied probabilities: Top-N put the base's label (0, argmax's first index) second
    one = torch.zeros(1, 1, 1, dtype=torch.long)
    swapped = candidates(one, one == 0, [[1, 0]], [[0.0, 0.3]], [[0.5, 0.5]])
    assert decide(swapped, switch_cost=0.2)[0].item() == 1
    assert decide(swapped, switch_cost=0.3)[0].item() == 0  # a tie keeps the base
    assert decide(swapped, switch_cost=0.4)[0].item() == 0
    weak = candidates(one, one == 0, [[1, 0]], [[0.3, 0.0]], [[0.1, 0.1]])
    assert decide(weak, min_prob=0.2)[0].item() == 0  # the floor never drops the base
    equal = candidates(one, one == 0, [[1, 0]], [[0.5, 0.5]], [[0.5, 0.5]])
    assert decide(equal)[0].item() == 0  # nearest prototypes tied: the base stays


def test_the_grid_holds_the_switch_costs_and_the_claim_once() -> None:
    grid = decision_grid(gates=(0.0, None), priors=(0.0,), min_probs=(0.0,), blur_sigmas=(0.0,))
    assert [(g["gate_margin"], g["switch_cost"]) for g in grid] == [
        (0.0, 0.0), (None, 0.0), (None, 0.1), (None, 0.2)]  # fmt: skip
    assert grid[1] == dict(CLAIM_DECISION)


def test_a_pixel_without_prototypes_keeps_the_base_label() -> None:
    pred = torch.tensor([[[3]]])
    c = candidates(pred, pred == 3, [[3, 1]], [[float("inf")] * 2], [[0.6, 0.3]])
    assert decide(c)[0].tolist() == [[[3]]]


def test_prototype_scale_makes_prior_weight_independent_of_the_embedding_scale() -> None:
    protos = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [9.0, 9.0]])
    present = torch.tensor([True, True, True, False])
    # mean squared distance over the 3 present pairs: (1 + 4 + 5) / 3
    assert prototype_scale(protos, present) == pytest.approx(10 / 3)
    assert prototype_scale(3 * protos, present) == pytest.approx(9 * 10 / 3)
    assert prototype_scale(protos[:1], present[:1]) == 1.0


def test_candidates_read_logits_as_their_softmax() -> None:
    # two classes, margins top1 - top2 of 0, 0.1, 0.3, 0.9; class 0 on the left, 1 on the right
    margins = torch.tensor([[0.0, 0.1, 0.3, 0.9]])
    p1 = (1 + margins) / 2
    probs = torch.stack([1 - p1, p1])[None]  # [1,2,1,4]: class 1 everywhere
    probs[0, :, 0, :2] = probs[0, :, 0, :2].flip(0)  # class 0 on the left half
    present = torch.ones(2, dtype=torch.bool)
    # prototype scores: the other class is nearer everywhere, so every let-through pixel moves
    other = torch.tensor([[[[1.0, 1.0, 0.0, 0.0]], [[0.0, 0.0, 1.0, 1.0]]]])  # [1,2,1,4]

    def gather(p: torch.Tensor) -> Candidates:
        return gather_candidates(
            p,
            lambda keep, _band: other[keep],
            present,
            top_n=2,
            radius=2,
            edge_method="neighbour",
        )

    from_probs, from_logits = gather(probs), gather(probs.log())
    assert from_probs.edge.all() and from_probs.pred.tolist() == [[[0, 0, 1, 1]]]
    assert torch.allclose(from_probs.margin, margins[0], atol=1e-6)
    assert torch.allclose(from_logits.margin, from_probs.margin, atol=1e-6)
    assert torch.allclose(from_logits.log_prob, from_probs.log_prob, atol=1e-6)
    assert torch.equal(from_logits.labels, from_probs.labels)
    # the gate reads that margin: τ = 0.2 lets through the two unsure pixels only
    assert decide(from_probs, gate_margin=0.2)[1].tolist() == [[[True, True, False, False]]]


def test_candidates_equal_the_dense_top_n_at_each_near_boundary_pixel() -> None:
    # P3 computed only at the near-boundary pixels equals Top-N of the whole map read there
    torch.manual_seed(0)
    logits = torch.nn.functional.interpolate(torch.randn(2, 6, 4, 5) * 3, size=(24, 30))
    scores = torch.rand(2, 6, 24, 30)
    present = torch.tensor([True, True, False, True, True, True])
    c = gather_candidates(
        logits,
        lambda keep, _band: scores[keep],
        present,
        top_n=3,
        radius=1,
        edge_method="neighbour",
    )
    assert 0 < int(c.edge.sum()) < c.edge.numel()
    b, y, x = c.edge.nonzero().unbind(1)
    top_p, top = logits.softmax(1).topk(3, dim=1)
    assert torch.equal(c.pred, logits.argmax(1))
    assert torch.equal(c.labels, top[b, :, y, x])
    assert torch.allclose(c.log_prob, top_p[b, :, y, x].log(), atol=1e-5)
    assert torch.allclose(c.margin, top_p[b, 0, y, x] - top_p[b, 1, y, x], atol=1e-6)
    # one image at a time (the single-image fast paths, a channels-last model's output too)
    # gives each image's rows of the batch
    for i, layout in ((0, torch.contiguous_format), (1, torch.channels_last)):
        one = gather_candidates(
            logits[i : i + 1].contiguous(memory_format=layout),
            lambda keep, _band, i=i: scores[i : i + 1][keep],
            present,
            top_n=3,
            radius=1,
            edge_method="neighbour",
        )
        assert torch.equal(one.labels, c.labels[b == i])
        assert torch.equal(one.log_prob, c.log_prob[b == i])
        assert torch.equal(one.distance, c.distance[b == i])
        assert torch.equal(decide(one)[0][0], decide(c)[0][i])
    dist = scores[b, :, y, x].gather(1, c.labels)
    absent = ~present[c.labels]
    # a pixel whose base label has no prototype: no candidate is known nearer, it keeps it
    unknown = absent | ~present[c.pred[b, y, x]][:, None]
    assert torch.isinf(c.distance[unknown]).all() and (~unknown).any()
    assert torch.allclose(c.distance[~unknown], dist[~unknown], atol=1e-6)


class Fixed:
    """A stand-in refiner whose candidates are given."""

    def __init__(self, c: Candidates) -> None:
        self.c = c
        self.sigmas: list[float | None] = []

    def candidates(self, images, probs, *, p1_blur_sigma=None, features=None):
        self.sigmas.append(p1_blur_sigma)
        return self.c


def test_sweep_scores_each_setting_and_chooses_the_best() -> None:
    c = three_pixels()
    label = torch.tensor([[[0, 1, 0]]])  # right: keep 0, relabel the unsure pixel, keep 0
    batches = [(torch.zeros(1, 3, 1, 3), label)]
    grid = decision_grid(gates=(0.0, 0.2, None), priors=(0.0, 0.5), min_probs=(0.0,),
                         switch_costs=(0.0,), blur_sigmas=(0.0,))  # fmt: skip
    assert len(grid) == 5  # τ = 0 once
    rows = sweep_decision(
        Fixed(c), lambda x: torch.zeros(1, 3, 1, 3), batches, num_classes=3, grid=grid
    )
    by = {(r["gate_margin"], r.get("prior_weight")): r for r in rows}
    assert by[("base", None)]["pixel_acc"] == pytest.approx(2 / 3)
    assert by[(None, 0.0)]["pixel_acc"] == pytest.approx(1 / 3)  # the claim breaks two
    assert by[(0.2, 0.0)]["pixel_acc"] == by[(None, 0.5)]["pixel_acc"] == pytest.approx(1.0)
    assert by[(0.0, 0.0)]["changed"] == 0
    # fixed: wrong before, right after; broken: the reverse (fractions of labelled pixels)
    assert (by[(None, 0.0)]["fixed"], by[(None, 0.0)]["broken"]) == pytest.approx((1 / 3, 2 / 3))
    assert (by[(0.2, 0.0)]["fixed"], by[(0.2, 0.0)]["broken"]) == pytest.approx((1 / 3, 0))
    # net_fixed: the fixed less twice the broken
    assert by[(None, 0.0)]["net_fixed"] == pytest.approx(1 / 3 - 4 / 3)
    assert by[(0.2, 0.0)]["net_fixed"] == pytest.approx(1 / 3)
    # two perfect rows, both changing one pixel of three: the first of them wins the tie
    assert choose_decision(rows) == {
        "gate_margin": 0.2,
        "prior_weight": 0.0,
        "min_prob": 0.0,
        "switch_cost": 0.0,
        "blocked_switches": (),
        "p1_blur_sigma": 0.0,
    }


def test_choice_falls_back_to_never_relabelling_when_refinement_only_hurts() -> None:
    label = torch.zeros(1, 1, 3, dtype=torch.long)  # the base (class 0 everywhere) is right
    refiner = Fixed(three_pixels())
    rows = sweep_decision(
        refiner,
        lambda x: torch.zeros(1, 3, 1, 3),
        [(torch.zeros(1, 3, 1, 3), label)],
        num_classes=3,
        grid=decision_grid(gates=(0.0, 0.5, None), priors=(0.0,), min_probs=(0.0,)),
    )
    # the default blur sweep (none and 1 px): the candidates are asked for once per blur
    assert sorted(refiner.sigmas) == [0.0, 1.0]
    assert {r.get("p1_blur_sigma") for r in rows} == {None, 0.0, 1.0}  # None: the base row
    assert choose_decision(rows)["gate_margin"] == 0.0
    base = next(r for r in rows if r["gate_margin"] == "base")
    assert next(r for r in rows if r["gate_margin"] == 0.0)["miou"] == base["miou"]


def test_a_refiner_reading_the_base_features_is_never_offered_a_blur() -> None:
    class Kept:  # the base's features, as refiner.shared_features(model) keeps them
        module = torch.nn.Identity()

        def take(self, images: torch.Tensor) -> None:
            return None

    # a blur would make it run a second backbone (~6x its time on the peer)
    sharing = Fixed(three_pixels())
    swept = sweep_decision(
        sharing,
        lambda x: torch.zeros(1, 3, 1, 3),
        [(torch.zeros(1, 3, 1, 3), torch.zeros(1, 1, 3, dtype=torch.long))],
        num_classes=3,
        shared=Kept(),
        grid=decision_grid(gates=(0.0, None), priors=(0.0,), min_probs=(0.0,)),
    )
    assert sharing.sigmas == [0.0] and {r.get("p1_blur_sigma") for r in swept} == {None, 0.0}


def test_p1_filter_blurs_and_zero_is_the_identity() -> None:
    from dualseg.refine.embedding import p1_filter

    x = torch.zeros(1, 3, 9, 9)
    x[..., 4, 4] = 1.0
    assert p1_filter(x, 0.0) is x
    y = p1_filter(x, 1.0)
    assert y[..., 4, 4].max() < 0.2 and y.sum() == pytest.approx(3.0, rel=1e-4)
    flat = torch.full((1, 3, 9, 9), 0.7)
    assert torch.allclose(p1_filter(flat, 1.5), flat)
    # a blur wider than the image is cut to it (reflection refused it: a traceback at apply)
    wide = p1_filter(torch.randn(1, 3, 6, 10), 50.0)
    assert wide.shape == (1, 3, 6, 10) and wide.std() < 0.2
    with pytest.raises(ConfigError, match="p1_blur_sigma must be >= 0 and finite, got inf"):
        RefinerConfig(p1_blur_sigma=float("inf"))


def test_the_choice_maximizes_the_metric_asked_for() -> None:
    def row(gate: float, miou: float, bf1: float, changed: float) -> dict:
        options = {"prior_weight": 0.0, "min_prob": 0.0, "p1_blur_sigma": 0.0}
        scores = {"miou": miou, "boundary_f1": bf1, "changed": changed}
        return {"gate_margin": gate, **options, **scores, "fixed": changed, "broken": 0.0}

    rows = [
        {"gate_margin": "base", "miou": 0.9, "boundary_f1": 0.9, "changed": 0.0},  # never chosen
        row(0.0, 0.50, 0.30, 0.0),
        row(0.1, 0.52, 0.31, 0.01),  # the best mIoU
        row(0.5, 0.51, 0.36, 0.05),  # the best boundary F1, at some cost in mIoU
    ]
    assert choose_decision(rows)["gate_margin"] == 0.1
    assert choose_decision(rows, metric="boundary_f1")["gate_margin"] == 0.5
    # the sweep's report lists the best rows by the metric that chose
    by_edges = format_sweep(rows, metric="boundary_f1", best=1).splitlines()
    assert len(by_edges) == 2 and "gate 0.5" in by_edges[1]


def test_a_broken_ratio_limits_the_choice_to_settings_within_it() -> None:
    def row(gate: float | None, miou: float, fixed: float, broken: float) -> dict:
        options = {"prior_weight": 0.0, "min_prob": 0.0, "p1_blur_sigma": 0.0}
        scores = {"miou": miou, "boundary_f1": 0.3, "changed": fixed + broken}
        return {"gate_margin": gate, **options, **scores, "fixed": fixed, "broken": broken}

    rows = [
        {"gate_margin": "base", "miou": 0.50, "boundary_f1": 0.3, "changed": 0.0},
        row(0.0, 0.50, 0.0, 0.0),
        row(None, 0.53, 0.020, 0.015),  # the best mIoU, 0.75 broken per fixed
        row(0.3, 0.52, 0.010, 0.004),  # 0.4 broken per fixed
    ]
    assert choose_decision(rows)["gate_margin"] is None
    assert choose_decision(rows, max_broken_ratio=1.0)["gate_margin"] is None
    assert choose_decision(rows, max_broken_ratio=0.5)["gate_margin"] == 0.3
    assert choose_decision(rows, max_broken_ratio=0.0)["gate_margin"] == 0.0  # none within it
    # a row exactly at the ratio qualifies (3 broken, 10 fixed of 15 pixels: in binary floats
    # 3/15 > 0.3 x 10/15)
    at = [*rows[:2], row(0.2, 0.54, 10 / 15, 3 / 15)]
    assert choose_decision(at, max_broken_ratio=0.3)["gate_margin"] == 0.2
    assert choose_decision(at, max_broken_ratio=0.29)["gate_margin"] == 0.0
    # never relabelling is the choice even where the sweep left it out
    assert choose_decision(rows[2:], max_broken_ratio=0.1)["gate_margin"] == 0.0
    # the sweep's report names the chosen row, and the pixels each row fixed and broke
    lines = format_sweep(rows, metric="miou", best=1, chosen={"gate_margin": 0.3}).splitlines()
    assert "gate 0.3" in lines[-1] and "fixed 1.00%  broke 0.40%  <- chosen" in lines[-1]
    lines = format_sweep(rows, metric="miou", chosen={"gate_margin": 0.3}).splitlines()
    assert [line.endswith("<- chosen") for line in lines] == [False, False, True, False]


def test_net_fixed_chooses_the_setting_whose_relabels_pay_twice_over() -> None:
    def row(gate: float | None, miou: float, fixed: float, broken: float) -> dict:
        options = {"prior_weight": 0.0, "min_prob": 0.0, "p1_blur_sigma": 0.0}
        scores = {"miou": miou, "boundary_f1": 0.3, "changed": fixed + broken}
        return {"gate_margin": gate, **options, **scores, "fixed": fixed, "broken": broken,
                "net_fixed": net_fixed(fixed, broken)}  # fmt: skip

    rows = [
        row(0.0, 0.50, 0.0, 0.0),
        row(None, 0.53, 0.020, 0.009),  # the best mIoU, 0.45 broken per fixed: net 0.002
        row(0.3, 0.52, 0.012, 0.004),  # 0.33 broken per fixed: net 0.004
        row(0.1, 0.51, 0.003, 0.0),  # breaks nothing, fixes little: net 0.003
    ]
    assert choose_decision(rows, metric="miou")["gate_margin"] is None
    assert choose_decision(rows, metric="net_fixed")["gate_margin"] == 0.3
    # within a ratio too: only the rows within it compete
    assert choose_decision(rows, metric="net_fixed", max_broken_ratio=0.2)["gate_margin"] == 0.1
    # where every setting breaks more than half of what it fixes, it never relabels
    worse = [rows[0], row(None, 0.53, 0.020, 0.011), row(0.3, 0.52, 0.010, 0.006)]
    assert choose_decision(worse, metric="net_fixed")["gate_margin"] == 0.0
    assert choose_decision(worse, metric="miou")["gate_margin"] is None


def test_decision_settings_read_the_same_in_every_report() -> None:
    assert describe_decision() == "the claim's rule"
    assert describe_decision(gate_margin=0.0) == "gate 0: never relabel"
    words = describe_decision(gate_margin=0.1, prior_weight=0.5, min_prob=0.2, p1_blur_sigma=1.0)
    assert words == "gate 0.1, prior 0.5, floor 0.2, P1 blur 1"
    assert describe_decision(switch_cost=0.1) == "switch cost 0.1"
    rows = [
        {"gate_margin": "base", "miou": 0.5, "boundary_f1": 0.3, "changed": 0.0},
        {
            "gate_margin": None,
            "prior_weight": 0.0,
            "min_prob": 0.0,
            "miou": 0.4,
            "boundary_f1": 0.2,
            "changed": 0.1,
            "fixed": 0.04,
            "broken": 0.06,
        },
        {
            "gate_margin": 0.1,
            "prior_weight": 0.5,
            "min_prob": 0.2,
            "p1_blur_sigma": 1.0,
            "miou": 0.6,
            "boundary_f1": 0.35,
            "changed": 0.01,
            "fixed": 0.008,
            "broken": 0.002,
        },
    ]
    lines = format_sweep(rows, metric="miou").splitlines()
    assert [line.split(":")[0].strip() for line in lines] == [
        "base model",
        "the claim's rule",
        words,
    ]
    assert "mIoU 60.0" in lines[2] and "changed 1.00%" in lines[2]


def test_are_probabilities_reads_maps_and_rows_alike() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.1, 0.2, 0.3]])  # [M,C] rows
    assert not are_probabilities(logits)
    assert are_probabilities(logits.softmax(1))
    assert are_probabilities(logits.softmax(1).T[None, :, :, None])  # [1,C,M,1] map
    assert not are_probabilities(logits.abs())  # non-negative, but not summing to one
    assert are_probabilities(torch.zeros(0, 3))  # no near-boundary rows: nothing to convert


def test_a_blocked_switch_keeps_the_base_label_and_other_switches_go_on() -> None:
    c = three_pixels()  # the claim: 0 -> 1, 0 -> 1, 0 -> 2
    assert decide(c, blocked_switches=((0, 1),))[0].tolist() == [[[0, 0, 2]]]
    assert decide(c, blocked_switches=((0, 2), (1, 0)))[0].tolist() == [[[1, 1, 0]]]
    assert describe_decision(gate_margin=0.2, blocked_switches=((0, 2), (1, 0))) == (
        "gate 0.2, 2 switches blocked"
    )
    assert switch_names(((0, 2), (1, 0)), "abc") == "0:2 (a -> c) 1:0 (b -> a)"
    assert switch_names((), "abc") == "none"


def test_switch_counts_split_each_switch_into_fixed_and_broken() -> None:
    label = torch.tensor([[[0, 1, 255]]])  # the claim breaks pixel 0, fixes 1; 2 is ignored
    counts = switch_counts(Fixed(three_pixels()), lambda x: torch.zeros(1, 3, 1, 3),
                           [(torch.zeros(1, 3, 1, 3), label)], CLAIM_DECISION,
                           num_classes=3)  # fmt: skip
    assert counts[0].tolist() == [[0, 1, 0], [0, 0, 0], [0, 0, 0]]  # fixed: 0 -> 1 once
    assert counts[1].tolist() == [[0, 1, 0], [0, 0, 0], [0, 0, 0]]  # broken: 0 -> 1 once
    assert blocked_at(counts, 1.0) == () and blocked_at(counts, 0.5) == ((0, 1),)


def test_a_broken_ratio_out_of_the_grids_reach_is_met_by_blocking_a_switch() -> None:
    # two pixels alike to every reading of the grid (same probabilities and distances): the
    # nearer prototype is right at the one (0 -> 1) and wrong at the other (0 -> 2)
    pred = torch.zeros(1, 1, 2, dtype=torch.long)
    c = candidates(pred, pred == 0, [[0, 1], [0, 2]], [[1.0, 0.0], [1.0, 0.0]],
                   [[0.6, 0.4], [0.6, 0.4]])  # fmt: skip
    label = torch.tensor([[[1, 0]]])
    args = (Fixed(c), lambda x: torch.zeros(1, 3, 1, 2), lambda: [(torch.zeros(1, 3, 1, 2), label)])
    chosen, rows = calibrate_decision(*args, num_classes=3, max_broken_ratio=0.5)
    assert chosen["blocked_switches"] == ((0, 2),) and chosen["gate_margin"] != 0.0
    assert {r["broken"] for r in rows if r.get("blocked_switches")} == {0.0}
    # without a ratio the grid's best stands, and no blocked row is scored
    free, rows = calibrate_decision(*args, num_classes=3)
    assert free["blocked_switches"] == () and not any(r.get("blocked_switches") for r in rows)


def test_blocked_switches_are_pairs_of_two_classes_in_every_form() -> None:
    assert RefinerConfig(blocked_switches=[[1, 4], [2, 0]]).blocked_switches == ((1, 4), (2, 0))
    cfg = RefinerConfig(blocked_switches=((1, 4),))
    assert RefinerConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    for bad in (((1, 1),), ((1, -2),), ((1, 2, 3),), ("1:2",)):
        with pytest.raises(ConfigError, match="blocked_switches"):
            RefinerConfig(blocked_switches=bad)
    assert switch_pairs("1:4,2:0") == ((1, 4), (2, 0)) and switch_pairs("None") == ()
    for text in ("1-4", "1:4,", "3:3", "1:2:3", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="expected A:B pairs"):
            switch_pairs(text)
    with pytest.raises(
        ConfigError, match=r"blocked switch 0:3 names a class outside 0..2: pass pairs"
    ):
        cfg = RefinerConfig(blocked_switches=((0, 3),))
        BoundaryRefiner(None, torch.zeros(3, 4), torch.ones(3), class_names="abc", config=cfg)
