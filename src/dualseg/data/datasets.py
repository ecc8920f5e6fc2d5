"""``SegmentationDataset`` and ``build_dataset``: the pairs a layout finds
(:mod:`dualseg.data.layouts`) with the classes that describe them (a preset or ROOT/meta.json).

``build_dataset`` also takes several roots (a list): their pairs are concatenated into one
dataset, provided every root has the same classes.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dualseg.data.layouts import (
    LAYOUTS,
    Discovery,
    Pair,
    available_splits,
    detect,
    detect_layout,
    discover,
    missing_split,
)
from dualseg.data.presets import (
    META_FILE,
    PRESETS,
    DatasetMeta,
    IgnoreSetting,
    get_preset,
    load_meta_file,
    with_label_mapping,
)
from dualseg.data.readers import LABEL_FORMATS, read_label, read_pair
from dualseg.data.transforms import JointTransform, build_eval_transform, sample_seed, seeded
from dualseg.errors import DataError

__all__ = ["LAYOUTS", "available_splits", "detect_layout", "discover"]  # re-exported for callers


def size_mismatch(
    img_path: Path, image_hw: tuple[int, ...], label_path: Path, label_hw: tuple[int, ...]
) -> str:
    """The message for a pair whose sizes differ (an EXIF orientation that would turn the image
    and not its label is refused before, by :func:`dualseg.data.readers.read_pair`)."""
    (h, w), (lh, lw) = image_hw, label_hw
    return (
        f"{label_path}: label size {lw}x{lh} differs from image {img_path} size {w}x{h} (WxH); "
        "resize the label with nearest-neighbour or fix the pairing"
    )


def resolve_meta(
    root: str | Path,
    layout: str,
    preset: str | DatasetMeta | None,
    *,
    label_map: Mapping[int, int] | None = None,
    ignore_value: IgnoreSetting = "auto",
) -> DatasetMeta:
    """The dataset's classes: the given preset, else ROOT/meta.json, else the layout's preset;
    then the ``label_map`` / ``ignore_value`` overrides (:func:`with_label_mapping`)."""
    meta = _own_meta(root, layout, preset)
    return with_label_mapping(meta, label_map=label_map, ignore_value=ignore_value)


def meta_path(root: Path) -> Path:
    """ROOT/meta.json (beside the list file when ROOT is one)."""
    return (root.parent if root.is_file() else root) / META_FILE


def _own_meta(root: str | Path, layout: str, preset: str | DatasetMeta | None) -> DatasetMeta:
    if isinstance(preset, DatasetMeta):
        return preset
    if preset is not None:
        return preset_for(root, preset)
    root = Path(root)
    meta_file = meta_path(root)
    if meta_file.is_file():
        return load_meta_file(meta_file)
    if layout in PRESETS:  # voc, cityscapes, ade20k
        return PRESETS[layout]
    raise DataError(
        f"{root}: which classes does this dataset have? pass preset= one of {sorted(PRESETS)} "
        f"(CLI: --preset), or describe them in {meta_file} (name, class_names, palette, and a "
        "label_map when the raw values are not 0..K-1, as in 0/255 masks): 'dualseg data "
        f"check {root} --write-meta' writes one from the label values for you to review"
    )


def preset_for(root: str | Path | None, preset: str) -> DatasetMeta:
    """The preset ``preset`` for the dataset at ``root``: refused (one line, both lists) when
    ROOT/meta.json describes the dataset's classes under other names, since each label value
    would be scored or trained under another class's name; refused too when its label mapping
    reads a raw value as another class or ignore (``reduce_zero_label``, ``ignore_index``,
    ``source_ignore``, ``label_map``): meta.json describes the files as written (dualseg
    augment's ADE20K labels are already reduced). A meta.json that is no dualseg description
    (another tool's file) does not stand in the way: the preset is how to read such a
    dataset."""
    named = get_preset(preset)
    if root is None:
        return named
    root = Path(root)
    meta_file = meta_path(root)
    if not meta_file.is_file():
        return named
    try:
        own = load_meta_file(meta_file)
    except DataError:
        return named
    if tuple(own.class_names) != tuple(named.class_names):
        raise DataError(
            f"--preset {preset} has the classes {list(named.class_names)} but {meta_file} says "
            f"{list(own.class_names)}: every label value would be scored under another name; "
            f"leave --preset out to read {meta_file}, or fix that file"
        )
    ours, theirs = own.lookup_table(), named.lookup_table()
    if ((ours != theirs) & (ours >= 0) & (theirs >= 0)).any():
        # meta.json describes these files (dualseg augment writes ADE20K's labels reduced,
        # reduce_zero_label false): the preset's mapping would shift every class by one. A
        # raw value only one of the two reads (CamVid's 11, which dualseg augment's labels no
        # longer hold) is no conflict.
        differ = [
            f"{key} {_json_value(getattr(named, attr))} vs {_json_value(getattr(own, attr))}"
            for key, attr in _MAPPING_KEYS
            if getattr(named, attr) != getattr(own, attr)
        ]
        raise DataError(
            f"--preset {preset} reads the labels as {named.describe_mapping()} but {meta_file} "
            f"says {own.describe_mapping()} ({'; '.join(differ)}): its label values would be "
            f"read as other classes; leave --preset out to read {meta_file}, or fix that file"
        )
    return named


# the label mapping of a dataset: (meta.json key, DatasetMeta field)
_MAPPING_KEYS = (
    ("reduce_zero_label", "reduce_zero_label"),
    ("ignore_index", "ignore_value"),
    ("source_ignore", "source_ignore"),
    ("label_map", "label_map"),
)


def _json_value(value: Any) -> str:
    """A mapping field as meta.json writes it: true, null, [11], {"255": 1}."""
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):  # label_map pairs
        value = {str(s): d for s, d in value}
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def dataset_meta(
    root: str | Path, *, layout: str = "auto", split: str = "train"
) -> DatasetMeta | None:
    """The classes ``root`` describes itself (ROOT/meta.json, or the VOC / Cityscapes / ADE20K
    layout);
    ``None`` when it does not say (a bad meta.json is still an error)."""
    root = Path(root)
    meta_file = meta_path(root)
    if meta_file.is_file():
        return load_meta_file(meta_file)
    if layout == "auto":
        layout = detect(root, split) or "auto"
    return PRESETS.get(layout)


def check_split_name(split: str) -> None:
    """Refuse an empty split name: "" would read the flat images/ + labels/ of every split."""
    if not str(split).strip():
        raise DataError(f"split {split!r} is an empty name; give one (e.g. train, val, test)")


class SegmentationDataset(torch.utils.data.Dataset):
    """Image/label pairs -> ``(image float32 [3,H,W] normalized, label int64 [H,W])``.

    ``samples_per_epoch`` expands (or shrinks) the dataset on the fly (spec S1): index ``i`` of
    epoch ``e`` reads pair ``(i + e·samples_per_epoch) % len(samples)`` with its own
    augmentation, so the epochs walk on through the pairs and every pair is drawn, each as
    often as any other to within one over the run (an epoch shorter than the dataset would
    otherwise never read its last pairs). Every index has its own seed, derived from
    ``(seed, epoch, i)``, so the stream does not depend on DataLoader workers and a resumed run
    replays it; call :meth:`set_epoch` before each epoch for fresh augmentations (as with
    ``DistributedSampler``; with ``persistent_workers=True`` workers keep the epoch they forked
    with).
    """

    def __init__(
        self,
        samples: list[Pair],
        meta: DatasetMeta,
        *,
        transform: JointTransform | None = None,
        label_format: str = "index",
        samples_per_epoch: int | None = None,
        seed: int = 0,
        source: str | Path = "",
        bit_depth: int | None = None,
    ) -> None:
        if not samples:
            raise DataError(f"{source or 'dataset'}: the dataset is empty; check ROOT and split")
        if label_format not in LABEL_FORMATS:
            raise DataError(f"unknown label_format {label_format!r}; use one of {LABEL_FORMATS}")
        if samples_per_epoch is not None and samples_per_epoch < 1:
            raise DataError(f"samples_per_epoch must be >= 1, got {samples_per_epoch}")
        self.samples = list(samples)
        self.meta = meta
        self.transform = transform if transform is not None else build_eval_transform()
        self.label_format = label_format
        self.samples_per_epoch = samples_per_epoch
        self.seed = seed
        self.bit_depth = bit_depth  # of 16-bit images; None: from their values (imaging)
        self.epoch = 0

    def __len__(self) -> int:
        return self.samples_per_epoch or len(self.samples)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def pair_index(self, index: int) -> int:
        """The pair that index ``index`` of the current epoch reads: the epochs go on through
        the pairs where the last one stopped (``index`` itself without samples_per_epoch)."""
        return (index + self.epoch * len(self)) % len(self.samples)

    def load_pair(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The raw pair ``(uint8 HxWx3, uint8 HxW with 255 = ignore)`` of sample ``index``."""
        img_path, label_path = self.samples[index % len(self.samples)]
        image, label = read_pair(
            img_path,
            label_path,
            self.meta,
            label_format=self.label_format,
            bit_depth=self.bit_depth,
        )
        if image.shape[:2] != label.shape:
            raise DataError(size_mismatch(img_path, image.shape[:2], label_path, label.shape))
        return image, label

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        index %= len(self)
        image, label = self.load_pair(self.pair_index(index))
        with seeded(sample_seed(self.seed, index=index, epoch=self.epoch)):
            return self.transform(image, label)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.meta.name}, {len(self.samples)} pairs, "
            f"len={len(self)}, transform={self.transform!r})"
        )


