"""BoundaryRefiner: method B end to end — fit (steps 1-5) and refine (P1-P5).

Training: near-boundary mask of each ground-truth label map (step 2) -> embedding model
(step 3) -> sampled triplet hinge, a fixed number of steps (step 4) -> per-class mean embedding
over the near-boundary pixels of the training set (step 5).

Inference on a base model's class scores ``probs [B,C,H,W]`` (P2): Top-N labels per pixel (P3),
near-boundary mask of the base prediction ``argmax`` (P4), and at those pixels the Top-N label
whose prototype is nearest (Euclidean) to the pixel's embedding (P5). Only the order of the
scores matters (argmax and Top-N), so ``probs`` may be probabilities or logits alike.

The artifact is one file (``save``/``load``, ``weights_only=True``): embedding weights,
prototypes, the configuration and the class names.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dualseg.errors import CheckpointError, ConfigError, DataError
from dualseg.io import atomic_torch_save
from dualseg.refine.boundary import EDGE_METHODS, near_boundary_mask
from dualseg.refine.embedding import EmbeddingNet, build_embedding_net, init_backbone_from
from dualseg.refine.prototypes import PrototypeAccumulator
from dualseg.refine.triplet import REDUCTIONS, reduce_hinge, sample_triplets, triplet_hinge

log = logging.getLogger(__name__)

FORMAT = "dualseg-refiner/1"
TRAIN_FORMAT = "dualseg-refiner-train/1"
OPTIMIZERS = ("adamw", "sgd")


@dataclass(frozen=True)
class RefinerConfig:
    """Every method-B option, with the spec's readings as defaults.

    Model (step 3): ``backbone`` (a ``dualseg.models.build_backbone`` name), ``embed_dim`` C,
    ``output_stride``, ``aspp_rates``, ``input_scale`` (the embedding model sees the image
    resized by this factor; the embedding is still read at every full-resolution pixel).
    Defaults chosen by measurement on CamVid (docs/refine.md): output stride 16 at input scale
    0.5 costs ~6% of a DeepLabV3-MobileNetV2 forward on the CPU (stride 8 at scale 1: ~90%);
    AdamW at lr 1e-3 (at 1e-4, over half the triplets still violated the margin after 150
    steps; at 1e-3, 36% after 1,500).
    Mask (step 2 / P4): ``radius`` (dilation, px),
    ``edge_method`` (see :mod:`dualseg.refine.boundary`). Triplets (step 4): ``margin`` Δ,
    ``num_triplets`` per step, ``reduction``, ``steps`` (the preset repetition count),
    ``optimizer`` / ``lr`` / ``weight_decay`` / ``momentum``, ``batch_size``, ``seed``.
    Inference (P3): ``top_n``.
    """

    backbone: str = "mobilenet_v2"
    embed_dim: int = 256
    output_stride: int = 16
    aspp_rates: tuple[int, ...] = (4, 6, 8, 12)
    input_scale: float = 0.5
    radius: int = 5
    edge_method: str = "canny"
    top_n: int = 5
    margin: float = 1.0
    num_triplets: int = 4096
    reduction: str = "all"
    steps: int = 2000
    batch_size: int = 8
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 1e-4
    momentum: float = 0.9
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.embed_dim >= 1, f"embed_dim must be >= 1, got {self.embed_dim}"),
            (0 < self.input_scale <= 4, f"input_scale must be in (0, 4], got {self.input_scale}"),
            (self.radius >= 0, f"radius must be >= 0, got {self.radius}"),
            (self.top_n >= 1, f"top_n must be >= 1, got {self.top_n}"),
            (self.margin >= 0, f"margin must be >= 0, got {self.margin}"),
            (self.num_triplets >= 1, f"num_triplets must be >= 1, got {self.num_triplets}"),
            (self.steps >= 0, f"steps must be >= 0, got {self.steps}"),
            (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.edge_method in EDGE_METHODS, f"edge_method must be one of {EDGE_METHODS}"),
            (self.reduction in REDUCTIONS, f"reduction must be one of {REDUCTIONS}"),
            (self.optimizer in OPTIMIZERS, f"optimizer must be one of {OPTIMIZERS}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RefinerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in known}
        return cls(**kw)


class BoundaryRefiner:
    """Re-labels a base model's near-boundary pixels by nearest class prototype (P1-P5)."""

    def __init__(
        self,
        net: EmbeddingNet,
        prototypes: Tensor,
        present: Tensor,
        *,
        class_names: Sequence[str],
        config: RefinerConfig | None = None,
        ignore_index: int = 255,
    ) -> None:
        self.config = config or RefinerConfig(embed_dim=int(prototypes.shape[1]))
        self.class_names = tuple(str(n) for n in class_names)
        if prototypes.shape[0] != len(self.class_names) or present.shape != prototypes.shape[:1]:
            raise ConfigError(
                f"{prototypes.shape[0]} prototypes for {len(self.class_names)} class names"
            )
        self.net = net.eval()
        self.prototypes = prototypes.float()
        self.present = present.bool()
        self.ignore_index = ignore_index

    # ------------------------------------------------------------------ basics
    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def device(self) -> torch.device:
        return self.prototypes.device

    def to(self, device: str | torch.device) -> BoundaryRefiner:
        self.net.to(device)
        self.prototypes = self.prototypes.to(device)
        self.present = self.present.to(device)
        return self

    def __repr__(self) -> str:
        c = self.config
        return (
            f"BoundaryRefiner({c.backbone}, C={c.embed_dim}, {self.num_classes} classes "
            f"({int(self.present.sum())} with prototypes), top_n={c.top_n}, radius={c.radius})"
        )

    def check_classes(
        self, base_names: Sequence[str] | None, num_classes: int, *, what: str = "the base model"
    ) -> None:
        """Raise :class:`CheckpointError` when the base model's classes are not the refiner's."""
        if num_classes != self.num_classes:
            raise CheckpointError(
                f"{what} predicts {num_classes} classes but the refiner was fit for "
                f"{self.num_classes} ({', '.join(self.class_names)}); fit a refiner on the base "
                "model's dataset (dualseg refine fit)"
            )
        if base_names is not None and tuple(base_names) != self.class_names:
            diff = [
                f"{i}: {a!r} vs {b!r}"
                for i, (a, b) in enumerate(zip(base_names, self.class_names))
                if a != b
            ]
            raise CheckpointError(
                f"{what}'s class names differ from the refiner's ({'; '.join(diff[:3])}); "
                "use a refiner fit on the same dataset and class order"
            )

    # ------------------------------------------------------------------ inference (P2-P5)
    @torch.no_grad()
    def refine(
        self, images: Any, probs: Any, *, return_changed: bool = False
    ) -> Tensor | np.ndarray | tuple[Any, Any]:
        """Refined label map(s).

        Batch form: ``images`` float ``[B,3,H,W]`` ImageNet-normalized, ``probs`` ``[B,C,H,W]``
        probabilities or logits -> int64 ``[B,H,W]`` on ``probs``' device (and the bool
        ``changed`` mask with ``return_changed``). Single-image form: ``images`` a uint8
        ``HxWx3`` array / file path / PIL image, ``probs`` ``[C,H,W]`` (numpy or tensor) ->
        numpy ``HxW`` int64 (and a bool ``HxW`` changed mask).
        """
        if isinstance(images, Tensor) and images.dim() == 4:
            return self._refine_batch(images, _as_tensor(probs), return_changed)
        from dualseg.data.transforms import IMAGENET_MEAN, IMAGENET_STD
        from dualseg.engine.predict import as_rgb_array

        rgb = as_rgb_array(images)
        x = torch.from_numpy(rgb).permute(2, 0, 1)[None].float() / 255.0
        mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        p = _as_tensor(probs)
        if p.dim() == 3:
            p = p[None]
        labels, changed = self._refine_batch((x - mean) / std, p, True)
        labels, changed = labels[0].cpu().numpy(), changed[0].cpu().numpy()
        return (labels, changed) if return_changed else labels

    def _refine_batch(self, images: Tensor, probs: Tensor, return_changed: bool) -> Any:
        if (
            probs.dim() != 4
            or images.shape[0] != probs.shape[0]
            or images.shape[-2:] != probs.shape[-2:]
        ):
            raise DataError(
                f"class probabilities of shape {tuple(probs.shape)} do not match images of shape "
                f"{tuple(images.shape)}; resize the base model's output to the image size "
                "(bilinear) before refining"
            )
        self.check_classes(None, probs.shape[1])
        out_device = probs.device
        dev = self.device
        probs = probs.to(dev).float()
        # P2's Pred is the argmax, first index on ties like argmax (topk's first is not: on
        # equal scores it picks another class). max(1) returns the same indices and is ~4x
        # faster than argmax(1) over the strided class dim on the CPU.
        pred = probs.max(1).indices  # [B,H,W]
        n = min(self.config.top_n, probs.shape[1])
        top = probs.topk(n, dim=1).indices  # [B,N,H,W] P3
        edge = near_boundary_mask(
            pred, radius=self.config.radius, ignore_index=None, method=self.config.edge_method
        )  # [B,H,W] P4
        out = pred.clone()
        if edge.any():
            out[edge] = self._nearest_label(images.to(dev), top, edge)  # P5
        changed = out != pred
        out = out.to(out_device)
        return (out, changed.to(out_device)) if return_changed else out

    def _nearest_label(self, images: Tensor, top: Tensor, edge: Tensor) -> Tensor:
        """P5 at the ``edge`` pixels: the Top-N label whose prototype is nearest, ``[M]``.

        Why a score map: ``|e - p_k|^2 = |e|^2 - 2 e.p_k + |p_k|^2`` and ``|e|^2`` is the same
        for every k, so the nearest prototype is the argmin of ``s_k = |p_k|^2 - 2 e.p_k``.
        ``s_k`` is affine in ``e`` and the bilinear weights sum to one, so sampling the
        low-resolution map of ``s`` (K channels) at a pixel equals ``s`` of the sampled
        embedding (C channels): the same labels, without reading C-dim vectors per pixel.
        """
        keep = edge.flatten(1).any(1)  # only images that have near-boundary pixels
        feats = embed_features(self.net, images[keep].float(), self.config.input_scale)
        p = self.prototypes  # [K,C]
        scores = torch.einsum("bchw,kc->bkhw", feats.float(), -2 * p)
        scores = scores + p.pow(2).sum(1)[None, :, None, None]  # [b,K,h,w]
        s = EmbeddingNet.sample(scores, edge[keep])  # [M,K], in edge.nonzero() order
        b, y, x = edge.nonzero().unbind(1)
        cand = top[b, :, y, x]  # [M,N] candidate labels, the same order
        sc = s.gather(1, cand).masked_fill(~self.present[cand], float("inf"))
        best = cand.gather(1, sc.argmin(1, keepdim=True)).squeeze(1)
        # no candidate with a prototype: keep the base label (the Top-1 candidate)
        return torch.where(torch.isfinite(sc.min(1).values), best, cand[:, 0])

    # ------------------------------------------------------------------ artifact
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the refiner (weights, prototypes, config, class names) atomically to one file."""
        from dualseg import __version__

        state = {
            "format": FORMAT,
            "version": __version__,
            "config": self.config.to_dict(),
            "model": {k: v.detach().cpu() for k, v in self.net.state_dict().items()},
            "prototypes": self.prototypes.cpu(),
            "present": self.present.cpu(),
            "class_names": list(self.class_names),
            "ignore_index": self.ignore_index,
        }
        path = Path(path)
        atomic_torch_save(state, path)
        return path

    def save_pretrained(self, folder: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write ``folder/refiner.json`` + ``folder/refiner.safetensors`` (weights only; see
        :mod:`dualseg.refine.pretrained`); :meth:`load` reads the folder back."""
        from dualseg.refine.pretrained import save_folder

        return save_folder(self, folder, overwrite=overwrite)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device = "cpu",
        net: EmbeddingNet | None = None,
    ) -> BoundaryRefiner:
        """Load a refiner file (``weights_only=True``), a refiner folder (``refiner.json`` +
        ``refiner.safetensors``) or ``hf://org/name``. ``net``: an embedding model to load the
        weights into, for a custom model (default: rebuilt from the stored configuration)."""
        from dualseg.refine import pretrained

        if pretrained.is_folder_source(path):
            return pretrained.load_folder(path, device=device, net=net)
        state = _load_file(path, FORMAT, "refiner")
        config = RefinerConfig.from_dict(state["config"])
        if net is None:
            net = build_embedding_net(
                config.backbone,
                embed_dim=config.embed_dim,
                output_stride=config.output_stride,
                aspp_rates=config.aspp_rates,
            )
        try:
            net.load_state_dict(state["model"])
        except RuntimeError as err:
            raise CheckpointError(
                f"{path}: the embedding weights do not fit the model ({str(err).splitlines()[0]})"
            ) from err
        refiner = cls(
            net,
            state["prototypes"],
            state["present"],
            class_names=state["class_names"],
            config=config,
            ignore_index=int(state.get("ignore_index", 255)),
        )
        return refiner.to(device)

    # ------------------------------------------------------------------ training (steps 1-5)
    @classmethod
    def fit(
        cls,
        dataset: torch.utils.data.Dataset,
        *,
        class_names: Sequence[str],
        config: RefinerConfig | None = None,
        prototype_dataset: torch.utils.data.Dataset | None = None,
        weights: str | os.PathLike[str] | None = "imagenet",
        init_from: nn.Module | Mapping[str, Tensor] | None = None,
        net: EmbeddingNet | None = None,
        device: str | torch.device = "cpu",
        num_workers: int = 0,
        checkpoint: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 200,
        resume: bool = False,
        progress: bool = True,
        log_every: int = 0,
        ignore_index: int = 255,
    ) -> BoundaryRefiner:
        """Train the embedding model with triplets, then compute the class prototypes.

        ``dataset`` yields ``(image [3,H,W] normalized, label [H,W])`` with training augmentation
        (step 1); ``prototype_dataset`` (default ``dataset``) is streamed once for step 5,
        typically the training images without augmentation. ``weights`` initializes the backbone
        (``"imagenet"``, a file, or ``None``); ``init_from`` then copies the base model's
        backbone tensors over it (:func:`init_backbone_from`). ``checkpoint``: a training-state
        file written every ``checkpoint_every`` steps and at the end; ``resume=True`` continues
        from it. The loss history is in ``refiner.history``.
        """
        cfg = config or RefinerConfig()
        dev = torch.device(device)
        if net is None:
            net = build_embedding_net(
                cfg.backbone,
                embed_dim=cfg.embed_dim,
                output_stride=cfg.output_stride,
                aspp_rates=cfg.aspp_rates,
                weights=weights,
            )
            if init_from is not None and init_backbone_from(net.backbone, init_from) == 0:
                raise ConfigError(
                    f"no tensor of the base model fits backbone {cfg.backbone!r}; use the base "
                    "model's backbone name, or ImageNet initialization"
                )
        net.to(dev)
        history = train_embedding(
            net,
            dataset,
            cfg,
            class_names=class_names,
            device=dev,
            num_workers=num_workers,
            checkpoint=checkpoint,
            checkpoint_every=checkpoint_every,
            resume=resume,
            progress=progress,
            log_every=log_every,
            ignore_index=ignore_index,
        )
        protos, present = stream_prototypes(
            net,
            prototype_dataset if prototype_dataset is not None else dataset,
            len(class_names),
            radius=cfg.radius,
            edge_method=cfg.edge_method,
            input_scale=cfg.input_scale,
            ignore_index=ignore_index,
            device=dev,
            num_workers=num_workers,
            progress=progress,
        )
        missing = [n for n, p in zip(class_names, present.tolist()) if not p]
        if missing:
            log.warning("no near-boundary pixels for %s: these classes get no prototype", missing)
        refiner = cls(
            net, protos, present, class_names=class_names, config=cfg, ignore_index=ignore_index
        )
        refiner.history = history
        return refiner


