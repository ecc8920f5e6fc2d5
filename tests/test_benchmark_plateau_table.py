"""benchmarks/plateau_table.py: the plateau test, the figures it reads from a results file, and
the training step it times being the engine's real step (else its cost column would be made up).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmark_helpers import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def pt():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))  # it imports `camvid` beside it
        yield load_benchmark("plateau_table")


def test_plateau_is_the_issues_test(pt) -> None:
    def curve(mious: list[float]) -> list[list[float]]:
        return [[150 * (i + 1), float(i), m] for i, m in enumerate(mious)]

    assert pt.plateaued(curve([0.40, 0.50, 0.52, 0.516, 0.518]))  # within 0.5 of the best
    assert pt.plateaued(curve([0.40, 0.52, 0.50, 0.50, 0.516]))  # the last three hold 0.516
    assert not pt.plateaued(curve([0.40, 0.52, 0.50, 0.50, 0.51]))  # 1 point below the best
    assert not pt.plateaued(curve([0.40, 0.45]))  # too short to tell


def test_accuracy_reads_the_end_of_the_schedule(pt, tmp_path: Path, monkeypatch) -> None:
    dev = [[150, 1.0, 0.30], [300, 2.0, 0.42], [450, 3.0, 0.41], [600, 4.0, 0.418]]
    result = {
        "args": {"amp": "bf16", "output_stride": 16, "threads": 1, "seed": 0},
        "train": {
            "peer": {
                "iterations": 600,
                "evaluated": {"checkpoint": "last.pt", "iteration": 600},
                "dev_curve": dev,
                "best_dev_miou": 0.42,
                "train_seconds": 120.0,
            }
        },
        "splits": {
            "val": {
                "peer": {
                    "miou": 0.5,
                    "boundary_f1": 0.3,
                    "trimap_miou": 0.4,
                    "pixel_acc": 0.9,
                    "ms_per_image": 99.0,
                }
            }
        },
    }
    (tmp_path / "r.json").write_text(json.dumps(result))
    monkeypatch.setattr(pt, "RESULTS", tmp_path)
    a = pt.accuracy("peer", "r.json")
    assert a["dev_miou_last"] == 0.418 and a["dev_miou_best"] == 0.42 and a["plateaued"]
    assert a["val"] == {"miou": 0.5, "boundary_f1": 0.3, "trimap_miou": 0.4, "pixel_acc": 0.9}
    assert a["wall_minutes_logged"] == 2.0 and a["iterations"] == 600


@pytest.mark.parametrize("amp", ["none", "bf16"])
def test_the_timed_training_step_trains(pt, monkeypatch, amp: str) -> None:
    """One call is one SGD step of the engine on the protocol's recipe: the weights move, the
    LR schedule advances by one, and with bf16 the convolutions run under autocast."""
    from dualseg.engine.cpu_bf16 import cpu_has_native_bf16

    if amp == "bf16" and not cpu_has_native_bf16():
        pytest.skip("the timing uses bf16 only on CPUs with native bf16")
    amp_dtype = torch.bfloat16 if amp == "bf16" else None
    monkeypatch.setattr(pt, "CROP", (32, 48))
    monkeypatch.setattr(pt, "BATCH", 2)
    model = pt.variant("peer")
    monkeypatch.setattr(pt, "variant", lambda name: model)
    made = {}
    build = pt.build_scheduler
    monkeypatch.setattr(pt, "build_scheduler", lambda *a, **k: made.setdefault("s", build(*a, **k)))
    dtypes = set()
    conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.groups == 1)
    conv.register_forward_hook(lambda mod, args, out: dtypes.add(out.dtype))
    step = pt.training_step("peer", amp_dtype)
    before = [p.detach().clone() for p in model.parameters()]
    step()
    moved = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
    assert all(moved), "every parameter gets a gradient step"
    assert made["s"].last_epoch == 1 and model.training
    assert dtypes == {amp_dtype or torch.float32}


def test_table_ratios_are_against_the_peer(pt, monkeypatch) -> None:
    monkeypatch.setattr(pt, "ROWS", {"peer": ("peer", "p.json"), "dualseg": ("A", "a.json")})
    acc = {
        "iterations": 3000,
        "dev_miou_last": 0.5,
        "plateaued": True,
        "val": {"miou": 0.6, "boundary_f1": 0.4, "trimap_miou": 0.45, "pixel_acc": 0.9},
        "wall_minutes_logged": 30.0,
    }
    summary = {
        "accuracy": {"peer": acc, "dualseg": {**acc, "plateaued": False}},
        "timing": {
            "models": {
                "peer": {"ms_per_image": 100.0, "train_step_ms": 400.0},
                "dualseg": {"ms_per_image": 250.0, "train_step_ms": 1000.0},
            }
        },
    }
    lines = pt.table(summary).splitlines()
    figures = "60.0 | 40.0 | 45.0 | 50.0"
    assert f"| A | {figures} | no | 250 (2.50×) | 1000 ms (2.50×) | 50 | 30 |" in lines
    assert f"| peer | {figures} | yes | 100 (1.00×) | 400 ms (1.00×) | 20 | 30 |" in lines


def test_retraining_pairs_each_seed_of_a_with_the_same_seed_of_the_peer(
    pt, tmp_path: Path, monkeypatch
) -> None:
    def result(name: str, seed: int, miou: float) -> dict:
        return {
            "args": {"amp": "bf16", "output_stride": 16, "threads": 1, "seed": seed},
            "train": {
                name: {
                    "iterations": 3000,
                    "evaluated": {"checkpoint": "last.pt", "iteration": 3000},
                    "dev_curve": [[3000, 1.0, miou - 0.05]],
                    "best_dev_miou": miou - 0.05,
                    "train_seconds": 60.0,
                }
            },
            "splits": {
                "val": {
                    name: {
                        "miou": miou,
                        "boundary_f1": miou / 2,
                        "trimap_miou": miou - 0.1,
                        "pixel_acc": 0.9,
                    }
                }
            },
        }

    runs = {("peer", 0): 0.58, ("peer", 1): 0.60, ("dualseg", 0): 0.51, ("dualseg", 1): 0.54}
    for (name, seed), miou in runs.items():
        (tmp_path / f"{name}{seed}.json").write_text(json.dumps(result(name, seed, miou)))
    monkeypatch.setattr(pt, "RESULTS", tmp_path)
    monkeypatch.setattr(pt, "RETRAINED", {"peer": "peer1.json", "dualseg": "dualseg1.json"})
    accuracies = {n: pt.accuracy(n, f"{n}0.json") for n in ("peer", "dualseg")}
    spread = pt.retraining(accuracies)
    assert spread["models"]["peer"]["seeds"] == [0, 1]
    assert spread["models"]["dualseg"]["miou"] == [0.51, 0.54]
    assert spread["a_minus_peer"]["miou"] == pytest.approx([-0.07, -0.06])
    assert spread["a_minus_peer"]["boundary_f1"] == pytest.approx([-0.035, -0.03])
    text = pt.retraining_table(spread)
    assert "| method A − peer | -7.0 / -6.0 | -3.5 / -3.0 | -7.0 / -6.0 | -7.0 / -6.0 |" in text
    assert "| 58.0 / 60.0 |" in text
    # a retrained ablation is read against method A, each seed against the same seed's
    for seed, miou in ((0, 0.55), (1, 0.53)):
        (tmp_path / f"no_renet{seed}.json").write_text(json.dumps(result("no_renet", seed, miou)))
    monkeypatch.setitem(pt.RETRAINED, "no_renet", "no_renet1.json")
    accuracies["no_renet"] = pt.accuracy("no_renet", "no_renet0.json")
    spread = pt.retraining(accuracies)
    label = f"{pt.ROWS['no_renet'][0]} − method A"
    assert spread["differences"][label]["miou"] == pytest.approx([0.04, -0.01])
    assert next(iter(spread["differences"])) == "method A − peer"
    assert f"| {label} | +4.0 / -1.0 |" in pt.retraining_table(spread)


def test_no_timed_repetition_is_refused_when_parsed(pt, capsys) -> None:
    """--reps 0 timed every model's warm-up, then ended in a StatisticsError."""
    with pytest.raises(SystemExit) as stop:
        pt.main(["--time", "--reps", "0"])
    assert stop.value.code == 2
    assert "argument --reps: must be >= 1, got 0" in capsys.readouterr().err
