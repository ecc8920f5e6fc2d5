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
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dualseg.augment_defaults import seed_error
from dualseg.engine.distributed import resolve_device
from dualseg.engine.predict import as_rgb_array
from dualseg.errors import CheckpointError, ConfigError, DataError, OutputError
from dualseg.imaging import normalize
from dualseg.io import atomic_torch_save
from dualseg.refine.boundary import EDGE_METHODS, MAX_RADIUS
from dualseg.refine.decision import (
    Candidates,
    decide,
    gather_candidates,
    kept_rows,
    prototype_scale,
)
from dualseg.refine.embedding import (
    EmbeddingNet,
    build_embedding_net,
    embed_backbone,
    embedding_cover,
    init_backbone_from,
    p1_filter,
)
from dualseg.refine.fit import OPTIMIZERS, train_embedding
from dualseg.refine.formats import FORMAT, load_state, stored_description
from dualseg.refine.prototypes import stream_prototypes
from dualseg.refine.shared import BaseFeatures, SharedFeatures, can_share, matching
from dualseg.refine.triplet import MINING, REDUCTIONS, triplet_step

BACKBONE_SOURCES = ("independent", "base-frozen", "base-finetune")
# C (and the decoder's projection): 16x the spec's 256; 100000 ran out of memory building
# the ASPP head (a traceback)
MAX_EMBED_DIM = 4096

