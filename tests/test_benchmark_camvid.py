"""benchmarks/camvid.py: a run reused with ``--reuse`` must have been trained with this call's
flags, else its figures would be reported under the wrong recipe."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import dualseg
from benchmark_helpers import load_benchmark
from dualseg.engine.config import save_config
from dualseg.engine.options import OptimConfig

protocols = load_benchmark("camvid_protocols")  # the run checks and carves beside the script


def config(camvid, tmp_path: Path, *flags: str, protocol: str = "plateau"):
    args = camvid.parse_args(
        ["--data", str(tmp_path / "camvid"), "--out", str(tmp_path), "--protocol", protocol, *flags]
    )
    return camvid.base_config(args, "peer", tmp_path)


def test_reuse_refuses_a_run_trained_with_other_flags(camvid, tmp_path: Path) -> None:
    run = tmp_path / "runs" / "peer"
    run.mkdir(parents=True)
    save_config(
        config(camvid, tmp_path, "--head-lr-mult", "1", "--max-iters", "300"), run / "config.yaml"
    )
    same = config(camvid, tmp_path, "--head-lr-mult", "1", "--max-iters", "300")
    assert camvid.reuse_mismatch(same, run) is None
    other = config(camvid, tmp_path, "--head-lr-mult", "10", "--max-iters", "300")
    message = camvid.reuse_mismatch(other, run)
    assert "optim.head_lr_mult = 1.0" in message and "asks 10.0" in message
    longer = config(camvid, tmp_path, "--head-lr-mult", "1", "--max-iters", "600")
    assert "train.max_iters = 300" in camvid.reuse_mismatch(longer, run)
    # the equal-time protocol calibrates max_iters per model: not compared there
    assert camvid.reuse_mismatch(longer, run, calibrated_iters=True) is None


def test_a_folder_without_the_list_files_is_one_data_error(camvid, tmp_path: Path) -> None:
    from dualseg.errors import DataError

    (tmp_path / "camvid").mkdir()
    (tmp_path / "camvid" / "train.txt").write_text("a.png b.png\n")
    with pytest.raises(DataError, match=r"no val\.txt there"):
        camvid.main(["--data", str(tmp_path / "camvid"), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()  # nothing written before the check


def test_an_interrupted_budget_run_is_not_recorded_as_finished(
    camvid, tmp_path: Path, monkeypatch
) -> None:
    """Ctrl-C inside fit ends it early with stop_reason "interrupted": no train.json then, or a
    later --reuse would take the partial run as one trained to its budget."""
    data = tmp_path / "camvid"
    data.mkdir()
    for split in ("train", "val"):
        (data / f"{split}.txt").write_text("a.png b.png\n")
    monkeypatch.setattr(
        camvid, "fit", lambda cfg, **kw: {"stop_reason": "interrupted", "iteration": 3}
    )
    argv = ["--data", str(data), "--out", str(tmp_path / "out"), "--models", "peer",
            "--protocol", "budget", "--budget-iters", "8", "--train-only"]  # fmt: skip
    assert camvid.main(argv) == 130
    assert not (tmp_path / "out" / "runs" / "peer" / "train.json").exists()


def test_training_time_adds_the_pieces_of_a_resumed_run(camvid, tmp_path: Path) -> None:
    """Each process's clock starts at 0: a ``resumed_from`` record (or, in older logs, the clock
    going back) starts a new piece; the last validation's own time counts."""
    import json

    records = [
        {"iteration": 1, "loss": 1.0, "time": 1.0},
        {"iteration": 20, "loss": 1.0, "time": 10.0},
        {"iteration": 20, "val_miou": 0.1, "time": 12.0},
        {"iteration": 20, "resumed_from": "last.pt"},
        {"iteration": 40, "loss": 1.0, "time": 13.0},  # later than 12 s: only the mark tells
        {"iteration": 40, "val_miou": 0.2, "time": 15.0},
        {"iteration": 60, "loss": 1.0, "time": 3.0},  # an old log's resume: the clock went back
        {"iteration": 60, "val_miou": 0.3, "time": 6.0},
    ]
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    stats = camvid.curve_stats(log)
    assert stats["train_seconds"] == 12.0 + 15.0 + 6.0
    assert stats["dev_curve"] == [[20, 0.2, 0.1], [40, 0.45, 0.2], [60, 0.55, 0.3]]


