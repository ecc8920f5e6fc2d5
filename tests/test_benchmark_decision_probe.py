"""benchmarks/decision_probe.py: its fixed / broken counts and mIoU from the band cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmark_helpers import load_benchmark, run_script
from dualseg.metrics import ConfusionMatrix
from dualseg.refine.decision import Candidates


def cache_of(pred: list[int], gt: list[int], distance: list[list[float]]) -> dict:
    """A band of M pixels, candidates (base label, other label), the whole image = the band."""
    p, g = torch.tensor(pred), torch.tensor(gt)
    m = len(pred)
    labels = torch.stack([p, 1 - p], 1)
    cands = Candidates(p[None, None], torch.ones(1, 1, m, dtype=torch.bool), labels,
                       torch.tensor(distance), torch.full((m, 2), -0.7), torch.zeros(m),
                       torch.arange(m))  # fmt: skip
    cm = ConfusionMatrix(2)
    cm.update(p, g)
    return {"images": 1, "cm": cm.mat, "gt": g, "cands": cands}


def test_sweep_counts_fixed_and_broken_and_the_switch_cost_keeps_labels() -> None:
    probe = load_benchmark("decision_probe")
    # pixel 0: base wrong, the other prototype nearer by 1 (fixed); pixel 1: base right, the
    # other nearer by 0.1 (broken unless the switch cost exceeds 0.1); pixel 2: base nearer
    cache = cache_of([0, 1, 1], [1, 1, 1], [[1.0, 0.0], [0.1, 0.0], [0.0, 1.0]])
    rows = probe.sweep(cache, [0.0, 0.2], 2)
    assert rows[0] == {"setting": "base", "miou": pytest.approx(100 / 3), "changed": 0,
                       "fixed": 0, "broken": 0, "net_fixed": 0}  # fmt: skip
    claim = {"gate_margin": None, "prior_weight": 0.0, "min_prob": 0.0}
    by_cost = {r["setting"]["switch_cost"]: r for r in rows[1:]
               if {k: r["setting"][k] for k in claim} == claim}  # fmt: skip
    assert (by_cost[0.0]["fixed"], by_cost[0.0]["broken"]) == (1, 1)
    assert (by_cost[0.2]["fixed"], by_cost[0.2]["broken"]) == (1, 0)
    assert by_cost[0.0]["miou"] == pytest.approx(100 / 3) and by_cost[0.2]["miou"] == 100.0


def test_the_fit_choice_is_made_on_the_first_split_and_read_on_the_others() -> None:
    probe = load_benchmark("decision_probe")
    # pixel 0: base wrong, fixed by any relabel; pixel 1: base right, its other label nearer by
    # 0.3, broken below a switch cost of 0.3; "other": the same labels, pixel 0 right there
    near = [[1.0, 0.0], [0.3, 0.0], [0.0, 1.0]]
    choice, other = cache_of([0, 1, 1], [1, 1, 1], near), cache_of([0, 1, 1], [0, 1, 1], near)
    splits = {
        "choice": probe.sweep(choice, [0.0, 0.4], 2),
        "other": probe.sweep(other, [0.0, 0.4], 2),
    }
    # only δ 0.4 pays, and the fit offers no such switch cost: every rule never relabels
    choices = probe.fit_choices(splits)
    assert [(c["metric"], c["max_broken_ratio"]) for c in choices] == list(probe.RULES)
    for c in choices:
        assert c["setting"]["gate_margin"] == 0.0
        assert c["splits"]["other"] == {"miou_gain": 0.0, "fixed": 0, "broken": 0}
    # nearer by 0.1 only: δ 0.2 (a fit's) pays on the choice split; on the other it breaks
    near[1] = [0.1, 0.0]
    choice, other = cache_of([0, 1, 1], [1, 1, 1], near), cache_of([0, 1, 1], [0, 1, 1], near)
    splits = {
        "choice": probe.sweep(choice, [0.0, 0.2], 2),
        "other": probe.sweep(other, [0.0, 0.2], 2),
    }
    for c in probe.fit_choices(splits):
        assert c["setting"]["switch_cost"] == 0.2
        assert c["splits"]["choice"] == {"miou_gain": 66.67, "fixed": 1, "broken": 0}
        assert c["splits"]["other"] == {"miou_gain": -66.67, "fixed": 0, "broken": 1}


def test_each_rule_makes_its_own_choice() -> None:
    probe = load_benchmark("decision_probe")

    def pixels(d: float, fixed: int, broken: int) -> list[tuple[int, int, list[float]]]:
        """(base label, truth, distances): the other label nearer by d; fixed ones are
        wrong at base (class 0), broken ones right (class 1)."""
        return [(0, 1, [d, 0.0])] * fixed + [(1, 1, [d, 0.0])] * broken

    # d = 1: relabelled at every switch cost; 0.15: below 0.2; 0.05: at 0 only; then pixels
    # the base keeps (its label nearer)
    band = (pixels(1.0, 2, 0) + pixels(0.15, 3, 2) + pixels(0.05, 4, 3)
            + [(0, 0, [-1.0, 0.0])] * 10 + [(1, 1, [-1.0, 0.0])] * 10)  # fmt: skip
    pred, gt, dist = (list(x) for x in zip(*band, strict=True))
    rows = probe.sweep(cache_of(pred, gt, dist), [0.0, 0.1, 0.2], 2)
    chosen = {(c["metric"], c["max_broken_ratio"]): c for c in probe.fit_choices({"a": rows})}
    # by mIoU every relabel (9 fixed, 5 broken); within 0.5: 5 fixed, 2 broken; by net_fixed
    # only those that fix without breaking
    reads = {k: (c["setting"]["switch_cost"], c["splits"]["a"]["fixed"], c["splits"]["a"]["broken"])
             for k, c in chosen.items()}  # fmt: skip
    assert reads == {("miou", None): (0.0, 9, 5), ("miou", 0.5): (0.1, 5, 2),
                     ("net_fixed", None): (0.2, 2, 0)}  # fmt: skip


def test_deltas_without_the_fits_switch_costs_are_one_line(tmp_path, monkeypatch, capsys) -> None:
    argv = ["--base", str(tmp_path / "b.pt"), "--refiner", str(tmp_path / "r.pt"),
            "--split", "val.txt", "--out", str(tmp_path / "o.json"),
            "--deltas", "0.05", "0.4"]  # fmt: skip
    assert run_script("decision_probe", argv, monkeypatch) == 2
    err = capsys.readouterr().err
    assert (
        err == "error: --deltas lacks refine fit's switch costs [0.0, 0.1, 0.2]: add them, "
        "for the fit's choice (fit_choices)\n"
    )


def test_a_missing_checkpoint_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    argv = ["--base", str(tmp_path / "b.pt"), "--refiner", str(tmp_path / "r.pt"),
            "--split", "val.txt", "--out", str(tmp_path / "o.json")]  # fmt: skip
    assert run_script("decision_probe", argv, monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1