log = logging.getLogger(__name__)


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
    ``num_triplets`` per step, ``reduction``, ``mining`` (which false example: ``"random"``,
    the claim's reading, or ``"semi-hard"`` among ``mining_pool`` per anchor; see
    :mod:`dualseg.refine.triplet`), ``steps`` (the preset repetition count),
    ``optimizer`` / ``lr`` / ``weight_decay`` / ``momentum``, ``batch_size``, ``seed``.
    Inference: ``p1_blur_sigma`` (P1's filtering, a Gaussian blur of the image the embedding
    model sees; the claim names no filter, 0: none, normalization only), ``top_n`` (P3).

    Step 3 readings (the claim re-optimizes *based on an existing model*): ``backbone_source``
    ``"independent"`` (its own backbone, ImageNet-initialized; the default), ``"base-frozen"``
    (the base model's backbone weights, frozen: only the ASPP head learns, on the base's own
    features) or ``"base-finetune"`` (the base's backbone weights, trained on). The ``base-*``
    readings need the base model at fit time (``init_from``), and ``backbone`` must be its
    backbone. Decision (beyond the claim, :mod:`dualseg.refine.decision`): ``gate_margin`` τ
    relabels only pixels where the base's top-1 minus top-2 probability is below τ (``None``:
    every near-boundary pixel, the claim); ``prior_weight`` λ adds λ × the base's negative
    log-probability to each candidate's squared distance (in units of the mean squared distance
    between prototypes; 0: the claim); ``min_prob`` drops Top-N candidates below that base
    probability (0: the claim). :mod:`dualseg.refine.calibrate` chooses them on held-out
    labelled images. ``decoder_channels`` (beyond the claim, :mod:`dualseg.refine.decoder`):
    0, the claim's embedding (the ASPP output); else a DeepLabV3+ decoder fuses the backbone's
    stride-4 features, projected to this many channels (48 in DeepLabV3+), into the embedding.
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
    mining: str = "random"
    mining_pool: int = 8
    steps: int = 2000
    batch_size: int = 8
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 1e-4
    momentum: float = 0.9
    seed: int = 0
    backbone_source: str = "independent"
    gate_margin: float | None = None
    prior_weight: float = 0.0
    min_prob: float = 0.0
    p1_blur_sigma: float = 0.0
    decoder_channels: int = 0

    def __post_init__(self) -> None:
        checks = [
            (
                1 <= self.embed_dim <= MAX_EMBED_DIM,
                f"embed_dim must be in 1..{MAX_EMBED_DIM}, got {self.embed_dim}",
            ),
            (0 < self.input_scale <= 4, f"input_scale must be in (0, 4], got {self.input_scale}"),
            (
                0 <= self.radius <= MAX_RADIUS,
                f"radius must be in 0..{MAX_RADIUS}, got {self.radius}",
            ),
            (self.top_n >= 1, f"top_n must be >= 1, got {self.top_n}"),
            (self.margin >= 0, f"margin must be >= 0, got {self.margin}"),
            (self.num_triplets >= 1, f"num_triplets must be >= 1, got {self.num_triplets}"),
            (self.steps >= 0, f"steps must be >= 0, got {self.steps}"),
            (
                self.batch_size >= 2,  # BatchNorm of the ASPP's pooled branch: 1 value/channel
                f"batch_size must be >= 2 (BatchNorm needs two crops), got {self.batch_size}",
            ),
            (0 < self.lr < float("inf"), f"lr must be > 0 and finite, got {self.lr}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}"),
            (self.edge_method in EDGE_METHODS, f"edge_method must be one of {EDGE_METHODS}"),
            (self.reduction in REDUCTIONS, f"reduction must be one of {REDUCTIONS}"),
            (self.mining in MINING, f"mining must be one of {MINING}"),
            (self.mining_pool >= 1, f"mining_pool must be >= 1, got {self.mining_pool}"),
            (self.optimizer in OPTIMIZERS, f"optimizer must be one of {OPTIMIZERS}"),
            (
                self.backbone_source in BACKBONE_SOURCES,
                f"backbone_source must be one of {BACKBONE_SOURCES}",
            ),
            (
                self.gate_margin is None or 0 <= self.gate_margin <= 1,
                f"gate_margin must be in [0, 1] or None, got {self.gate_margin}",
            ),
            (self.prior_weight >= 0, f"prior_weight must be >= 0, got {self.prior_weight}"),
            (0 <= self.min_prob < 1, f"min_prob must be in [0, 1), got {self.min_prob}"),
            (
                0 <= self.p1_blur_sigma < float("inf"),
                f"p1_blur_sigma must be >= 0 and finite, got {self.p1_blur_sigma}",
            ),
            (
                0 <= self.decoder_channels <= MAX_EMBED_DIM,
                f"decoder_channels must be in 0..{MAX_EMBED_DIM} (0: no decoder), got "
                f"{self.decoder_channels}",
            ),
        ]
        if (problem := seed_error(self.seed, "seed")) is not None:
            checks.insert(0, (False, problem))
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def embedding_net(self, *, weights: str | os.PathLike[str] | None = None) -> EmbeddingNet:
        """The step-3 model these options describe (``weights``: backbone initialization)."""
        return build_embedding_net(
            self.backbone,
            embed_dim=self.embed_dim,
            output_stride=self.output_stride,
            aspp_rates=self.aspp_rates,
            weights=weights,
            freeze_backbone=self.backbone_source == "base-frozen",
            decoder_channels=self.decoder_channels,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RefinerConfig:
        """The options of a stored refiner (``to_dict``'s output). Options it lacks take their
        defaults (refiners saved before the option existed ran as its default); an option this
        dualseg does not know, or a value of the wrong type, is a :class:`ConfigError`."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"config must be a dict of refiner options, got {d!r:.40}")
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in fields)
        if unknown:
            raise ConfigError(
                f"config holds option(s) {', '.join(unknown)} that this dualseg does not know "
                "(written by a newer version?); upgrade dualseg or fit the refiner again"
            )
        kw = {k: _typed_option(k, fields[k], v) for k, v in d.items()}
        return cls(**kw)


def _typed_option(name: str, kind: Any, value: Any) -> Any:
    """``value`` of the stored option ``name`` (annotation ``kind``, a string under postponed
    annotations), checked: JSON has no tuples, and "5" or true is no count."""
    kind = str(kind)

    def number(v: Any, integer: bool) -> bool:
        ok = (int,) if integer else (int, float)
        return isinstance(v, ok) and not isinstance(v, bool)

    if kind == "int":
        ok = number(value, True)
    elif kind == "float":
        ok = number(value, False)
    elif kind == "float | None":
        ok = value is None or number(value, False)
    elif kind == "str":
        ok = isinstance(value, str)
    elif kind == "tuple[int, ...]":
        ok = isinstance(value, list | tuple) and all(number(v, True) for v in value)
        value = tuple(value) if ok else value
    else:  # pragma: no cover - a new field needs its kind here
        raise AssertionError(f"RefinerConfig.{name}: no check for {kind}")
    if not ok:
        raise ConfigError(f"option {name} must be {kind}, got {value!r:.40}")
    return value


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
        palette: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.config = config or RefinerConfig(embed_dim=int(prototypes.shape[1]))
        self.class_names = tuple(str(n) for n in class_names)
        k = len(self.class_names)
        if prototypes.ndim != 2 or prototypes.shape[0] != k or tuple(present.shape) != (k,):
            raise ConfigError(
                f"prototypes {tuple(prototypes.shape)} and present {tuple(present.shape)} for "
                f"{k} class names: expected [{k}, C] and [{k}]"
            )
        # the dataset's class colours (None: refiners saved before they were stored)
        self.palette = as_palette(palette, len(self.class_names))
        self.net = net.eval()
        self.prototypes = prototypes.float()
        self.present = present.bool()
        self.ignore_index = ignore_index
        # the gate sweep of ``refine fit --calibrate-split``: {"split", "images", "rows"}
        self.calibration: dict[str, Any] | None = None

    # ------------------------------------------------------------------ basics
    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def device(self) -> torch.device:
        return self.prototypes.device

    def to(self, device: str | torch.device) -> BoundaryRefiner:
        device = resolve_device(device)  # "gpu", or cuda without one: one line, not torch's
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
        check_classes(self.class_names, base_names, num_classes, what=what)

    # ------------------------------------------------------------------ inference (P2-P5)
    @torch.no_grad()
    def refine(
        self,
        images: Any,
        probs: Any,
        *,
        return_changed: bool = False,
        features: BaseFeatures | tuple[Tensor, tuple[int, int]] | None = None,
    ) -> Tensor | np.ndarray | tuple[Any, Any]:
        """Refined label map(s).

        Batch form: ``images`` float ``[B,3,H,W]`` ImageNet-normalized (tensor or numpy),
        ``probs`` ``[B,C,H,W]`` probabilities or logits -> int64 ``[B,H,W]`` on ``probs``'
        device, numpy when ``probs`` is (and the bool ``changed`` mask with
        ``return_changed``), as the exported refiner answers. Single-image form: ``images`` a
        uint8 ``HxWx3`` array / file path / PIL image, ``probs`` ``[C,H,W]`` (numpy or tensor)
        -> numpy ``HxW`` int64 (and a bool ``HxW`` changed mask).

        ``features`` (batch form): the base's backbone output, from :meth:`shared_features`
        (``None``: the refiner runs its own backbone).
        """
        batch = isinstance(images, np.ndarray | Tensor) and images.ndim == 4
        if batch:  # numpy too: the exported refiner's batch form
            check_normalized_batch(images)
            if isinstance(images, np.ndarray):
                images = torch.from_numpy(np.ascontiguousarray(images))
            out = self._refine_batch(images, _as_tensor(probs), return_changed, features)
            if isinstance(probs, Tensor):
                return out
            return tuple(t.cpu().numpy() for t in out) if return_changed else out.cpu().numpy()
        x = torch.from_numpy(normalize([as_rgb_array(images)]))
        p = _as_tensor(probs)
        if p.dim() == 3:
            p = p[None]
        labels, changed = self._refine_batch(x, p, True)
        labels, changed = labels[0].cpu().numpy(), changed[0].cpu().numpy()
        return (labels, changed) if return_changed else labels

    def candidates(
        self,
        images: Tensor,
        probs: Tensor,
        *,
        p1_blur_sigma: float | None = None,
        features: BaseFeatures | tuple[Tensor, tuple[int, int]] | None = None,
    ) -> Candidates:
        """P1-P4 and P5's distances for a batch (``images [B,3,H,W]`` normalized, ``probs
        [B,C,H,W]``), before any decision: what :mod:`dualseg.refine.calibrate` sweeps.
        ``p1_blur_sigma`` overrides the configuration's. ``features``: the base's backbone
        output and the input size it covers, from :meth:`shared_features` — read in place of
        running the refiner's backbone."""
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
        images = images.to(self.device)
        cfg = self.config
        sigma = cfg.p1_blur_sigma if p1_blur_sigma is None else p1_blur_sigma

        if features is not None and sigma != 0:
            raise ConfigError(
                "shared base features carry no P1 blur: refine with p1_blur_sigma 0, or "
                "without the base's features"
            )
        if features is not None:
            self._check_base_features(BaseFeatures(*features).features)
        # not this batch's own backbone output (resized, tiled, half precision): run our own
        features = matching(
            features, images, cfg.output_stride, needs_low=self.net.decoder is not None
        )

        scale = prototype_scale(self.prototypes, self.present)
        if features is not None:  # the base's padded input
            covered: tuple[float, float] = features.covered
        else:
            covered = embedding_cover(images.shape[-2:], cfg.input_scale, cfg.output_stride)

        def scores(keep: Tensor, band: Tensor) -> Tensor:  # the embedding on images with a band
            if features is not None:  # the base's own backbone output: only the head runs
                local = kept_rows(features.features.to(self.device), keep)
                low = features.low
                low = None if low is None else kept_rows(low.to(self.device), keep)
            else:
                x = p1_filter(kept_rows(images, keep).float(), sigma)  # P1 (after normalization)
                local, low = embed_backbone(self.net, x, cfg.input_scale, cfg.output_stride)
            if self.net.decoder is None:
                return prototype_scores(self.net.head(local, low), self.prototypes)
            # with a decoder: only the stride-4 cells the band's pixels sample, zeros elsewhere
            at = EmbeddingNet.sampled_cells(band, low.shape[-2:], covered)
            rows = prototype_row_scores(self.net.head_at(local, low, at), self.prototypes)
            out = rows.new_zeros(*at.shape, rows.shape[1])  # [b,h,w,K]
            out[at] = rows
            return out.permute(0, 3, 1, 2)  # [b,K,h,w]

        return collect(
            probs.to(self.device).float(), scores, self.present, self.config, scale, covered
        )

    def _check_base_features(self, feats: Tensor) -> None:
        """Refuse base features this refiner's head cannot stand on: only a ``base-frozen``
        refiner at input scale 1 embeds the base's own backbone output (the rest would be
        read without an error, and give other labels), and the channels must be its head's."""
        cfg = self.config
        if cfg.backbone_source != "base-frozen" or cfg.input_scale != 1.0:
            raise ConfigError(
                f"this refiner (backbone_source {cfg.backbone_source!r}, input_scale "
                f"{cfg.input_scale:g}) embeds other features than the base's backbone output; "
                "pass features=None, or take them with refiner.shared_features(model), which "
                "keeps none a refiner cannot read"
            )
        conv = next((m for m in self.net.fuse.modules() if isinstance(m, nn.Conv2d)), None)
        if conv is not None and (feats.dim() != 4 or feats.shape[1] != conv.in_channels):
            raise DataError(
                f"base features of shape {tuple(feats.shape)} do not fit this refiner, whose "
                f"head reads {conv.in_channels} channels: they come from another backbone than "
                "the one it was fit on; pass features=None"
            )

    def shared_features(self, model: nn.Module) -> SharedFeatures:
        """A context that keeps ``model``'s backbone output for :meth:`refine`'s
        ``features`` (see :mod:`dualseg.refine.shared`); it keeps nothing when this refiner
        cannot share the base's features, so callers need no check of their own::

            with refiner.shared_features(model) as shared:
                logits = model(images)
                labels = refiner.refine(images, logits, features=shared.take())
        """
        active = can_share(self.config, self.net.backbone, model)
        return SharedFeatures(model, active, self.config.output_stride, self.net.low_level)

    def _refine_batch(
        self,
        images: Tensor,
        probs: Tensor,
        return_changed: bool,
        features: BaseFeatures | tuple[Tensor, tuple[int, int]] | None = None,
    ) -> Any:
        out, changed = decide_as(self.candidates(images, probs, features=features), self.config)
        out = out.to(probs.device)
        return (out, changed.to(probs.device)) if return_changed else out

    # ------------------------------------------------------------------ artifact
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the refiner (weights, prototypes, config, class names) atomically to one file.

        An earlier refiner file there is replaced; a folder, or a file of any other kind (a
        model checkpoint, say), is refused."""
        from dualseg._version import __version__

        _check_refiner_target(Path(path))

        state = {
            "format": FORMAT,
            "version": __version__,
            "config": self.config.to_dict(),
            "model": {k: v.detach().cpu() for k, v in self.net.state_dict().items()},
            "prototypes": self.prototypes.cpu(),
            "present": self.present.cpu(),
            "class_names": list(self.class_names),
            "ignore_index": self.ignore_index,
            "calibration": self.calibration,
            "palette": None if self.palette is None else [list(c) for c in self.palette],
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

        if not os.fspath(path).strip():  # Path("") is the current folder
            raise ConfigError(
                "the refiner path is empty (an unset variable?); pass a refiner file, a refiner "
                "folder or hf://org/name"
            )
        if pretrained.is_folder_source(path):
            return pretrained.load_folder(path, device=device, net=net)
        state = load_state(path, FORMAT, "refiner")
        missing = [k for k in ("model", "prototypes", "present", "config") if k not in state]
        if missing:
            raise CheckpointError(f"{path} lacks {', '.join(missing)}; fit the refiner again")
        tensors = {**state["model"], "prototypes": state["prototypes"]}
        check_finite_refiner(path, tensors)
        return cls.from_stored(
            state, state["model"], state["prototypes"], state["present"], source=path, net=net
        ).to(device)

    @classmethod
    def from_stored(
        cls,
        stored: Mapping[str, Any],
        net_state: Mapping[str, Tensor],
        prototypes: Tensor,
        present: Tensor,
        *,
        source: str | os.PathLike[str],
        net: EmbeddingNet | None = None,
    ) -> BoundaryRefiner:
        """A refiner from its saved parts (a ``.pt``'s dict or a folder's ``refiner.json``,
        and its tensors), each checked; every problem names ``source``."""
        from dualseg.engine.checkpoint import _state_dict_problems

        described = stored_description(stored, source)
        try:
            config = RefinerConfig.from_dict(stored["config"])
        except ConfigError as err:
            raise CheckpointError(f"{source}: {err}") from None
        if net is None:
            net = config.embedding_net()
        if problems := _state_dict_problems(net, net_state):
            raise CheckpointError(
                f"{source}: the embedding weights do not fit the model its config describes "
                f"({'; '.join(problems)}); fit the refiner again"
            )
        net.load_state_dict(net_state)
        k = len(described["class_names"])
        shapes = {"prototypes": (k, config.embed_dim), "present": (k,)}
        for key, tensor in (("prototypes", prototypes), ("present", present)):
            if tuple(tensor.shape) != shapes[key]:
                raise CheckpointError(
                    f"{source}: {key} has shape {tuple(tensor.shape)}, expected "
                    f"{shapes[key]} ({k} classes, embed_dim {config.embed_dim}); fit the "
                    "refiner again"
                )
        refiner = cls(
            net,
            prototypes,
            present,
            class_names=described["class_names"],
            config=config,
            ignore_index=described["ignore_index"],
            palette=described["palette"],
        )
        refiner.calibration = described["calibration"]
        return refiner

    def calibration_note(self) -> str | None:
        """A warning when the held-out check at fit time found that refinement did not help
        the base model it was calibrated on (then the chosen gate 0 changes no pixel)."""
        return calibration_note(self.calibration, self.config)

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
        time_budget_s: float | None = None,
        palette: Sequence[Sequence[int]] | None = None,
        fit_inputs: Mapping[str, Any] | None = None,
    ) -> BoundaryRefiner:
        """Train the embedding model with triplets, then compute the class prototypes.

        ``dataset`` yields ``(image [3,H,W] normalized, label [H,W])`` with training augmentation
        (step 1); ``prototype_dataset`` (default ``dataset``) is streamed once for step 5,
        typically the training images without augmentation. ``weights`` initializes the backbone
        (``"imagenet"``, a file, or ``None``); ``init_from`` then copies the base model's
        backbone tensors over it (:func:`init_backbone_from`). ``checkpoint``: a training-state
        file written every ``checkpoint_every`` steps and at the end; ``resume=True`` continues
        from it. ``time_budget_s``: stop the triplet steps once this many seconds have passed
        (the refiner's ``config.steps`` then records the steps made). ``palette``: the class
        colours stored with the refiner (``refine apply`` draws with them when the base has
        none); default the dataset's ``meta.palette`` when it has one. ``fit_inputs``: plain
        values naming the data, augmentation and base the fit depends on, recorded in the
        training state so that a resume with other ones is refused. The loss history is in
        ``refiner.history``.
        """
        cfg = config or RefinerConfig()
        if cfg.steps < 1:  # an untrained embedding relabels pixels at random
            raise ConfigError(
                f"steps={cfg.steps} fits no embedding, and an untrained one relabels pixels at "
                "random; give steps >= 1 (the spec's reading: 2000)"
            )
        dev = resolve_device(device)
        if cfg.backbone_source != "independent" and init_from is None and net is None:
            raise ConfigError(
                f"backbone_source={cfg.backbone_source!r} takes the base model's backbone: pass "
                "the base model (init_from; on the CLI --base CHECKPOINT)"
            )
        if net is None:
            from dualseg.data.transforms import seeded

            with seeded(cfg.seed):  # the random head (and backbone) too: one seed, one refiner
                net = cfg.embedding_net(weights=weights)
            if init_from is not None:  # the base's whole backbone, or refused
                init_backbone_from(net.backbone, init_from, strict=True)
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
            time_budget_s=time_budget_s,
            fit_inputs=fit_inputs,
        )
        if not history:  # time_budget_s ran out before the first step
            raise ConfigError(
                f"the time budget ({time_budget_s} s) ended before the first triplet step: "
                "give it more time"
            )
        if not any(h.get("num_triplets", 1) for h in history):
            # an untrained embedding would relabel pixels: the reason steps=0 is refused
            raise DataError(
                f"no triplet could be drawn in {len(history)} steps: no training image has "
                "near-boundary pixels of two classes; check the labels and their mapping "
                "(meta.json, --label-map, --ignore-index) and --radius"
            )
        if history and history[-1]["step"] < cfg.steps:  # the time budget stopped it early
            cfg = dataclasses.replace(cfg, steps=int(history[-1]["step"]))
        protos, present = stream_prototypes(
            net,
            prototype_dataset if prototype_dataset is not None else dataset,
            len(class_names),
            radius=cfg.radius,
            edge_method=cfg.edge_method,
            input_scale=cfg.input_scale,
            output_stride=cfg.output_stride,
            ignore_index=ignore_index,
            device=dev,
            num_workers=num_workers,
            progress=progress,
        )
        missing = [n for n, p in zip(class_names, present.tolist()) if not p]
        if len(class_names) - len(missing) < 2:  # nothing to choose between
            raise DataError(
                f"only {len(class_names) - len(missing)} class(es) have near-boundary pixels in "
                "the prototype images; method B chooses among at least two: check the labels "
                "and their mapping (meta.json, --label-map, --ignore-index)"
            )
        if missing:
            log.warning("no near-boundary pixels for %s: these classes get no prototype", missing)
        same = coinciding_prototypes(protos, present, class_names)
        if same:
            log.warning(
                "the prototypes of %s coincide (to 1e-4 of their length): the embedding has "
                "collapsed, and this refiner would pick between these classes on rounding "
                "noise; fit longer (--steps) or from ImageNet weights (--init-backbone imagenet)",
                " and ".join("/".join(pair) for pair in same[:3])
                + (f" and {len(same) - 3} more pairs" if len(same) > 3 else ""),
            )
        if palette is None:
            palette = getattr(getattr(dataset, "meta", None), "palette", None)
        refiner = cls(
            net,
            protos,
            present,
            class_names=class_names,
            config=cfg,
            ignore_index=ignore_index,
            palette=palette,
        )
        refiner.history = history
        return refiner


def coinciding_prototypes(
    prototypes: Tensor, present: Tensor, class_names: Sequence[str], *, rtol: float = 1e-4
) -> list[tuple[str, str]]:
    """The pairs of present classes whose prototypes lie within ``rtol`` of the prototypes'
    mean length of each other: a collapsed embedding (a healthy one keeps its closest pair
    about 0.1 of that length apart; a 3-step fit from random weights, 1e-6)."""
    index = present.nonzero().flatten()
    protos = prototypes[index].float()
    if len(protos) < 2:
        return []
    scale = float(protos.norm(dim=1).mean())
    close = torch.cdist(protos, protos) <= rtol * max(scale, 1e-12)
    rows, cols = torch.triu_indices(len(protos), len(protos), 1)
    return [
        (class_names[int(index[i])], class_names[int(index[j])])
        for i, j in zip(rows.tolist(), cols.tolist())
        if close[i, j]
    ]


def _check_refiner_target(target: Path) -> None:
    """Refuse to :meth:`BoundaryRefiner.save` onto a folder or onto a file that is neither a
    refiner nor an empty or cut-short torch file (a leftover of an interrupted save)."""
    from dualseg.serialization import torch_file_format

    if target.is_dir():
        raise OutputError(f"{target} is a folder; save writes one file (save_pretrained: a folder)")
    if not target.is_file():
        return
    kind = torch_file_format(target)
    if kind not in (FORMAT, ""):
        raise OutputError(
            f"{target} exists and is not a method-B refiner ({kind or 'another kind of file'}); "
            "save never writes over it: choose another path"
        )


def calibration_note(calibration: Mapping[str, Any] | None, config: RefinerConfig) -> str | None:
    """:meth:`BoundaryRefiner.calibration_note` of a refiner's stored calibration and options
    (shared with the exported refiner)."""
    if calibration is None or config.gate_margin != 0:
        return None
    metric = calibration.get("metric", "miou")  # absent from refiners fit before it
    by = "" if metric == "miou" else f" ({metric})"
    return (
        f"this refiner's held-out check ({calibration['images']} images of split "
        f"{calibration['split']!r}) found that refinement did not help{by} the base "
        "model it was fit for: its gate_margin is 0 and it changes no pixel"
    )


def check_finite_refiner(source: str | os.PathLike[str], tensors: Mapping[str, Any]) -> None:
    """Refuse a stored refiner with NaN or infinite weights or prototypes: its distances would
    relabel near-boundary pixels at random, without an error anywhere after."""
    from dualseg.serialization import nonfinite_keys, short_list

    if bad := nonfinite_keys(tensors):
        raise CheckpointError(
            f"{source} holds NaN or infinite values ({short_list(bad, 3)}): its fit diverged; "
            "fit it again (a lower --lr)"
        )


# ImageNet-normalized images lie in -2.12..2.64; far above that is raw 0..255 pixels as floats
# (random test images, or another normalization, may pass 2.64 a little, so only far above)
RAW_PIXELS_ABOVE = 20.0


def check_normalized_batch(images: Tensor | np.ndarray) -> None:
    """The batch form reads ImageNet-normalized floats ``[B,3,H,W]`` (a tensor, or a numpy
    array for the exported refiner): refuse another shape and integer images (raw pixels), and
    warn on floats all in [0, 1] (``to_tensor`` output, which normalization would take below
    0 wherever a channel is darker than its ImageNet mean)."""
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(np.ascontiguousarray(images))
    if images.dim() != 4 or images.shape[1] != 3:
        raise DataError(
            f"refine(images) takes a batch [B,3,H,W] of normalized RGB images, got shape "
            f"{tuple(images.shape)}; pass one image as an HxWx3 uint8 array, a path or a PIL "
            "image instead"
        )
    if not images.is_floating_point():
        raise DataError(
            f"refine(images [B,3,H,W]) takes ImageNet-normalized float images, got {images.dtype}"
            "; pass one image as an HxWx3 uint8 array, a path or a PIL image instead, or "
            "normalize the batch (dualseg.imaging.normalize)"
        )
    lo, hi = map(float, torch.aminmax(images)) if images.numel() else (0.0, 0.0)  # one pass
    if hi > RAW_PIXELS_ABOVE:
        raise DataError(
            f"refine(images [B,3,H,W]): values up to {hi:g} are no ImageNet-normalized image "
            "(those lie in -2.12..2.64), raw 0..255 pixels? normalize the batch "
            "(dualseg.imaging.normalize)"
        )
    if lo >= 0.0 and 0.0 < hi <= 1.0:
        warnings.warn(
            "refine(images [B,3,H,W]): every value lies in [0, 1], which looks like RGB before "
            "ImageNet normalization; the batch form expects normalized images "
            "(dualseg.imaging.normalize)",
            stacklevel=3,
        )


# ---------------------------------------------------------------------- P2-P5, shared
def as_palette(
    palette: Sequence[Sequence[int]] | None, num_classes: int
) -> tuple[tuple[int, int, int], ...] | None:
    """A stored palette as RGB tuples, one per class (``None`` stays ``None``)."""
    if palette is None:
        return None
    rgb = tuple(tuple(int(v) for v in c) for c in palette)
    if len(rgb) != num_classes or any(len(c) != 3 for c in rgb):
        raise ConfigError(
            f"a refiner palette needs one RGB colour per class ({num_classes}), got {len(rgb)}"
        )
    return rgb  # type: ignore[return-value]


def name_differences(theirs: Sequence[str], ours: Sequence[str]) -> str:
    """Where two class lists differ, for a message: up to three ``i: 'a' vs 'b'``, or the two
    counts when one list only extends the other."""
    pairs = enumerate(zip(theirs, ours, strict=False))
    diff = [f"{i}: {a!r} vs {b!r}" for i, (a, b) in pairs if a != b]
    return "; ".join(diff[:3]) or f"{len(theirs)} vs {len(ours)} classes"


def check_classes(
    names: Sequence[str], base_names: Sequence[str] | None, num_classes: int, *, what: str
) -> None:
    """Raise :class:`CheckpointError` when a base model's classes are not a refiner's
    ``names`` (shared by ``BoundaryRefiner`` and the exported refiner)."""
    names = tuple(names)
    if num_classes != len(names):
        raise CheckpointError(
            f"{what} predicts {num_classes} classes but the refiner was fit for "
            f"{len(names)} ({', '.join(names)}); fit a refiner on the base "
            "model's dataset (dualseg refine fit)"
        )
    if base_names is not None and tuple(base_names) != names:
        from dualseg.engine.checkpoint import placeholder_class_names

        if tuple(base_names) == placeholder_class_names(num_classes):
            raise CheckpointError(  # the base's checkpoint stored no names
                f"{what} stores no class names (they read class_0 .. class_{num_classes - 1}), "
                f"so its classes cannot be matched to the refiner's ({', '.join(names)}); save "
                "the base with its dataset's class names, or fit a refiner on it"
            )
        raise CheckpointError(
            f"{what}'s class names differ from the refiner's "
            f"({name_differences(base_names, names)}); "
            "use a refiner fit on the same dataset and class order"
        )


def prototype_scores(feats: Tensor, prototypes: Tensor) -> Tensor:
    """``s_k = |p_k|^2 - 2 e.p_k`` for low-resolution embeddings ``feats [b,C,h,w]``:
    ``[b,K,h,w]``, whose argmin over k is the nearest prototype (Euclidean).

    Why a score map: ``|e - p_k|^2 = |e|^2 - 2 e.p_k + |p_k|^2`` and ``|e|^2`` is the same
    for every k. ``s_k`` is affine in ``e`` and the bilinear weights sum to one, so sampling the
    low-resolution map of ``s`` (K channels) at a pixel equals ``s`` of the sampled
    embedding (C channels): the same labels, without reading C-dim vectors per pixel.
    """
    return prototype_row_scores(feats.movedim(1, -1), prototypes).movedim(-1, 1)


def prototype_row_scores(rows: Tensor, prototypes: Tensor) -> Tensor:
    """:func:`prototype_scores` of embeddings on the last dim (``[...,C]``): ``[...,K]``."""
    p = prototypes  # [K,C]
    return rows.float() @ (-2 * p).T + p.pow(2).sum(1)


def collect(
    probs: Tensor,
    scores: Callable[[Tensor, Tensor], Tensor],
    present: Tensor,
    config: RefinerConfig,
    scale: float = 1.0,
    covered: tuple[float, float] | None = None,
) -> Candidates:
    """P2-P4 and P5's distances with ``config``'s Top-N and mask options. Probabilities that
    are not finite (a diverged base) are refused: NaN ranks as no class and would be relabelled
    as class 0 or at random, silently."""
    if not bool(probs.isfinite().all()):
        raise DataError(
            "the base model's class probabilities hold NaN or infinite values: its weights or "
            "its input are broken (a diverged checkpoint?), or they are log-probabilities of an "
            "exact 0 (-inf); refine the probabilities or logits of a working model"
        )
    return gather_candidates(
        probs,
        scores,
        present,
        top_n=config.top_n,
        radius=config.radius,
        edge_method=config.edge_method,
        scale=scale,
        covered=covered,
    )


def decide_as(c: Candidates, config: RefinerConfig) -> tuple[Tensor, Tensor]:
    """P5 with ``config``'s decision options (the claim by default)."""
    return decide(
        c,
        gate_margin=config.gate_margin,
        prior_weight=config.prior_weight,
        min_prob=config.min_prob,
    )


def relabel(
    probs: Tensor,
    scores: Callable[[Tensor, Tensor], Tensor],
    present: Tensor,
    config: RefinerConfig,
    *,
    scale: float = 1.0,
    covered: tuple[float, float] | None = None,
) -> tuple[Tensor, Tensor]:
    """P2-P5 on class scores ``probs [B,C,H,W]``: ``(labels [B,H,W] int64, changed bool)``.

    ``scores(keep, band)`` returns :func:`prototype_scores` ``[b,K,h,w]`` of the images that
    ``keep`` (bool ``[B]``) selects: those with near-boundary pixels ``band``, so the embedding
    model runs only on them (see :func:`~dualseg.refine.decision.gather_candidates`).
    ``BoundaryRefiner`` runs its ``EmbeddingNet`` there, the exported refiner its
    onnxruntime / TorchScript model. ``scale``: :func:`~dualseg.refine.decision.prototype_scale`
    of the prototypes, the unit of ``config.prior_weight``. ``covered``: the size, in image
    pixels, the score maps span (:func:`~dualseg.refine.embedding.embedding_cover`).
    """
    return decide_as(collect(probs, scores, present, config, scale, covered), config)


def _as_tensor(x: Any) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    raise DataError(f"class probabilities must be a tensor or numpy array, got {type(x).__name__}")


__all__ = [
    "FORMAT",
    "BoundaryRefiner",
    "RefinerConfig",
    "stream_prototypes",
    "train_embedding",
    "triplet_step",
]
