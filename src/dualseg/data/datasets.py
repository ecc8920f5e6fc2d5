"""Segmentation datasets: four on-disk layouts, one ``SegmentationDataset``.

Layouts (``layout=`` or detected by ``"auto"``):

- ``list``: a text file with ``image_path label_path`` per line, relative to the file's folder
  (``ROOT/{split}.txt``, or ``root`` is the list file itself) — the CamVid/SegNet format.
- ``folder``: ``images/`` and ``labels/`` (or ``masks/``) matched by file stem; searched as
  ``ROOT/{split}/images``, ``ROOT/images/{split}``, then a flat ``ROOT/images`` (any split,
  unless ROOT names splits of its own: list files or split subfolders; then a split it lacks
  is a "has no split" error listing those it has).
- ``voc``: ``JPEGImages/``, ``SegmentationClass/``, ``ImageSets/Segmentation/{split}.txt``.
- ``cityscapes``: ``leftImg8bit/{split}/*/*_leftImg8bit.png`` with
  ``gtFine/{split}/*/*_gtFine_labelTrainIds.png``.
- ``ade20k``: ``ADEChallengeData2016/images/{training,validation}/*.jpg`` with
  ``annotations/{training,validation}/*.png`` (ROOT may be the ``ADEChallengeData2016`` folder
  or its parent; splits ``train`` / ``val`` name ``training`` / ``validation``).

``build_dataset`` also takes several roots (a list): their pairs are concatenated into one
dataset, provided every root has the same classes.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

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

LAYOUTS = ("auto", "list", "folder", "voc", "cityscapes", "ade20k")
# what the readers read (GIF: palette labels some annotation tools export)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp", ".gif")
Pair = tuple[Path, Path]


@dataclass
class Discovery:
    """What a layout scan found: the pairs, the problems (each naming a file), the layout."""

    layout: str
    samples: list[Pair] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    source: Path | None = None  # the list file or folder the samples came from
    split_missing: bool = False  # the split's list file / folder does not exist at all


def _list_lines(list_file: Path) -> list[str]:
    """A list file's lines: UTF-8, a leading byte-order mark (Windows Notepad's) dropped."""
    try:
        return list_file.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(
            f"{list_file}: not UTF-8 text (byte {err.start}); save the list file as UTF-8"
        ) from None


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


def _is_stem(token: str) -> bool:
    """Whether a list file's one-token line is a file stem (mmsegmentation's split files:
    ``ADE_train_00000001``), not an image path whose label column is missing."""
    return (
        "/" not in token and "\\" not in token and Path(token).suffix.lower() not in IMAGE_SUFFIXES
    )


def _stem_dirs(list_file: Path) -> tuple[Path, Path] | None:
    """The ``(images, labels)`` folders a stem list's stems are found in: the folder layout's
    for the list's split (``images/{split}``, ``{split}/images``, else the flat ``images/``)."""
    return _folder_pair_dirs(list_file.parent, list_file.stem, lists=False)


def _files_by_stem(folder: Path) -> dict[str, list[Path]]:
    by_stem: dict[str, list[Path]] = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."):
            by_stem.setdefault(p.stem, []).append(p)
    return by_stem


def _stem_pair(
    list_file: Path, n: int, stem: str, found: Discovery, cache: dict[str, Any]
) -> Pair | None:
    """The image and label of a stem list's line ``n`` (one problem each when not found)."""
    if "dirs" not in cache:
        cache["dirs"] = dirs = _stem_dirs(list_file)
        cache["files"] = [_files_by_stem(d) for d in dirs] if dirs else None
    dirs, files = cache["dirs"], cache["files"]
    where = f"{list_file}:{n}"
    if dirs is None:
        found.problems.append(
            f"{where}: {stem!r} is a file stem, found in images/ + labels/ (or masks/) beside "
            f"{list_file.name}, which {list_file.parent} lacks; add those folders, or write the "
            "line as 'image_path label_path'"
        )
        return None
    pair = []
    for folder, by_stem in zip(dirs, files):
        paths = by_stem.get(stem, [])
        if len(paths) != 1:
            found.problems.append(
                f"{where}: stem {stem!r} is "
                + (f"{len(paths)} files in {folder} ({', '.join(p.name for p in paths)}); keep one"
                   if paths else f"in no file of {folder}; add it or remove the line")
            )  # fmt: skip
            return None
        pair.append(paths[0])
    return pair[0], pair[1]