def test_the_total_counts_the_earlier_calls_of_a_resumed_run(camvid) -> None:
    resumed = {"train_seconds": 5400.0, "seconds_this_call": 3600.5}  # 30 min before this call
    assert camvid.earlier_calls_seconds(resumed) == pytest.approx(1799.5)
    # one uninterrupted call: its clock (setup included) already holds all of it
    assert camvid.earlier_calls_seconds({"train_seconds": 60.0, "seconds_this_call": 61.0}) == 0


def test_a_folder_trained_on_another_dev_carve_is_refused(camvid, tmp_path: Path) -> None:
    from dualseg.errors import ConfigError

    data = tmp_path / "camvid"
    data.mkdir()
    frames = [f"images/0001TP_{i:04d}.png labels/0001TP_{i:04d}.png" for i in range(16)]
    (data / "train.txt").write_text("\n".join(frames) + "\n")
    (data / "val.txt").write_text("images/0016E5_0001.png labels/0016E5_0001.png\n")
    out = tmp_path / "out"
    root = camvid.carve_dev_split(data, out, 0.125)
    assert len((root / "dev.txt").read_text().split("\n")) - 1 == 2
    camvid.carve_dev_split(data, out, 0.25)  # nothing trained on the first carve yet: redone
    assert len((root / "dev.txt").read_text().split("\n")) - 1 == 4
    (out / "runs" / "peer").mkdir(parents=True)
    (out / "runs" / "peer" / "config.yaml").write_text("{}\n")
    camvid.carve_dev_split(data, out, 0.25)  # the same carve: fine
    refused = r"train_fit\.txt differs .*--dev-fraction 0\.5.*runs/peer was trained on it"
    with pytest.raises(ConfigError, match=refused):
        camvid.carve_dev_split(data, out, 0.5)
    assert len((root / "dev.txt").read_text().split("\n")) - 1 == 4  # left as it was


def test_a_reused_run_keeps_its_stopping_rule_and_says_what_was_evaluated(
    camvid, tmp_path: Path
) -> None:
    run = tmp_path / "runs" / "peer"
    run.mkdir(parents=True)
    save_config(config(camvid, tmp_path, "--patience", "0"), run / "config.yaml")
    assert camvid.evaluated_checkpoint(run) == "last.pt"  # the end of its schedule
    other = config(camvid, tmp_path, "--patience", "3")
    assert camvid.reuse_mismatch(other, run) is None  # resuming may go on under another rule
    message = camvid.reuse_mismatch(other, run, finished=True)
    assert "train.patience = None" in message and "asks 3" in message
    save_config(other, run / "config.yaml")
    assert camvid.evaluated_checkpoint(run) == "best.pt"  # the best on dev


def _camvid_lists(tmp_path: Path) -> Path:
    data = tmp_path / "camvid"
    data.mkdir()
    for split in ("train", "val"):
        (data / f"{split}.txt").write_text("a.png b.png\n")
    return data


def _finished_run(run: Path, record: dict, *, at: int) -> Path:
    """A run folder whose last.pt is at iteration ``at`` and whose train.json says ``record``."""
    import json

    from dualseg.engine.checkpoint import save_checkpoint

    run.mkdir(parents=True, exist_ok=True)
    save_checkpoint(
        run / "last.pt", {"arch": "x", "model_kwargs": {}, "model": {}, "iteration": at}
    )
    (run / "train.json").write_text(json.dumps({"seconds": 1.0, **record}))
    return run / "train.json"


def test_a_record_the_run_went_on_past_is_not_reused(camvid, tmp_path: Path, monkeypatch) -> None:
    """train.json written when a run stopped on patience at 40, then the run resumed under
    --patience 0 and stopped short at 121: --reuse must not report 40 / patience for it."""
    data, out = _camvid_lists(tmp_path), tmp_path / "out"
    flags = ["--data", str(data), "--out", str(out), "--models", "peer", "--patience", "0",
             "--protocol", "plateau", "--train-only"]  # fmt: skip
    record = _finished_run(
        out / "runs" / "peer", {"iterations": 40, "stop_reason": "patience"}, at=121
    )
    save_config(
        camvid.base_config(camvid.parse_args(flags), "peer", out), record.parent / "config.yaml"
    )
    calls = []

    def fit(cfg, **kw):
        calls.append((kw, record.exists()))
        return {"stop_reason": "interrupted", "iteration": 130, "signal": 15}

    monkeypatch.setattr(camvid, "fit", fit)
    assert camvid.main([*flags, "--reuse"]) in (130, 143)
    assert calls == [({"resume": "auto"}, False)]  # resumed, the stale record gone first


