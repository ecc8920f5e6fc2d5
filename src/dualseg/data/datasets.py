"""``SegmentationDataset`` and ``build_dataset``: a layout's pairs (one root or several with the
same classes) with the classes that describe them (a preset or ROOT/meta.json)."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from dualseg.data.contract import LabelContract
from dualseg.data.layouts import (
    Discovery,
    Pair,
    available_splits,
    detect,
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
from dualseg.data.readers import read_label, read_pair
from dualseg.data.transforms import JointTransform, build_eval_transform, sample_seed, seeded
from dualseg.errors import DataError


def resolve_meta(
    root: str | Path,
    layout: str,
    preset: str | DatasetMeta | None,
    *,
    label_map: Mapping[int, int] | None = None,
    ignore_value: IgnoreSetting = "auto",
    found: str = "",
) -> DatasetMeta:
    """The given preset, else ROOT/meta.json, else the layout's preset; then the overrides.
    ``found``: what the scan recognised, said first when no description exists."""
    meta = preset_for(root, preset) if isinstance(preset, str) else preset
    meta = dataset_meta(root, layout=layout) if meta is None else meta
    if meta is None:
        raise DataError(
            f"{root}: {found}no {meta_path(Path(root))} describes the classes (name, class_names, "
            f"palette, label_map): 'dualseg data check {root} --write-meta' writes one from the "
            f"label values to review, or pass --preset (one of {', '.join(sorted(PRESETS))})"
        )
    return with_label_mapping(meta, label_map=label_map, ignore_value=ignore_value)


def meta_path(root: Path) -> Path:
    """ROOT/meta.json (beside the list file when ROOT is one)."""
    return (root.parent if root.is_file() else root) / META_FILE


def preset_for(root: str | Path | None, preset: str) -> DatasetMeta:
    """The preset ``preset``, refused when ROOT/meta.json names other classes or reads a raw
    value as another class (another tool's meta.json does not count)."""
    named = get_preset(preset)
    meta_file = meta_path(Path(root)) if root is not None else None
    try:
        own = load_meta_file(meta_file) if meta_file and meta_file.is_file() else None
    except DataError:
        own = None
    if own is None:
        return named
    ours, theirs = own.lookup_table(), named.lookup_table()
    same = own.class_names == named.class_names
    if not same or ((ours != theirs) & (ours >= 0) & (theirs >= 0)).any():  # a value only one reads
        a, b = (m.describe_mapping() if same else list(m.class_names) for m in (named, own))
        raise DataError(
            f"--preset {preset} {'reads the labels as' if same else 'has the classes'} {a} but "
            f"{meta_file} says {b}; leave --preset out to read {meta_file}, or fix it"
        )
    return named


def dataset_meta(
    root: str | Path, *, layout: str = "auto", split: str = "train"
) -> DatasetMeta | None:
    """The classes ``root`` describes itself (meta.json or its layout's preset), else None."""
    meta_file = meta_path(Path(root))
    if meta_file.is_file():
        return load_meta_file(meta_file)
    return PRESETS.get(detect(Path(root), split) or "" if layout == "auto" else layout)


def check_split_name(split: str) -> None:
    """Refuse an empty split name ("" would read a flat folder of every split)."""
    if not str(split).strip():
        raise DataError(f"split {split!r} is an empty name; give one (e.g. train, val, test)")


class SegmentationDataset(torch.utils.data.Dataset):
    """Image/label pairs -> ``(image float32 [3,H,W] normalized, label int64 [H,W])``.

    ``samples_per_epoch`` resizes an epoch (spec S1): index ``i`` of epoch ``e`` reads pair
    ``(i + e * len) % len(samples)``, so epochs walk on through the pairs. Each index is seeded
    from ``(seed, epoch, i)`` (worker-independent, replayed on resume); call :meth:`set_epoch`.
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
        max_megapixels: float | None = None,
    ) -> None:
        if not samples:
            raise DataError(f"{source or 'dataset'}: the dataset is empty; check ROOT and split")
        if samples_per_epoch is not None and samples_per_epoch < 1:
            raise DataError(f"samples_per_epoch must be >= 1, got {samples_per_epoch}")
        self.samples = list(samples)
        self.meta = meta
        self.transform = transform if transform is not None else build_eval_transform()
        self.label_format = label_format
        self.samples_per_epoch = samples_per_epoch
        self.seed = seed
        self.bit_depth = bit_depth
        self.max_megapixels = max_megapixels
        self.epoch = 0

    def __len__(self) -> int:
        return self.samples_per_epoch or len(self.samples)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def pair_index(self, index: int) -> int:
        """The pair that ``index`` of the current epoch reads."""
        return (index + self.epoch * len(self)) % len(self.samples)

    def load_pair(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The raw pair ``(uint8 HxWx3, uint8 HxW with 255 = ignore)`` of sample ``index``."""
        img, lab = self.samples[index % len(self.samples)]
        return read_pair(img, lab, self.meta, label_format=self.label_format,
                         bit_depth=self.bit_depth, max_megapixels=self.max_megapixels)  # fmt: skip

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        index %= len(self)
        image, label = self.load_pair(self.pair_index(index))
        with seeded(sample_seed(self.seed, index=index, epoch=self.epoch)):
            return self.transform(image, label)


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
    max_megapixels: float | None = None,
) -> SegmentationDataset:
    """``split`` of ``root`` (or of several roots with the same classes, concatenated).

    ``val_fraction`` (0 < f < 1) holds out that share of a root without a val split, chosen by
    file name (:func:`held_out`): ``split="val"`` gets it, ``"train"`` the rest.
    ``bit_depth``: of 16-bit images (None: detected); ``max_megapixels``: the largest image
    read (None: Pillow's limit). ``label_map`` / ``ignore_value``
    override the dataset's label mapping. The first bad file is one DataError.
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
        if found.split_missing and (missing := missing_split(Path(r), split, layout)):
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
    present: set[int] = set()
    for _, label_path in samples[:8] if label_map else ():  # the first labels tell
        present |= set(np.unique(read_label(label_path, meta, label_format=label_format)).tolist())
    if warning := one_class_warning(label_map or {}, present - {meta.ignore_index}, meta):
        warnings.warn(warning, stacklevel=2)
    return SegmentationDataset(
        samples,
        meta,
        transform=transform,
        label_format=label_format,
        samples_per_epoch=samples_per_epoch,
        seed=seed,
        source=source,
        bit_depth=bit_depth,
        max_megapixels=max_megapixels,
    )


def held_out(root: str | Path, found: Discovery, fraction: float, split: str) -> list[Pair]:
    """``split`` of ``found``'s pairs with ``fraction`` held out as val, ranked by a SHA-1 of
    the image's file name (stable across runs and machines)."""
    pairs = found.samples
    if len(pairs) < 2:
        raise DataError(f"{root}: val_fraction needs 2 or more pairs, found {len(pairs)}")
    ranked = sorted(pairs, key=lambda p: (hashlib.sha1(p[0].name.encode()).hexdigest(), p[0]))
    n_val = min(max(1, round(fraction * len(pairs))), len(pairs) - 1)
    chosen = set(ranked[:n_val]) if split == "val" else set(ranked[n_val:])
    return [p for p in pairs if p in chosen]  # in the order found