def _read_list(list_file: Path, found: Discovery) -> None:
    base = list_file.parent
    stems: dict[str, Any] = {}  # the folders of a stem list, read once
    for n, line in enumerate(_list_lines(list_file), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) == 1 and _is_stem(parts[0]):
            if (stem_pair := _stem_pair(list_file, n, parts[0], found, stems)) is not None:
                found.samples.append(stem_pair)
            continue
        if len(parts) > 2:  # "images/a b.png labels/a b.png": no way to tell where a path ends
            found.problems.append(
                f"{list_file}:{n}: {len(parts)} fields where 'image_path label_path' takes 2 "
                f"({line!r}): a path in a list file cannot hold a space; rename the file (e.g. "
                "spaces to _) and its line"
            )
            continue
        if len(parts) != 2:
            found.problems.append(
                f"{list_file}:{n}: expected 'image_path label_path', got {line!r}; "
                "write one pair per line, separated by a space"
            )
            continue
        pair = (base / parts[0], base / parts[1])
        missing = [p for p in pair if not p.is_file()]
        for p in missing:
            found.problems.append(
                f"{p}: listed in {list_file}:{n} but not found; fix the path or remove the line"
            )
        if not missing:
            found.samples.append(pair)


def _scan_list(root: Path, split: str) -> Discovery:
    list_file = root if root.is_file() else root / f"{split}.txt"
    found = Discovery("list", source=list_file)
    if not list_file.is_file():
        found.split_missing = True
        found.problems.append(f"{list_file}: list file not found; create it or pass another split")
    else:
        _read_list(list_file, found)
    return found


def _images_by_stem(folder: Path, problems: list[str]) -> dict[str, Path]:
    """The folder's image files by stem; files sharing a stem (``a.jpg`` and ``a.png``) cannot
    be paired by name: each such stem is a problem, and none of its files is used."""
    by_stem: dict[str, list[Path]] = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."):
            by_stem.setdefault(p.stem, []).append(p)
    for stem, paths in by_stem.items():
        if len(paths) > 1:
            problems.append(
                f"{folder}: {', '.join(p.name for p in paths)} share the name {stem!r}, so "
                "which one pairs is ambiguous; keep one of them"
            )
    return {stem: paths[0] for stem, paths in by_stem.items() if len(paths) == 1}


def _label_dir(images: Path) -> Path | None:
    """``labels/`` (or ``masks/``) beside ``images/``, with the same subfolder, if present."""
    base, sub = images.parent, ""
    if images.name != "images":  # ROOT/images/{split}
        base, sub = images.parent.parent, images.name
    for name in ("labels", "masks"):
        if (base / name / sub).is_dir():
            return base / name / sub
    return None


def _is_list_file(path: Path) -> bool:
    """Whether ``path``'s first entry is an ``image_path label_path`` line, or the stem of an
    image of the split's folder (a stem list): a split's list."""
    try:
        with path.open(encoding="utf-8-sig") as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    parts = line.split()
                    if len(parts) == 1 and _is_stem(parts[0]):
                        dirs = _stem_dirs(path)
                        return dirs is not None and any(dirs[0].glob(f"{glob.escape(parts[0])}.*"))
                    return len(parts) == 2 and all(
                        Path(x).suffix.lower() in IMAGE_SUFFIXES for x in parts
                    )
    except (OSError, UnicodeDecodeError):
        return False
    return False


def _declares_splits(root: Path, *, lists: bool = True) -> bool:
    """Whether ``root`` names splits of its own beside a flat ``images/`` folder: split
    subfolders (``ROOT/{s}/images``, ``ROOT/images/{s}`` with their labels) or, with
    ``lists``, list files (``ROOT/*.txt`` of ``image label`` lines). Then the flat folder is
    no stand-in for a split it does not have."""
    if not root.is_dir():
        return False
    for d in root.iterdir():
        if d.is_dir() and (d / "images").is_dir() and _label_dir(d / "images") is not None:
            return True
    if (root / "images").is_dir():
        for d in (root / "images").iterdir():
            if d.is_dir() and not d.name.startswith(".") and _label_dir(d) is not None:
                return True
    return lists and any(_is_list_file(p) for p in root.glob("*.txt"))