def test_a_retrain_removes_the_record_of_the_run_it_replaces(
    camvid, tmp_path: Path, monkeypatch
) -> None:
    data, out = _camvid_lists(tmp_path), tmp_path / "out"
    record = _finished_run(
        out / "runs" / "peer", {"iterations": 4, "calibrated_s_per_iter": None}, at=4
    )
    seen = []
    monkeypatch.setattr(
        camvid,
        "fit",
        lambda cfg, **kw: seen.append(record.exists()) or {"stop_reason": "interrupted",
                                                          "iteration": 3},
    )  # fmt: skip
    argv = ["--data", str(data), "--out", str(out), "--models", "peer", "--protocol", "budget",
            "--budget-iters", "400", "--train-only"]  # fmt: skip
    assert camvid.main(argv) == 130
    assert seen == [False] and not record.exists()  # a later --reuse finds no finished run


def test_a_budget_run_is_reused_only_for_its_own_budget(
    camvid, tmp_path: Path, monkeypatch
) -> None:
    from dualseg.errors import ConfigError

    data, out = _camvid_lists(tmp_path), tmp_path / "out"
    _finished_run(out / "runs" / "peer", {"iterations": 4, "calibrated_s_per_iter": None}, at=4)
    monkeypatch.setattr(camvid, "fit", lambda cfg, **kw: pytest.fail("trained"))
    argv = ["--data", str(data), "--out", str(out), "--models", "peer", "--protocol", "budget",
            "--train-only", "--reuse"]  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"trained for 4 iterations, this call asks --budget-iters 40"
    ):
        camvid.main([*argv, "--budget-iters", "40"])
    with pytest.raises(ConfigError, match=r"this call asks --budget-minutes 15"):
        camvid.main(argv)
    assert camvid.main([*argv, "--budget-iters", "4"]) == 0
    _finished_run(
        out / "runs" / "peer",
        {"iterations": 90, "calibrated_s_per_iter": 0.5, "budget_minutes": 0.75},
        at=90,
    )
    with pytest.raises(
        ConfigError, match=r"trained for 0.75 minutes, this call asks --budget-minutes 1"
    ):
        camvid.main([*argv, "--budget-minutes", "1"])
    assert camvid.main([*argv, "--budget-minutes", "0.75"]) == 0


def test_an_interrupted_method_b_fit_is_one_line_and_the_signal_s_status(
    camvid, tmp_path: Path, monkeypatch, capsys
) -> None:
    from dualseg.errors import Terminated

    data, out = _camvid_lists(tmp_path), tmp_path / "out"
    monkeypatch.setattr(
        camvid, "fit", lambda cfg, **kw: {"stop_reason": "max_iters", "iteration": 4}
    )
    monkeypatch.setattr(camvid, "evaluated_checkpoint", lambda run: "last.pt")
    monkeypatch.setattr(camvid, "load_checkpoint", lambda path: {"iteration": 4})
    monkeypatch.setattr(
        camvid,
        "build_model_from_checkpoint",
        lambda ckpt, device: (camvid.torch.nn.Identity(), None),
    )

    def fit_refiners(*args):
        raise Terminated

    monkeypatch.setattr(camvid, "fit_refiners", fit_refiners)
    argv = ["--data", str(data), "--out", str(out), "--models", "peer", "--protocol", "budget",
            "--budget-iters", "4"]  # fmt: skip
    assert camvid.main(argv) == 143  # 128 + SIGTERM, as dualseg train
    assert capsys.readouterr().out.splitlines()[-1] == (
        "[method B] interrupted; rerun with --reuse to continue its fit"
    )


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--timing-images", "0"], "argument --timing-images: must be >= 1, got 0"),
        (["--eval-limit", "0"], "argument --eval-limit: must be >= 1, got 0"),
        (["--panels", "-1"], "argument --panels: must be >= 0, got -1"),
        (["--threads", "-2"], "argument --threads: must be >= 0, got -2"),
        (["--dev-fraction", "0"], "argument --dev-fraction: must be between 0 and 1"),
        (["--dev-fraction", "-0.1"], "argument --dev-fraction: must be between 0 and 1"),
        (["--budget-minutes", "nan"], "argument --budget-minutes: expected a finite number"),
    ],
)
def test_a_bad_flag_is_refused_when_parsed(camvid, flags, said, capsys) -> None:
    """Each once ran the whole benchmark into a StatisticsError, a crash, or a silent wrong
    split (a --dev-fraction 0 still held one frame of each sequence out)."""
    with pytest.raises(SystemExit) as stop:
        camvid.parse_args(["--data", "d", *flags])
    assert stop.value.code == 2
    assert said in capsys.readouterr().err


