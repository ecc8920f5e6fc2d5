"""benchmarks/retime_refine.py: a finished run's method B timed again, its chosen decision
beside the same without blocked switches, the scores left alone."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from benchmark_helpers import load_benchmark
from checkpoint_helpers import write_peer_checkpoint
from dualseg.errors import DualsegError
from dualseg.refine import BoundaryRefiner, RefinerConfig
from dualseg.refine.embedding import build_embedding_net

CAMVID_CLASSES = ("sky", "building", "pole", "road", "pavement", "tree", "sign_symbol", "fence",
                  "car", "pedestrian", "bicyclist")  # fmt: skip


@pytest.fixture(scope="module")
def retime_refine():
    return load_benchmark("retime_refine")


def _run_folder(root: Path) -> Path:
    """A camvid.py run folder in miniature: a peer, a refiner, the decision chosen for it."""
    write_peer_checkpoint(root / "runs" / "peer" / "last.pt", CAMVID_CLASSES)
    cfg = RefinerConfig(embed_dim=8, output_stride=16, aspp_rates=(2, 3), top_n=3, radius=3)
    net = build_embedding_net(cfg.backbone, embed_dim=8, output_stride=16, aspp_rates=(2, 3))
    k = len(CAMVID_CLASSES)
    refiner = BoundaryRefiner(net, torch.randn(k, 8), torch.ones(k, dtype=torch.bool),
                              class_names=CAMVID_CLASSES, config=cfg)  # fmt: skip
    refiner.save(root / "refiner_peer.pt")
    chosen = {"gate_margin": 0.75, "prior_weight": 0.0, "min_prob": 0.05, "switch_cost": 0.1,
              "blocked_switches": [[1, 3], [3, 4]], "p1_blur_sigma": 0.0}  # fmt: skip
    results = {"train": {"peer": {"evaluated": {"checkpoint": "last.pt"}}},
               "decision_sweep_dev": {"peer": {"chosen": chosen}}}  # fmt: skip
    (root / "results.json").write_text(json.dumps(results))
    return root


def test_a_run_is_timed_with_and_without_its_blocks_and_its_scores_kept(
    retime_refine, camvid_root, tmp_path
) -> None:
    run = _run_folder(tmp_path / "run")
    before = (run / "results.json").read_text()
    argv = [str(run), "--data", str(camvid_root), "--images", "1", "--repeats", "2"]
    assert retime_refine.main(argv) == 0
    record = json.loads((run / "retime.json").read_text())
    timed = record["models"]["peer"]
    assert set(timed) == {"chosen", "unblocked"}
    for v in timed.values():
        assert len(v["ratios"]) == 2 and all(r > 0 for r in v["ratios"])
        assert v["median"] == statistics.median(v["ratios"])
        assert all(b > 0 for b in v["base_ms"]) and all(e > 0 for e in v["extra_ms"])
    assert (run / "results.json").read_text() == before
    kept = (run / "retime.json").read_text()
    assert retime_refine.main(argv) == 2  # an earlier timing is not replaced without a word
    assert (run / "retime.json").read_text() == kept
    assert retime_refine.main([*argv, "--repeats", "1", "--overwrite"]) == 0
    assert (
        len(json.loads((run / "retime.json").read_text())["models"]["peer"]["chosen"]["ratios"])
        == 1
    )


def test_a_folder_without_results_is_one_line(retime_refine, tmp_path, capsys) -> None:
    assert retime_refine.main([str(tmp_path), "--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err  # as camvid.py's errors: on stderr
    assert "results.json not found; pass a finished benchmarks/camvid.py" in err
    (tmp_path / "results.json").write_text(json.dumps({"splits": {}}))  # a --refine-steps 0 run
    assert retime_refine.main([str(tmp_path), "--data", str(tmp_path)]) == 2
    assert "holds no chosen decision; run camvid.py with --refine-steps" in capsys.readouterr().err


def test_an_existing_record_is_refused_before_the_timing(retime_refine, tmp_path, capsys) -> None:
    run = _run_folder(tmp_path / "run")
    (run / "mine.json").write_text("{}")
    argv = [str(run), "--data", str(tmp_path / "absent"), "--out", str(run / "mine.json")]
    assert retime_refine.main(argv) == 2  # no data read: refused first
    assert "mine.json exists; pass --overwrite to replace it" in capsys.readouterr().err
    assert (run / "mine.json").read_text() == "{}"
    results = run / "results.json"  # the scores are never replaced, --overwrite or not
    kept = results.read_text()
    assert retime_refine.main([*argv[:3], "--out", str(results), "--overwrite"]) == 2
    assert "results.json holds the run's scores" in capsys.readouterr().err
    assert results.read_text() == kept
    with pytest.raises(DualsegError, match="is an existing folder"):  # before any timing
        retime_refine.main([*argv[:3], "--out", str(run), "--overwrite"])