def _folder_pair_dirs(root: Path, split: str, *, lists: bool = True) -> tuple[Path, Path] | None:
    """``(images, labels)`` of ``split``: ``ROOT/{split}/images``, ``ROOT/images/{split}``,
    else the flat ``ROOT/images`` — which serves any split only when ``root`` declares none
    (:func:`_declares_splits`; ``split=""`` asks for the flat pair itself)."""
    for base, sub in ((root / split, ""), (root, split), (root, "")):
        if split and base == root and not sub and _declares_splits(root, lists=lists):
            return None
        images = base / "images" / sub
        for name in ("labels", "masks"):
            labels = base / name / sub
            if images.is_dir() and labels.is_dir():
                return images, labels
    return None


def unlabelled_split(root: str | Path, split: str) -> str | None:
    """One line for a ``split`` whose image folder (``ROOT/images/{split}`` or
    ``ROOT/{split}/images``) has no label folder beside it, else ``None``: the split is there,
    its labels are not, which "no split" (or no word, for a split not asked for) hid."""
    root = Path(root)
    if not split or not root.is_dir():
        return None
    for images, labels in (
        (root / "images" / split, lambda name: Path(name) / split),
        (root / split / "images", lambda name: Path(split) / name),
    ):
        if images.is_dir() and not any((root / labels(n)).is_dir() for n in ("labels", "masks")):
            return (
                f"{images} has no {labels('labels')} (or {labels('masks')}) beside it: split "
                f"{split!r} has images but no labels; add them there"
            )
    return None


def _scan_folder(root: Path, split: str) -> Discovery:
    found = Discovery("folder", source=root)
    # list files name splits of the list layout; the folder layout's own are its subfolders
    dirs = _folder_pair_dirs(root, split, lists=False)
    if dirs is None:
        found.split_missing = True
        found.problems.append(
            unlabelled_split(root, split)
            or f"{root}: no images/ + labels/ (or masks/) folders (looked in {root / split}, "
            f"{root}/images/{split}, {root}); arrange the files so or pass --layout"
        )
        return found
    listed = root / f"{split}.txt"
    if split and dirs[0] == root / "images" and _is_list_file(listed):
        # the flat folder stands for every split: beside a list file naming this split, the
        # train split would read the val images too (documented: no stand-in then)
        found.split_missing = True
        found.problems.append(
            f"{root}: {listed.name} lists split {split!r}, and the flat images/ folder holds "
            "every split's images; read it with --layout list (or auto)"
        )
        return found
    images, labels = (_images_by_stem(d, found.problems) for d in dirs)
    found.source = dirs[0]
    for stem, img in images.items():
        if stem in labels:
            found.samples.append((img, labels[stem]))
        else:
            found.problems.append(f"{img}: no label with stem {stem!r} in {dirs[1]}; add it")
    for stem in sorted(set(labels) - set(images)):
        found.problems.append(f"{labels[stem]}: no image with stem {stem!r} in {dirs[0]}; add it")
    return found


def _scan_voc(root: Path, split: str) -> Discovery:
    if not (root / "JPEGImages").is_dir() and (root / "VOC2012").is_dir():
        root = root / "VOC2012"  # VOCdevkit/ given
    list_file = root / "ImageSets" / "Segmentation" / f"{split}.txt"
    found = Discovery("voc", source=list_file)
    if not list_file.is_file():
        found.split_missing = True
        found.problems.append(f"{list_file}: VOC split file not found; check ROOT and --split")
        return found
    for n, line in enumerate(_list_lines(list_file), start=1):
        stem = line.strip()
        if not stem:
            continue
        pair = (root / "JPEGImages" / f"{stem}.jpg", root / "SegmentationClass" / f"{stem}.png")
        missing = [p for p in pair if not p.is_file()]
        for p in missing:
            found.problems.append(f"{p}: named in {list_file}:{n} but not found; add it")
        if not missing:
            found.samples.append(pair)
    return found