Roots = str | Path | Sequence[str | Path]


def build_dataset(
    root: Roots,
    *,
    split: str = "train",
    layout: str = "auto",
    preset: str | DatasetMeta | None = None,
    transform: JointTransform | None = None,
    label_format: str = "index",
    samples_per_epoch: int | None = None,
    seed: int = 0,
    label_map: Mapping[int, int] | None = None,
    ignore_value: IgnoreSetting = "auto",
    val_fraction: float = 0.0,
    bit_depth: int | None = None,
) -> SegmentationDataset:
    """Scan ``root`` and return its ``split`` as a :class:`SegmentationDataset`.

    ``val_fraction`` (0 < f < 1) holds out that share of a root with one set of pairs (no val
    split of its own): ``split="val"`` gets it, ``"train"`` the rest, chosen by file name
    (:func:`held_out`), so every run and machine draws the same; 0: the splits on disk.
    ``bit_depth``: of 16-bit images (:func:`dualseg.imaging.image_to_rgb`; None: detected).

    ``root`` may be a list of roots: their pairs are concatenated (in order) into one dataset;
    all roots must have the same classes (else a :class:`DataError` naming both class lists).
    Raises one :class:`DataError` naming the first bad file (and how many more there are) when
    listed files are missing; ``transform=None`` means :func:`build_eval_transform`.
    ``label_map`` / ``ignore_value`` override the dataset's label mapping
    (:func:`dualseg.data.presets.with_label_mapping`).
    """
    roots = [root] if isinstance(root, str | Path) else list(root)
    if not roots:
        raise DataError("no dataset root given; pass at least one folder")
    check_split_name(split)
    if not 0 <= val_fraction < 1 or (val_fraction and split not in ("train", "val")):
        raise DataError(
            f"val_fraction {val_fraction} with split {split!r}: give 0 <= val_fraction < 1, "
            "and split train or val"
        )
    samples: list[Pair] = []
    metas: list[tuple[Path, DatasetMeta]] = []
    source: str | Path = roots[0]
    for r in roots:
        if val_fraction and "val" in available_splits(r, layout):
            raise DataError(
                f"{r}: has a val split of its own, so val_fraction {val_fraction} would hold "
                "out images of another split; set val_fraction to 0 (or merge the splits)"
            )
        found = discover(r, split="train" if val_fraction else split, layout=layout)
        if found.split_missing:
            missing = missing_split(Path(r), split, layout)
            if missing is not None:
                raise missing
        if found.problems:
            more = len(found.problems) - 1
            raise DataError(
                found.problems[0]
                + (f" (and {more} more problems; run 'dualseg data check {r}')" if more else "")
            )
        meta = resolve_meta(r, found.layout, preset, label_map=label_map, ignore_value=ignore_value)
        metas.append((Path(r), meta))
        if val_fraction:
            found.samples = held_out(r, found, val_fraction, split)
        samples += found.samples
        source = (found.source or r) if len(roots) == 1 else ", ".join(map(str, roots))
    meta = one_class_set(metas, label_format=label_format)
    if label_map:
        _warn_one_class(samples, meta, label_format, label_map)
    return SegmentationDataset(
        samples,
        meta,
        transform=transform,
        label_format=label_format,
        samples_per_epoch=samples_per_epoch,
        seed=seed,
        source=source,
        bit_depth=bit_depth,
    )