# ---------------------------------------------------------------------- training helpers
def _make_optimizer(net: nn.Module, cfg: RefinerConfig) -> torch.optim.Optimizer:
    params = [p for p in net.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _batches(
    n: int, batch_size: int, seed: int, start_step: int, steps: int
) -> Iterator[list[tuple[int, int]]]:
    """``(pass, index)`` batches for steps ``start_step..steps-1``: a fresh permutation per
    pass over the data, seeded by (seed, pass), so a resumed run draws the batches it would
    have drawn."""
    per_epoch = max(1, n // batch_size) if n >= batch_size else 1
    for step in range(start_step, steps):
        epoch, k = divmod(step, per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        yield [(epoch, i) for i in perm[k * batch_size : (k + 1) * batch_size].tolist()]


class _EpochView(torch.utils.data.Dataset):
    """``view[(pass, i)] = dataset[i]`` with the dataset's augmentation seeded for that pass
    (``set_epoch``, when it has one), also inside DataLoader workers: each pass over the data
    sees new augmentations."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        return self.dataset[index]


def train_embedding(
    net: EmbeddingNet,
    dataset: torch.utils.data.Dataset,
    cfg: RefinerConfig,
    *,
    class_names: Sequence[str],
    device: torch.device,
    num_workers: int = 0,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 200,
    resume: bool = False,
    progress: bool = True,
    log_every: int = 0,
    ignore_index: int = 255,
) -> list[dict[str, float]]:
    """Step 4: ``cfg.steps`` optimizer steps of the sampled triplet hinge. Returns the history
    (one dict per step: step, loss, violating, margin, num_triplets, pixels). ``log_every``:
    also print one line every that many steps (for logs without a progress bar)."""
    from tqdm.auto import tqdm

    if len(dataset) == 0:  # type: ignore[arg-type]
        raise DataError("the refiner's training dataset is empty; check --data and --split")
    opt = _make_optimizer(net, cfg)
    start, history = 0, []
    ckpt_path = Path(checkpoint) if checkpoint is not None else None
    if resume and ckpt_path is not None and ckpt_path.is_file():
        state = _load_file(ckpt_path, TRAIN_FORMAT, "refiner training checkpoint")
        # the step count may grow on resume (train longer); every other option must agree
        saved = dataclasses.replace(RefinerConfig.from_dict(state["config"]), steps=cfg.steps)
        if saved != cfg or list(state["class_names"]) != list(class_names):
            raise CheckpointError(
                f"{ckpt_path} was written with another configuration or class set; resume with "
                "the same options (only --steps may change), or delete it to start over"
            )
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start, history = int(state["step"]), list(state["history"])
        log.info("resuming refiner training from step %d (%s)", start, ckpt_path)

    def save(step: int) -> None:
        if ckpt_path is None:
            return
        atomic_torch_save(
            {
                "format": TRAIN_FORMAT,
                "step": step,
                "model": net.state_dict(),
                "optimizer": opt.state_dict(),
                "config": cfg.to_dict(),
                "class_names": list(class_names),
                "history": history,
            },
            ckpt_path,
        )

    loader = torch.utils.data.DataLoader(
        _EpochView(dataset),
        batch_sampler=list(_batches(len(dataset), cfg.batch_size, cfg.seed, start, cfg.steps)),  # type: ignore[arg-type]
        num_workers=num_workers,
    )
    net.train()
    bar = tqdm(loader, total=cfg.steps, initial=start, desc="refine fit", disable=not progress)
    for step, (images, labels) in enumerate(bar, start=start):
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        stats = triplet_step(net, opt, images.to(device), labels.to(device), cfg, gen, ignore_index)
        history.append({"step": step + 1, **stats})
        bar.set_postfix(
            loss=f"{stats['loss']:.3f}",
            viol=f"{stats['violating']:.2f}",
            margin=f"{stats['margin']:.2f}",
        )
        if log_every and (step + 1) % log_every == 0:
            bar.write(
                f"[{step + 1}/{cfg.steps}] triplet loss {stats['loss']:.4f}, violating "
                f"{100 * stats['violating']:.1f}%, margin {stats['margin']:.3f}"
            )
        if (step + 1) % max(1, checkpoint_every) == 0:
            save(step + 1)
    bar.close()
    if cfg.steps > start:
        save(cfg.steps)
    net.eval()
    return history


def triplet_step(
    net: EmbeddingNet,
    opt: torch.optim.Optimizer,
    images: Tensor,
    labels: Tensor,
    cfg: RefinerConfig,
    generator: torch.Generator,
    ignore_index: int = 255,
) -> dict[str, float]:
    """One step 2-4 iteration on a batch. Triplets are drawn first, so embeddings are read only
    at the (at most 3 x num_triplets) pixels they use. A batch without any possible triplet
    (no boundary, or no class with two near-boundary pixels) is a no-op."""
    edge = near_boundary_mask(
        labels, radius=cfg.radius, ignore_index=ignore_index, method=cfg.edge_method
    )
    pix_labels = labels[edge]  # [M]
    triplets = sample_triplets(pix_labels, cfg.num_triplets, generator=generator)
    if triplets is None:
        return {
            "loss": 0.0,
            "violating": 0.0,
            "margin": 0.0,
            "num_triplets": 0,
            "pixels": int(edge.sum()),
        }
    used, inverse = torch.unique(torch.cat(triplets), return_inverse=True)
    where = edge.nonzero()[used]  # [U,3]
    sub = torch.zeros_like(edge)
    sub[where[:, 0], where[:, 1], where[:, 2]] = True  # nonzero() order == sorted `used` order
    emb = EmbeddingNet.sample(embed_features(net, images, cfg.input_scale), sub)  # [U,C]
    t1, t2, f0 = inverse.split(triplets[0].numel())
    hinge, gap = triplet_hinge(emb, t1, t2, f0, cfg.margin)
    loss, stats = reduce_hinge(hinge, gap, cfg.reduction)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return {**stats, "pixels": int(edge.sum())}


@torch.no_grad()
def stream_prototypes(
    net: EmbeddingNet,
    dataset: torch.utils.data.Dataset,
    num_classes: int,
    *,
    radius: int = 5,
    edge_method: str = "canny",
    input_scale: float = 1.0,
    ignore_index: int = 255,
    device: str | torch.device = "cpu",
    num_workers: int = 0,
    progress: bool = True,
) -> tuple[Tensor, Tensor]:
    """Step 5 over ``dataset`` (one image at a time, any sizes): ``(prototypes, present)``."""
    from tqdm.auto import tqdm

    net.eval()
    acc = PrototypeAccumulator(num_classes, net.embed_dim, device=device)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=num_workers)
    for images, labels in tqdm(loader, desc="prototypes", disable=not progress):
        images, labels = images.to(device), labels.to(device)
        edge = near_boundary_mask(
            labels, radius=radius, ignore_index=ignore_index, method=edge_method
        )
        if edge.any():
            feats = embed_features(net, images, input_scale)
            acc.update(EmbeddingNet.sample(feats, edge), labels[edge])
    return acc.compute()


def embed_features(net: EmbeddingNet, images: Tensor, input_scale: float = 1.0) -> Tensor:
    """Low-resolution embedding of ``images``, optionally of a resized copy (``input_scale``)."""
    if input_scale != 1.0:
        images = F.interpolate(
            images, scale_factor=input_scale, mode="bilinear", align_corners=False
        )
    return net.features(images)


def _as_tensor(x: Any) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    raise DataError(f"class probabilities must be a tensor or numpy array, got {type(x).__name__}")


def _load_file(path: str | os.PathLike[str], fmt: str, what: str) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` with one clear error per failure."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"{what} not found: {path} (check the path; 'dualseg refine fit --out' writes it)"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (
        pickle.UnpicklingError,
        RuntimeError,
        EOFError,
        OSError,
        zipfile.BadZipFile,
        ValueError,
    ) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"{path} is not a readable {what} ({first}); refit or use another file"
        ) from err
    if not isinstance(state, dict) or state.get("format") != fmt:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{path} is not a dualseg {what} (format {found!r}, expected {fmt!r})"
        )
    return state


__all__ = [
    "FORMAT",
    "BoundaryRefiner",
    "RefinerConfig",
    "stream_prototypes",
    "train_embedding",
    "triplet_step",
]