def _scan_cityscapes(root: Path, split: str) -> Discovery:
    img_dir, gt_dir = root / "leftImg8bit" / split, root / "gtFine" / split
    found = Discovery("cityscapes", source=img_dir)
    if not img_dir.is_dir():
        found.split_missing = True
        found.problems.append(f"{img_dir}: Cityscapes image folder not found; check ROOT/--split")
        return found
    for img in sorted(img_dir.glob("*/*_leftImg8bit.png")):
        stem = img.name[: -len("_leftImg8bit.png")]
        label = gt_dir / img.parent.name / f"{stem}_gtFine_labelTrainIds.png"
        if label.is_file():
            found.samples.append((img, label))
        else:
            found.problems.append(
                f"{label}: train-id label not found; create the *_labelTrainIds.png files with "
                "cityscapesscripts' createTrainIdLabelImgs"
            )
    if not found.samples and not found.problems:
        others = sorted(p.name for p in img_dir.glob("*/*_leftImg8bit.*"))
        if others:  # converted to JPEG: found by no name the layout reads
            found.problems.append(
                f"{img_dir}: only *_leftImg8bit.png images are read, and its {len(others)} "
                f"*_leftImg8bit files are other formats (e.g. {others[0]}); use the original "
                "PNGs, or list the pairs in a list file (--layout list)"
            )
    return found


ADE_FOLDER = "ADEChallengeData2016"
ADE_SPLITS = {"train": "training", "val": "validation"}  # dualseg's split names -> ADE20K's


def _ade_root(root: Path) -> Path:
    return root / ADE_FOLDER if (root / ADE_FOLDER).is_dir() else root


def _scan_ade20k(root: Path, split: str) -> Discovery:
    root = _ade_root(root)
    name = ADE_SPLITS.get(split, split)
    img_dir, ann_dir = root / "images" / name, root / "annotations" / name
    found = Discovery("ade20k", source=img_dir)
    if not img_dir.is_dir() or not ann_dir.is_dir():
        found.split_missing = True
        found.problems.append(
            f"{img_dir}: ADE20K images/{name} and annotations/{name} not found; pass the "
            f"{ADE_FOLDER} folder (or its parent) and --split train or val"
        )
        return found
    labels = _images_by_stem(ann_dir, found.problems)
    for stem, img in _images_by_stem(img_dir, found.problems).items():
        if stem in labels:
            found.samples.append((img, labels[stem]))
        else:
            found.problems.append(f"{img}: no annotation {ann_dir / stem}.png; add it")
    return found


SCANNERS = {
    "list": _scan_list,
    "folder": _scan_folder,
    "voc": _scan_voc,
    "cityscapes": _scan_cityscapes,
    "ade20k": _scan_ade20k,
}


def _detect(root: Path, split: str) -> str | None:
    if (root.is_file() and root.suffix == ".txt") or (root / f"{split}.txt").is_file():
        return "list"
    if (root / "JPEGImages").is_dir() or (root / "VOC2012" / "JPEGImages").is_dir():
        return "voc"
    if (root / "leftImg8bit").is_dir() and (root / "gtFine").is_dir():
        return "cityscapes"
    ade = _ade_root(root)
    if (ade / "images" / "training").is_dir() and (ade / "annotations").is_dir():
        return "ade20k"
    if _folder_pair_dirs(root, split) is not None:
        return "folder"
    return None


def available_splits(root: str | Path, layout: str = "auto") -> list[str]:
    """The splits ``root`` holds (``train``, ``val``, ... whatever its files name)."""
    root = Path(root)
    if not root.is_dir():
        return []
    names = {"train", "val", "test", "trainval"}
    names |= {p.stem for p in root.glob("*.txt")}
    names |= {p.stem for p in root.glob("ImageSets/Segmentation/*.txt")}
    for sub in (root, root / "images", root / "leftImg8bit", _ade_root(root) / "images"):
        if sub.is_dir():
            names |= {d.name for d in sub.iterdir() if d.is_dir() and not d.name.startswith(".")}
    found = []
    for name in sorted(names):
        kind = _detect(root, name) if layout == "auto" else layout
        if kind is None or kind not in SCANNERS:
            continue
        if kind == "ade20k" and name in ADE_SPLITS.values():
            continue  # ADE20K's own folder names: listed as train / val
        flat = _folder_pair_dirs(root, "")
        if kind == "folder" and _folder_pair_dirs(root, name) in (None, flat):
            continue  # a flat images/ folder is no split of its own
        if not SCANNERS[kind](root, name).split_missing:
            found.append(name)
    return found


