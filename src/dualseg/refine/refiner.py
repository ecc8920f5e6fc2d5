"""BoundaryRefiner: method B end to end, fit (steps 1-5) and refine (P1-P5)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dualseg.engine.checkpoint import _state_dict_problems
from dualseg.engine.distributed import resolve_device
from dualseg.engine.predict import as_rgb_array
from dualseg.engine.pretrained import is_hub_source
from dualseg.errors import CheckpointError, ConfigError, DataError
from dualseg.imaging import normalize
from dualseg.models.base import eval_mode
from dualseg.refine import formats, pretrained
from dualseg.refine.base import pairing_notes
from dualseg.refine.calibrate import calibrated_on, calibration_note
from dualseg.refine.config import RefinerConfig
from dualseg.refine.decision import (
    Candidates,
    decide,
    gather_candidates,
    kept_rows,
    prototype_row_scores,
    prototype_scale,
    prototype_scores,
)
from dualseg.refine.embedding import (
    EmbeddingNet,
    embed_backbone,
    embedding_cover,
    p1_filter,
    tap_embedding_net,
)
from dualseg.refine.fit import check_prototypes, embedding_net, prepare_net, train_embedding
from dualseg.refine.inputs import (
    as_tensor,
    check_classes,
    check_normalized_batch,
    check_normalized_values,
)
from dualseg.refine.prototypes import stream_prototypes
from dualseg.refine.shared import (
    BaseFeatures,
    SharedFeatures,
    can_share,
    matching,
    weights_key,
)
from dualseg.refine.taps import TapReader, TapRecord, base_logits


class BoundaryRefiner:
    """Re-labels a base model's near-boundary pixels by nearest class prototype (P1-P5)."""

    def __init__(
        self, net: EmbeddingNet | None, prototypes: Tensor, present: Tensor, *,
        class_names: Sequence[str], config: RefinerConfig | None = None, ignore_index: int = 255,
        palette: Sequence[Sequence[int]] | None = None, taps: TapRecord | None = None,
    ) -> None:  # fmt: skip
        self.taps = taps  # a tap refiner's base modules (low, high), else None
        self.config = config or RefinerConfig(embed_dim=int(prototypes.shape[1]))
        self.class_names = tuple(str(n) for n in class_names)
        self.config.check_switches(self.num_classes, "pass pairs of indices into class_names")
        self.palette = None if palette is None else tuple(tuple(map(int, c)) for c in palette)
        if self.palette and (
            len(self.palette) != self.num_classes or {len(c) for c in self.palette} != {3}
        ):
            raise ConfigError(
                f"a refiner palette needs one RGB colour per class ({self.num_classes})"
            )
        # None: an exported refiner's runner; channels-last: see EmbeddingNet._layout
        self.net = net if net is None else net.eval().to(memory_format=torch.channels_last)
        self.prototypes = prototypes.float()
        self.present = present.bool()
        self.ignore_index = ignore_index
        # the gate sweep of ``refine fit --calibrate-split``: {"split", "images", "rows"}
        self.calibration: dict[str, Any] | None = None
        # how the fit's data was read (LabelContract.to_dict()), else None: unknown
        self.label_contract: dict[str, Any] | None = None
        self._share: tuple[tuple[Any, ...], bool] | None = None  # (weights_key, can_share)

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
        on = f"taps {'+'.join(self.taps.names)}" if self.taps else c.backbone
        return (
            f"{type(self).__name__}({on}, C={c.embed_dim}, {self.num_classes} classes "
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
        self, images: Any, probs: Any = None, *, base: Any = None, return_changed: bool = False,
        features: BaseFeatures | tuple[Tensor, tuple[int, int]] | None = None,
    ) -> Tensor | np.ndarray | tuple[Any, Any]:  # fmt: skip
        """Refined label map(s): a batch (tensor or numpy, as ``probs``; with ``base=``, as
        ``images``) or one image (numpy ``HxW``)."""
        if (probs is None) == (base is None):
            raise ConfigError("refine needs the base's scores (probs) or the base model (base=)")
        batch = isinstance(images, np.ndarray | Tensor) and images.ndim == 4
        if batch:  # numpy too: the exported refiner's batch form
            check_normalized_batch(images)
            x = as_tensor(images)
        else:
            x = torch.from_numpy(normalize([as_rgb_array(images)]))
        as_numpy = isinstance(images if base is not None else probs, np.ndarray)
        if base is not None:  # run here, its features read where it is a model
            x = x.to(self.device)
            module = base if isinstance(base, nn.Module) else None
            null = contextlib.nullcontext()
            with self.shared_features(module) if module is not None else null as shared:
                with eval_mode(module) if module is not None else null:
                    probs = base_logits(base, x)
                features = shared.take(x) if shared is not None else None
        p = as_tensor(probs)
        p = p[None] if not batch and p.dim() == 3 else p
        cfg = self.config
        out = decide(self.candidates(x, p, features=features), gate_margin=cfg.gate_margin,
                     prior_weight=cfg.prior_weight, min_prob=cfg.min_prob,
                     switch_cost=cfg.switch_cost,
                     blocked_switches=cfg.blocked_switches)  # fmt: skip
        labels, changed = (t.to(p.device) for t in out)
        if not batch:
            labels, changed = labels[0].cpu().numpy(), changed[0].cpu().numpy()
        elif as_numpy:
            labels, changed = labels.cpu().numpy(), changed.cpu().numpy()
        return (labels, changed) if return_changed else labels

    @torch.no_grad()  # distances to decide by, never a graph over the embedding
    def candidates(
        self, images: Tensor, probs: Tensor, *, p1_blur_sigma: float | None = None,
        features: BaseFeatures | tuple[Tensor, tuple[int, int]] | None = None,
    ) -> Candidates:  # fmt: skip
        """P1-P4 and P5's distances for a batch (``images [B,3,H,W]`` normalized, ``probs
        [B,C,H,W]``), before any decision: what :mod:`dualseg.refine.calibrate` sweeps."""
        if (
            probs.dim() != 4
            or probs.shape[0] != images.shape[0]
            or (probs.shape[-2:] != images.shape[-2:])
        ):
            fix = (
                "they look channels-last [H,W,C]: pass them as [C,H,W]"
                if probs.dim() == 4 and probs.shape[1:3] == images.shape[-2:]
                else "resize the base model's output to the image size"
            )
            raise DataError(
                f"class probabilities {tuple(probs.shape)} do not match images "
                f"{tuple(images.shape)}; {fix}"
            )
        self.check_classes(None, probs.shape[1])
        images = images.to(self.device)
        cfg = self.config
        sigma = cfg.p1_blur_sigma if p1_blur_sigma is None else p1_blur_sigma
        if features is not None:
            self._check_base_features(BaseFeatures(*features).features, sigma)
            # not this batch's own backbone output (resized, tiled, half precision): run our own
            features = matching(
                features, images, cfg.output_stride, needs_low=self.net.decoder is not None,
                low_stride=self.taps.strides[0] if self.taps else 4,
            )  # fmt: skip
        if features is None:  # the embedding reads the pixels (shared features leave them be)
            check_normalized_values(images)
        # the base's padded input, else what the embedding's own padded input spans
        covered = features.covered if features is not None else self._cover(images.shape[-2:])
        return gather_candidates(
            probs.to(self.device).float(),
            lambda keep, band: self._scores(images, keep, band, sigma, features, covered),
            self.present, top_n=cfg.top_n, radius=cfg.radius, edge_method=cfg.edge_method,
            scale=prototype_scale(self.prototypes, self.present), covered=covered,
        )  # fmt: skip

    def _cover(self, size: tuple[int, int]) -> tuple[float, float]:
        return embedding_cover(size, self.config.input_scale, self.config.output_stride)

    def _scores(
        self, images: Tensor, keep: Tensor, band: Tensor, sigma: float,
        features: BaseFeatures | None, covered: tuple[float, float],
    ) -> Tensor:  # fmt: skip
        """Prototype scores ``[b,K,h,w]`` of the ``keep`` images, whose ``band`` is read."""
        if features is not None:  # the base's own backbone output: only the head runs
            local = kept_rows(features.features.to(self.device), keep)
            low = features.low
            low = None if low is None else kept_rows(low.to(self.device), keep)
        else:
            x = p1_filter(kept_rows(images, keep).float(), sigma)  # P1 (after normalization)
            local, low = embed_backbone(self.net, x, self.config.input_scale,
                                        self.config.output_stride)  # fmt: skip
        if self.net.decoder is None:
            return prototype_scores(self.net.head(local, low), self.prototypes)
        # with a decoder: only the stride-4 cells the band's pixels sample, zeros elsewhere
        at = EmbeddingNet.sampled_cells(band, low.shape[-2:], covered)
        rows = prototype_row_scores(self.net.head_at(local, low, at), self.prototypes)
        out = rows.new_zeros(*at.shape, rows.shape[1])  # [b,h,w,K]
        out[at] = rows
        return out.permute(0, 3, 1, 2)  # [b,K,h,w]

    def _check_base_features(self, feats: Tensor, sigma: float) -> None:
        """Only a ``base-frozen`` refiner at input scale 1 and no P1 blur reads the base's
        backbone output, of its head's channels (else other labels, without an error)."""
        cfg = self.config
        if sigma != 0:
            raise ConfigError("shared base features carry no P1 blur: refine with p1_blur_sigma 0")
        if cfg.backbone_source != "base-frozen" or cfg.input_scale != 1.0:
            raise ConfigError(
                f"this refiner ({cfg.backbone_source}, input_scale {cfg.input_scale:g}) embeds "
                "other features than the base's backbone output; pass features=None"
            )
        conv = next(m for m in self.net.fuse.modules() if isinstance(m, nn.Conv2d))
        if feats.dim() != 4 or feats.shape[1] != conv.in_channels:
            raise DataError(
                f"base features {tuple(feats.shape)} do not fit this refiner, whose head reads "
                f"{conv.in_channels} channels; pass features=None"
            )

    def shared_features(self, model: nn.Module) -> SharedFeatures | TapReader:
        """A context keeping ``model``'s features for :meth:`refine`'s ``features`` (nothing
        when this refiner cannot read them)."""
        if self.taps is not None:  # the taps are read in this very forward
            self.net.backbone.attach(model)
            return TapReader(model, self.taps)
        # comparing every weight costs ~4% of a forward: once per state of both models
        key = weights_key(model, self.net.backbone)
        if self._share is None or self._share[0] != key:
            self._share = (key, can_share(self.config, self.net.backbone, model))
        active = self._share[1]
        return SharedFeatures(model, active, self.config.output_stride, self.net.low_level)

    # ------------------------------------------------------------------ files
    def description(self) -> dict[str, Any]:
        """Everything but the weights and prototypes, as plain JSON values."""
        return {
            "config": self.config.to_dict(),
            "class_names": list(self.class_names),
            "ignore_index": self.ignore_index,
            "calibration": self.calibration,
            "palette": None if self.palette is None else [list(c) for c in self.palette],
            "taps": None if self.taps is None else self.taps.to_dict(),
            "label_contract": self.label_contract,
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the refiner (weights, prototypes, config, class names) atomically to one file."""
        parts = (self.net.state_dict(), self.prototypes, self.present)
        return formats.save_refiner_file(path, self.description(), *parts)

    def save_pretrained(self, folder: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write ``folder/refiner.json`` + ``folder/refiner.safetensors`` (weights only)."""
        parts = (self.net.state_dict(), self.prototypes, self.present)
        return pretrained.save_folder(folder, self.description(), *parts, overwrite=overwrite)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, device: str | torch.device = "cpu",
        net: EmbeddingNet | None = None,
    ) -> BoundaryRefiner:  # fmt: skip
        """Load a refiner file (``weights_only=True``), a refiner folder (``refiner.json`` +
        ``refiner.safetensors``) or ``hf://org/name``."""
        if os.fspath(path).strip() and (is_hub_source(path) or Path(path).is_dir()):
            stored = pretrained.read_folder(path)
        else:
            stored = formats.read_refiner_file(path)
        return cls.from_stored(stored, net=net).to(device)

    @classmethod
    def from_stored(
        cls, stored: formats.StoredRefiner, *, net: EmbeddingNet | None = None
    ) -> BoundaryRefiner:
        """A refiner from its saved parts, each checked; every problem names the source."""
        source = stored.source
        described = formats.stored_description(stored.description, source)
        config = described["config"]
        taps = None if described["taps"] is None else TapRecord.from_dict(described["taps"])
        if net is None and taps is not None:
            net = tap_embedding_net(taps, embed_dim=config.embed_dim, aspp_rates=config.aspp_rates,
                                    decoder_channels=config.decoder_channels)  # fmt: skip
        net = embedding_net(config) if net is None else net
        if problems := _state_dict_problems(net, stored.net_state):
            raise CheckpointError(
                f"{source}: the embedding weights do not fit the model its config describes "
                f"({'; '.join(problems)}); fit the refiner again"
            )
        net.load_state_dict(stored.net_state)
        k = len(described["class_names"])
        for key, want in (("prototypes", (k, config.embed_dim)), ("present", (k,))):
            if tuple(getattr(stored, key).shape) != want:
                got = tuple(getattr(stored, key).shape)
                raise CheckpointError(f"{source}: {key} has shape {got}, expected {want}")
        try:  # the options read against the classes: a blocked switch names one of them
            refiner = cls(net, stored.prototypes, stored.present,
                          class_names=described["class_names"], config=config,
                          ignore_index=described["ignore_index"], palette=described["palette"],
                          taps=taps)  # fmt: skip
        except ConfigError as err:
            raise CheckpointError(f"{source}: {err}; fit the refiner again") from None
        refiner.calibration = described["calibration"]
        refiner.label_contract = described["label_contract"]
        return refiner

    def calibration_note(self) -> str | None:
        """A warning when the held-out check at fit time found that refinement did not help."""
        return calibration_note(self.calibration, self.config)

    # ------------------------------------------------------------------ training (steps 1-5)
    @classmethod
    def fit(
        cls, dataset: torch.utils.data.Dataset, *, class_names: Sequence[str],
        config: RefinerConfig | None = None,
        prototype_dataset: torch.utils.data.Dataset | None = None,
        weights: str | os.PathLike[str] | None = "imagenet",
        init_from: nn.Module | Mapping[str, Tensor] | None = None, base: nn.Module | None = None,
        base_features: Sequence[str] | str | None = None, device: str | torch.device = "cpu",
        num_workers: int = 0,
        checkpoint: str | os.PathLike[str] | None = None, checkpoint_every: int = 200,
        resume: bool = False, progress: bool = True, log_every: int = 0, ignore_index: int = 255,
        time_budget_s: float | None = None, palette: Sequence[Sequence[int]] | None = None,
        fit_inputs: Mapping[str, Any] | None = None,
    ) -> BoundaryRefiner:  # fmt: skip
        """Train the embedding model with triplets, then compute the class prototypes."""
        config = config or RefinerConfig()
        if base_features is not None:
            names = (base_features,) if isinstance(base_features, str) else tuple(base_features)
            config = dataclasses.replace(config, base_features=names)
        if config.backbone_source != "independent" and not config.base_features:
            init_from = base if init_from is None else init_from
        device = resolve_device(device)
        config, net, taps = prepare_net(config, base=base, init_from=init_from, weights=weights,
                                        device=device)  # fmt: skip
        history = train_embedding(
            net, dataset, config, class_names=class_names, device=device,
            num_workers=num_workers, progress=progress, ignore_index=ignore_index,
            time_budget_s=time_budget_s, checkpoint=checkpoint, checkpoint_every=checkpoint_every,
            resume=resume, log_every=log_every, fit_inputs=fit_inputs,
        )  # fmt: skip
        if history[-1]["step"] < config.steps:  # the time budget stopped it early
            config = dataclasses.replace(config, steps=int(history[-1]["step"]))
        protos, present = stream_prototypes(
            net, dataset if prototype_dataset is None else prototype_dataset, len(class_names),
            radius=config.radius, edge_method=config.edge_method, input_scale=config.input_scale,
            output_stride=config.output_stride, ignore_index=ignore_index, device=device,
            num_workers=num_workers, progress=progress,
        )  # fmt: skip
        check_prototypes(protos, present, class_names)
        if palette is None:
            palette = getattr(getattr(dataset, "meta", None), "palette", None)
        refiner = cls(net, protos, present, class_names=class_names, config=config,
                      ignore_index=ignore_index, palette=palette, taps=taps)  # fmt: skip
        refiner.history = history
        return refiner


def evaluation_notes(
    refiner: Any, model: nn.Module, images: Sequence[Any], *, class_names: Sequence[str],
    contract: Any, refiner_name: str, model_name: str,
) -> list[str]:  # fmt: skip
    """Check ``refiner`` against the ``model`` scoring ``images`` (classes, label contract: one
    error line each); the warnings to show: calibrated on another base, a held-out check that
    found it did not help, decision options chosen on some of these images."""
    what = f"{model_name} (refiner {refiner_name})"
    refiner.check_classes(class_names, len(class_names), what=what)
    formats.check_contract(refiner, contract, refiner_name=refiner_name, model_name=model_name)
    # after the checks: a refused pair reads no image and gets one line
    notes = pairing_notes(refiner, model, refiner_name)
    split = (refiner.calibration or {}).get("split")
    if shared := calibrated_on(refiner.calibration, images):
        notes.append(f"warning: {refiner_name}'s decision options were chosen on {shared} of "
                     f"the {len(images)} images evaluated here (its calibration split, {split}): "
                     "its refined scores are optimistic")  # fmt: skip
    return notes
