"""DDP (``torchrun``) helpers and the samplers that make a resume exact: the sampler's position
is saved, and each sample's augmentation is seeded by (seed, index, epoch)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from dualseg.data.transforms import sample_seed
from dualseg.errors import CheckpointError, ConfigError


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands: rank, world size, device."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Only rank 0 writes files, prints and shows progress bars."""
        return self.rank == 0


def resolve_device(
    name: str | torch.device | None = "auto", *, local_rank: int = 0
) -> torch.device:
    """``auto`` / ``None``: the local GPU if any, else CPU; ``cuda``: ``cuda:local_rank``."""
    if name is None or name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    fix = "use auto, cpu, cuda or cuda:N (--device, or --train.device for training)"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device {str(name)!r} is not a device; {fix}") from None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {str(name)!r} asked for but no GPU is visible; use --device cpu")
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device {str(name)!r}: only {torch.cuda.device_count()} GPU(s); {fix}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {str(name)!r}: this PyTorch has no MPS; use auto or cpu")
    if device.type not in ("cpu", "cuda", "mps"):  # meta, xla, xpu, ...: not run here
        raise ConfigError(f"device {str(name)!r} is not one dualseg runs on; {fix}")
    return device


def init_distributed(device: str = "auto") -> DistEnv:
    """Join the ``torchrun`` process group when launched by it; else a single-process env."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank=local_rank)
    if world_size > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return DistEnv(rank=rank, world_size=world_size, device=dev)


def _joined() -> bool:
    return dist.is_available() and dist.is_initialized()


def cleanup_distributed() -> None:
    if _joined():
        dist.destroy_process_group()


def barrier() -> None:
    if _joined():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ranks in place (no-op in a single process); returns ``t``."""
    if _joined():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm statistics) to every rank."""
    for buf in model.buffers() if _joined() else ():
        dist.broadcast(buf, src=0)


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` yielding ``(index, epoch)``, its position in the epoch saved and
    restored (``set_offset(k)`` skips this rank's first ``k``)."""

    def __init__(self, dataset: Dataset, *, num_replicas: int = 1, rank: int = 0, seed: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.offset = 0

    def set_offset(self, offset: int) -> None:
        self.offset = int(offset)

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        return iter([(i, self.epoch) for i in list(super().__iter__())[self.offset :]])

    def __len__(self) -> int:
        return max(0, self.num_samples - self.offset)

    def state_dict(self, epoch: int | None = None, offset: int | None = None) -> dict[str, int]:
        """The position to save: ``offset`` samples of this rank's shard of ``epoch`` consumed."""
        return {
            "epoch": self.epoch if epoch is None else int(epoch),
            "offset": int(self.offset if offset is None else offset),
            "world_size": int(self.num_replicas),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (saved := int(state["world_size"])) != self.num_replicas:
            raise CheckpointError(
                f"the checkpoint was trained by {saved} process(es), this run has "
                f"{self.num_replicas}; resume with {saved} (torchrun --nproc_per_node {saved})"
            )
        self.set_epoch(int(state["epoch"]))
        self.set_offset(int(state["offset"]))


class SeededSamples(Dataset):
    """``ds[(index, epoch)]`` loads sample ``index`` as of ``epoch``, the RNGs seeded from
    (seed, epoch, index) around the call, then restored."""

    def __init__(self, dataset: Dataset, *, seed: int = 0) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, epoch = key
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)
        seed = sample_seed(self.seed, index=index, epoch=epoch)
        py_state, np_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)
            try:
                return self.dataset[index]
            finally:
                random.setstate(py_state)
                np.random.set_state(np_state)
