"""Samplers (resumable order, unpadded eval shards, per-sample seeds) and a 2-process gloo run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from dualseg.engine.distributed import ResumableSampler, SeededSamples
from dualseg.errors import CheckpointError

REPO = Path(__file__).resolve().parents[2]


class RandomItems(Dataset):
    """Each item draws from the global torch RNG, like a random augmentation."""

    def __init__(self, n: int = 10) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(2) + i


def test_resumable_sampler_continues_the_same_order() -> None:
    ds = RandomItems()
    full = ResumableSampler(ds, seed=3)
    full.set_epoch(2)
    order = list(full)
    assert sorted(i for i, _ in order) == list(range(10)) and {e for _, e in order} == {2}
    resumed = ResumableSampler(ds, seed=3)
    resumed.load_state_dict({"epoch": 2, "offset": 4, "world_size": 1})
    assert list(resumed) == order[4:] and len(resumed) == 6
    assert resumed.state_dict() == {"epoch": 2, "offset": 4, "world_size": 1}
    other = ResumableSampler(ds, seed=3)
    other.set_epoch(3)
    assert list(other) != order  # a new permutation each epoch


def test_resumable_sampler_shards_across_ranks() -> None:
    ds = RandomItems()
    shards = [ResumableSampler(ds, num_replicas=2, rank=r, seed=0) for r in range(2)]
    seen = [i for s in shards for i, _ in s]
    assert sorted(seen) == list(range(10))


def test_a_resume_on_another_number_of_processes_is_refused_naming_both() -> None:
    old = ResumableSampler(RandomItems(), num_replicas=2, rank=0, seed=4)
    new = ResumableSampler(RandomItems(), seed=4)
    with pytest.raises(CheckpointError, match=r"by 2 process\(es\), this run has 1; resume with 2"):
        new.load_state_dict(old.state_dict(offset=2))


def test_seeded_samples_depend_on_the_sample_only() -> None:
    ds = SeededSamples(RandomItems(), seed=1)
    a = ds[(4, 0)]
    torch.rand(100)  # whatever ran before does not matter...
    state = torch.get_rng_state()
    assert torch.equal(ds[(4, 0)], a)
    assert torch.equal(torch.get_rng_state(), state)  # ...and the caller's RNG is untouched
    assert not torch.equal(ds[(4, 1)], a)  # another epoch, another augmentation
    # Same stream with worker processes as in the main process.
    sampler = ResumableSampler(RandomItems(), seed=5)
    main = torch.cat(list(DataLoader(ds, batch_size=2, sampler=sampler)))
    workers = torch.cat(list(DataLoader(ds, batch_size=2, sampler=sampler, num_workers=2)))
    assert torch.equal(main, workers)


@pytest.mark.slow
def test_two_gloo_processes_train_and_evaluate_like_one(tmp_path: Path) -> None:
    """torchrun, 2 CPU processes: the run completes, rank 0 alone writes one set of files, and
    the reduced validation metrics equal a single-process evaluation of the same weights."""
    from dualseg.data import build_dataset, make_synthetic_dataset
    from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint
    from dualseg.engine.evaluation import evaluate

    data = make_synthetic_dataset(tmp_path / "data", n_train=4, n_val=5, size=(40, 48), seed=1)
    out = tmp_path / "run"
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"),
        *("-m", "dualseg", "train"),
        *("--config", str(REPO / "configs" / "tiny_synthetic.yaml")),
        *("--data.root", str(data), "--train.out_dir", str(out)),
        *("--data.crop_size", "[32,32]", "--data.batch_size", "1", "--data.val_batch_size", "1"),
        *("--train.max_iters", "2", "--train.val_every", "2"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".pt") == ["best.pt", "last.pt"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no stray temp files
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_miou" in r]
    assert len(val) == 1 and val[0]["iteration"] == 2  # logged once, by rank 0

    ckpt = load_checkpoint(out / "last.pt")
    assert ckpt["iteration"] == 2
    model, meta = build_model_from_checkpoint(ckpt)
    ds = build_dataset(data, split="val")
    single = evaluate(model, DataLoader(ds, batch_size=1), num_classes=meta.num_classes)
    assert single["num_images"] == 5
    assert _same(val[0]["val_iou"], single["iou"])  # exact: same integer counts
    for key in ("miou", "pixel_acc", "mean_acc", "fwiou", "boundary_f1", "trimap_miou"):
        assert _same(val[0][f"val_{key}"], single[key]), key


def _same(a: float | list[float], b: float | list[float]) -> bool:
    """Exact equality, NaN equal to NaN (classes absent from the split)."""
    a_list, b_list = (a, b) if isinstance(a, list) else ([a], [b])
    return len(a_list) == len(b_list) and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a_list, b_list)
    )


def test_sample_seed_is_keyword_only_and_fits_every_generator() -> None:
    import random

    import numpy as np

    from dualseg.data.transforms import sample_seed

    with pytest.raises(TypeError):
        sample_seed(0, 1, 2)  # type: ignore[misc]
    seeds = {sample_seed(2**40, index=i, epoch=e) for i in range(50) for e in range(3)}
    assert len(seeds) == 150 and all(0 <= s < 2**31 for s in seeds)
    assert sample_seed(1, index=2, epoch=3) != sample_seed(1, index=3, epoch=2)
    s = max(seeds)
    random.seed(s), np.random.seed(s), torch.manual_seed(s)


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "cuda:-1", "", "meta", "xla", "hpu"])
def test_resolve_device_refuses_an_unknown_device_in_one_line(name: str) -> None:
    from dualseg.engine.distributed import resolve_device
    from dualseg.errors import ConfigError

    # meta, xla, hpu: devices torch names, which dualseg does not run on (a traceback before)
    with pytest.raises(ConfigError, match=r"use auto, cpu, cuda or cuda:N") as info:
        resolve_device(name)
    assert repr(name) in str(info.value) and "\n" not in str(info.value)


def test_resolve_device_accepts_cpu_and_auto() -> None:
    from dualseg.engine.distributed import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="no-GPU refusal")
def test_resolve_device_cuda_without_a_gpu_says_use_the_cpu() -> None:
    from dualseg.engine.distributed import resolve_device
    from dualseg.errors import ConfigError

    with pytest.raises(ConfigError, match="no GPU is visible"):
        resolve_device("cuda:0")