def held_out(root: str | Path, found: Discovery, fraction: float, split: str) -> list[Pair]:
    """``split`` of ``found``'s pairs when ``fraction`` of them is held out for validation:
    the pairs ranked by a SHA-1 of the image's file name (stable, unlike ``hash()``), the
    first ``round(fraction * n)`` (at least 1) are val, the rest train."""
    pairs = found.samples
    if len(pairs) < 2:
        raise DataError(f"{root}: val_fraction needs 2 or more pairs, found {len(pairs)}")
    ranked = sorted(pairs, key=lambda p: (hashlib.sha1(p[0].name.encode()).hexdigest(), p[0]))
    n_val = min(max(1, round(fraction * len(pairs))), len(pairs) - 1)
    chosen = set(ranked[:n_val]) if split == "val" else set(ranked[n_val:])
    return [p for p in pairs if p in chosen]  # in the order found


def _warn_one_class(
    samples: list[Pair], meta: DatasetMeta, label_format: str, label_map: Mapping[int, int]
) -> None:
    """Warn when an explicit ``label_map`` leaves one class in the first labels: a model
    trained on them learns nothing, and its scores still look like a result."""
    present: set[int] = set()
    for _, label_path in samples[:8]:
        label = read_label(label_path, meta, label_format=label_format)
        present |= set(np.unique(label).tolist()) - {meta.ignore_index}
    if len(present) == 1 and meta.num_classes > 1:
        shown = ",".join(f"{s}:{d}" for s, d in label_map.items())
        warnings.warn(
            f"label map {shown} leaves one class: every labelled pixel of the first labels is "
            f"class {meta.class_names[present.pop()]!r}; map each raw value to its own class "
            "(e.g. 255:1 for 0/255 masks)",
            stacklevel=3,
        )