def test_flags_that_cannot_work_together_are_one_error_before_any_work(
    camvid, tmp_path: Path
) -> None:
    from dualseg.errors import ConfigError, OutputError

    data = _camvid_lists(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match=r"--out .*file is an existing file, not a folder"):
        camvid.main(["--data", str(data), "--out", str(tmp_path / "file")])
    out = tmp_path / "out"
    plateau = ["--data", str(data), "--out", str(out), "--protocol", "plateau", "--val-every", "0"]
    with pytest.raises(ConfigError, match=r"--val-every 0 never validates on dev, so --patience 3"):
        camvid.main(plateau)
    assert not out.exists()
    camvid.check_args(camvid.parse_args([*plateau, "--patience", "0"]))  # no early stop: fine


@pytest.mark.parametrize(("amp", "enabled"), [("bf16", True), ("none", False)])
def test_the_budget_calibration_times_the_precision_the_run_trains_in(
    camvid, tmp_path: Path, monkeypatch, amp: str, enabled: bool
) -> None:
    """An fp32 calibration of a bf16 run set its T from a step of another cost."""
    import contextlib

    import torch

    seen = []

    def autocast(device_type, dtype=None, enabled=True):
        seen.append((device_type, dtype, enabled))
        return contextlib.nullcontext()

    monkeypatch.setattr(torch, "autocast", autocast)
    cfg = config(camvid, tmp_path, "--amp", amp, "--crop", "32", "32", "--batch-size", "2",
                 "--weights", "none", protocol="budget")  # fmt: skip
    assert cfg.train.amp == amp
    camvid.calibrate_iters(cfg, 1.0, torch.device("cpu"))
    on = [s for s in seen if s[2]]  # (the bf16 run's fp32 convolutions turn it off inside)
    assert on == ([("cpu", torch.bfloat16, True)] * 6 if enabled else [])  # each timed step


def test_the_budget_protocol_trains_with_the_recipe_flags(camvid, tmp_path: Path) -> None:
    """--output-stride, --amp, --head-lr-mult, --warmup-iters and --clip-grad-norm were read by
    the plateau protocol only: a budget run trained without them under their names."""
    flags = ["--output-stride", "16", "--amp", "none", "--head-lr-mult", "10",
             "--warmup-iters", "5", "--clip-grad-norm", "1"]  # fmt: skip
    cfg = config(camvid, tmp_path, *flags, protocol="budget")
    assert cfg.model.output_stride == 16 and cfg.train.amp == "none"
    assert (cfg.optim.head_lr_mult, cfg.optim.warmup_iters, cfg.optim.clip_grad_norm) == (10, 5, 1)
    # the defaults stay each protocol's own: bf16 where native (budget), fp32 (plateau)
    assert config(camvid, tmp_path, protocol="budget").train.amp == "auto"
    assert config(camvid, tmp_path).train.amp == "none"
    assert config(camvid, tmp_path, protocol="budget").optim == OptimConfig()