def one_class_warning(label_map: Mapping[int, int], present: set[int], meta: DatasetMeta) -> str:
    """What to say when ``label_map`` leaves the ``present`` classes one (else "")."""
    if not label_map or len(present) != 1 or meta.num_classes < 2:
        return ""
    cls = min(present)
    return (
        f"--label-map {','.join(f'{s}:{d}' for s, d in label_map.items())} leaves one class: "
        f"every labelled pixel is class {cls} ({meta.class_names[cls]!r}), so a model learns "
        "nothing and scores look fine; map each raw value to its own class (e.g. 255:1)"
    )


def one_class_set(
    metas: list[tuple[Path, DatasetMeta]], *, label_format: str = "index"
) -> DatasetMeta:
    """The roots' shared description; a DataError naming both roots when two read labels
    otherwise (palettes too, for colour labels)."""
    (first_root, first), *rest = metas
    for root, meta in rest:
        a, b = (LabelContract(m, label_format) for m in (first, meta))
        if differ := a.differences(b, sides=(str(first_root), str(root))):
            raise DataError(
                f"cannot mix {first_root} and {root}: {'; '.join(differ)}; give both the same "
                "classes and mapping (meta.json, --data.label_map) or convert one's labels first"
            )
    return first


def label_histogram(dataset: SegmentationDataset) -> tuple[np.ndarray, np.ndarray]:
    """Per class (int64 ``[C]``): labelled pixels, and labelled pixels of the images holding it
    (the two counts of median frequency balancing)."""
    c = dataset.meta.num_classes
    counts = np.zeros(c, np.int64)
    image_pixels = np.zeros(c, np.int64)
    for _, label_path in dataset.samples:
        label = read_label(label_path, dataset.meta, label_format=dataset.label_format)
        hist = np.bincount(label.ravel(), minlength=256)[:c]
        counts += hist
        image_pixels += (hist > 0) * hist.sum()
    return counts, image_pixels