def one_class_set(
    metas: list[tuple[Path, DatasetMeta]], *, label_format: str = "index"
) -> DatasetMeta:
    """The roots' shared description; a :class:`DataError` when two differ (in their palettes
    too, for colour-coded labels: every root is decoded through the first one's)."""
    (first_root, first), *rest = metas
    for root, meta in rest:
        if meta.class_names != first.class_names:
            raise DataError(
                f"cannot mix datasets with different classes: {first_root} has "
                f"{list(first.class_names)} but {root} has {list(meta.class_names)}; remap "
                "the labels to one class set (or pass the same preset=) before mixing them"
            )
        if label_format == "color" and (meta.palette, meta.void_colors) != (
            first.palette,
            first.void_colors,
        ):
            what = "palettes" if meta.palette != first.palette else "void colours"
            raise DataError(
                f"cannot mix {first_root} and {root} with colour-coded labels: same classes, "
                f"but their {what} differ, so one root's colours would decode as the other's "
                "classes; give both the same palette and void_colors (meta.json) or convert "
                "one's labels first"
            )
        if replace(meta, name=first.name, palette=first.palette) != first:
            raise DataError(
                f"cannot mix {first_root} and {root}: same classes, but their raw labels differ "
                f"(label mapping {first.describe_mapping()} vs {meta.describe_mapping()}); "
                "give both the same mapping (meta.json, --data.label_map) or convert one first"
            )
    return first


def label_histogram(dataset: SegmentationDataset) -> tuple[np.ndarray, np.ndarray]:
    """Per class, over ``dataset``'s label files (no augmentation): the labelled pixels, and
    the labelled pixels of the images in which the class appears (int64 ``[C]`` each) — the
    two counts of median frequency balancing."""
    c = dataset.meta.num_classes
    counts = np.zeros(c, np.int64)
    image_pixels = np.zeros(c, np.int64)
    for _, label_path in dataset.samples:
        label = read_label(label_path, dataset.meta, label_format=dataset.label_format)
        hist = np.bincount(label.ravel(), minlength=256)[:c]
        counts += hist
        image_pixels += (hist > 0) * hist.sum()
    return counts, image_pixels