def _missing_split(root: Path, split: str, layout: str = "auto") -> DataError | None:
    """``DataError`` listing the splits found, when ``split`` is absent but others exist (or
    naming its image folder, when only its labels are absent)."""
    if layout in ("auto", "folder") and (unlabelled := unlabelled_split(root, split)):
        return DataError(unlabelled)
    others = [s for s in available_splits(root, layout) if s != split]
    if not others:
        return None
    return DataError(
        f"{root}: has no split {split!r} (splits found: {', '.join(others)}); pass one of "
        "them as --split"
    )


def detect_layout(root: str | Path, split: str = "train") -> str:
    """Which layout ``root`` looks like (``DataError`` when none)."""
    root = Path(root)
    layout = _detect(root, split)
    if layout is not None:
        return layout
    if not root.exists():
        raise DataError(f"{root}: dataset folder not found; check the path")
    missing = _missing_split(root, split)
    if missing is not None:
        raise missing
    raise DataError(
        f"{root}: cannot tell the dataset layout for split {split!r}: expected {split}.txt "
        "(list), images/ + labels/ (folder), JPEGImages/ (voc), leftImg8bit/ (cityscapes) or "
        f"{ADE_FOLDER}/images/training (ade20k); "
        f"set the layout (--layout; layout= in Python) to one of {LAYOUTS[1:]}"
    )


def discover(root: str | Path, *, split: str = "train", layout: str = "auto") -> Discovery:
    """Scan a dataset; every problem found is collected (``dualseg data check`` reports all)."""
    root = Path(root)
    if layout not in LAYOUTS:
        raise DataError(f"unknown layout {layout!r}; use one of {LAYOUTS}")
    if layout == "auto":
        layout = detect_layout(root, split)
    return SCANNERS[layout](root, split)


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


def _meta_file(root: Path) -> Path:
    """ROOT/meta.json (beside the list file when ROOT is one)."""
    return (root.parent if root.is_file() else root) / META_FILE


def _own_meta(root: str | Path, layout: str, preset: str | DatasetMeta | None) -> DatasetMeta:
    if isinstance(preset, DatasetMeta):
        return preset
    if preset is not None:
        return preset_for(root, preset)
    root = Path(root)
    meta_file = _meta_file(root)
    if meta_file.is_file():
        return load_meta_file(meta_file)
    if layout in PRESETS:  # voc, cityscapes, ade20k
        return PRESETS[layout]
    raise DataError(
        f"{root}: which classes does this dataset have? pass preset= one of {sorted(PRESETS)} "
        f"(CLI: --preset), or describe them in {meta_file} (name, class_names, palette)"
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
    meta_file = _meta_file(root)
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
    meta_file = _meta_file(root)
    if meta_file.is_file():
        return load_meta_file(meta_file)
    if layout == "auto":
        layout = _detect(root, split) or "auto"
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
        image, label = read_pair(img_path, label_path, self.meta, label_format=self.label_format)
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
) -> SegmentationDataset:
    """Scan ``root`` and return its ``split`` as a :class:`SegmentationDataset`.

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
    samples: list[Pair] = []
    metas: list[tuple[Path, DatasetMeta]] = []
    source: str | Path = roots[0]
    for r in roots:
        found = discover(r, split=split, layout=layout)
        if found.split_missing:
            missing = _missing_split(Path(r), split, layout)
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
        samples += found.samples
        source = (found.source or r) if len(roots) == 1 else ", ".join(map(str, roots))
    return SegmentationDataset(
        samples,
        one_class_set(metas, label_format=label_format),
        transform=transform,
        label_format=label_format,
        samples_per_epoch=samples_per_epoch,
        seed=seed,
        source=source,
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