def test_models_evaluated_one_per_call_into_one_out_keep_each_others_rows(
    camvid, tmp_path: Path
) -> None:
    """`--models peer`, then `--models single_branch` into the same --out left results.json
    and results.md holding single_branch alone."""
    import json

    from dualseg.errors import ConfigError

    def args(*flags: str):
        return camvid.parse_args(["--data", "d", "--out", str(tmp_path), "--reuse", *flags])

    peer_call = {
        "args": camvid.args_record(args("--models", "peer")),
        "splits": {"val": {"peer": {"miou": 0.5}, "peer+B": {"miou": 0.6}}},
        "train": {"peer": {"iterations": 4}, "method_b_all": {"steps": 10}},
        "decision_sweep_dev": {"peer": {"chosen": {}}},
    }
    (tmp_path / "results.json").write_text(json.dumps(peer_call))
    assert (
        camvid.earlier_results(tmp_path, args("--models", "peer", "dualseg")) is None
    )  # all again
    second = args("--models", "single_branch")
    old = camvid.earlier_results(tmp_path, second)
    results = {"splits": {"val": {"single_branch": {"miou": 0.4}}}, "train": {"single_branch": {}}}
    assert camvid.merge_results(results, old, second.models) == ["peer"]
    assert list(results["splits"]["val"]) == ["peer", "peer+B", "single_branch"]
    assert results["splits"]["val"]["peer+B"] == {"miou": 0.6}  # the model's own entries
    assert results["train"] == {"single_branch": {}, "peer": {"iterations": 4},
                                "method_b_all": {"steps": 10}}  # fmt: skip
    assert results["decision_sweep_dev"] == {"peer": {"chosen": {}}}
    # rows evaluated under other flags would share one table: refused before any work
    with pytest.raises(ConfigError, match=r"holds peer evaluated with --eval-limit None, this"):
        camvid.earlier_results(tmp_path, args("--models", "single_branch", "--eval-limit", "3"))


def test_a_holdout_sequence_needs_the_plateau_protocol(camvid, tmp_path: Path) -> None:
    from dualseg.errors import ConfigError

    data = _camvid_lists(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="add --protocol plateau"):
        camvid.main(["--data", str(data), "--out", str(out), "--holdout-sequence", "0001TP"])
    assert not out.exists()


def test_the_table_counts_the_pixels_refinement_fixed_and_broke(camvid, tmp_path: Path) -> None:
    row = {"miou": 0.5, "boundary_f1": 0.3, "trimap_miou": 0.4, "pixel_acc": 0.9}
    results = {
        "budget": "b",
        "splits": {"cross_scene_0001TP": {
            "peer": {"label": "peer", **row, "ms_per_image": 20.0},
            "peer+B": {"label": "peer + B", **row, "refine": {"fixed": 120, "broke": 45}},
        }},
    }  # fmt: skip
    text = camvid.write_table(results, tmp_path / "results.md")
    assert "**CamVid cross_scene_0001TP**" in text and "pixels fixed / broken" in text
    assert "| peer + B | 50.0 | 30.0 | 40.0 | 90.0 |  | 120 / 45 |" in text
    assert "| peer | 50.0 | 30.0 | 40.0 | 90.0 | 20 |  |" in text


def test_crf_without_pydensecrf2_is_one_line_before_any_work(
    camvid, tmp_path: Path, monkeypatch
) -> None:
    import sys

    from dualseg.errors import DualsegError

    monkeypatch.setitem(sys.modules, "pydensecrf", None)
    monkeypatch.setitem(sys.modules, "pydensecrf.densecrf", None)
    out = tmp_path / "out"
    argv = ["--data", str(_camvid_lists(tmp_path)), "--out", str(out), "--crf"]
    with pytest.raises(DualsegError, match=r"pip install 'dualseg\[crf\]'"):
        camvid.main(argv)
    assert not out.exists()


def _git(where: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True)


def test_the_results_record_the_commit_of_the_code_that_made_them(
    tmp_path: Path, monkeypatch
) -> None:
    where = Path(dualseg.__file__).resolve().parent
    head, got = _git(where, "rev-parse", "HEAD"), protocols.source_commit()
    if head.returncode != 0:  # an installed copy: nothing to tie the results to
        assert got is None
    else:
        dirty = bool(_git(where, "status", "--porcelain", "--untracked-files=no").stdout.strip())
        assert got == head.stdout.strip() + ("+dirty" if dirty else "")
    # outside any checkout, or untracked inside another one: None, not an error
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.delenv("GIT_DIR", raising=False)
    repo = tmp_path / "repo"
    (repo / "dualseg").mkdir(parents=True)
    (repo / "dualseg" / "__init__.py").write_text("")
    monkeypatch.setattr(dualseg, "__file__", str(repo / "dualseg" / "__init__.py"))
    assert protocols.source_commit() is None
    _git(repo, "init", "-q")
    assert protocols.source_commit() is None
    # tracked and committed there: that commit, clean
    _git(repo, "add", "dualseg/__init__.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    assert protocols.source_commit() == _git(repo, "rev-parse", "HEAD").stdout.strip()
