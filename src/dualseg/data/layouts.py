"""Dataset layouts: which image/label pairs a folder holds, per split.

``list`` (``ROOT/{split}.txt`` of ``image label`` lines or stems), ``folder`` (an image folder
beside a label folder, matched by stem: ``ROOT/{split}/images``, ``ROOT/images/{split}``, else a
flat ``ROOT/images`` unless ROOT names splits of its own), ``voc``, ``cityscapes`` (train-id
labels) and ``ade20k`` (``ADEChallengeData2016``; ``train``/``val`` name its folders).
"""

from __future__ import annotations

import glob
from dataclasses import dataclass, field
from pathlib import Path

from dualseg.errors import DataError

# what folder scans pick up: every format the image readers open (a named file is read whatever
# its suffix)
IMAGE_SUFFIXES = (
    ".png", ".jpg", ".jpeg", ".jfif", ".bmp", ".tif", ".tiff", ".webp", ".gif", ".ppm", ".pgm",
)  # fmt: skip
IMAGE_DIRS = ("images", "image", "imgs", "img", "JPEGImages")
LABEL_DIRS = ("labels", "label", "masks", "mask", "annotations", "ann", "SegmentationClass")
Pair = tuple[Path, Path]


@dataclass
class Discovery:
    """What a layout scan found: the pairs, the problems (each naming a file), the layout."""

    layout: str
    samples: list[Pair] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    source: Path | None = None  # the list file or folder the samples came from
    label_source: Path | None = None  # the folder layout's label folder
    split_missing: bool = False  # the split's list file / folder does not exist at all


def _list_lines(list_file: Path) -> list[str]:
    try:
        return list_file.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(
            f"{list_file}: not UTF-8 text (byte {err.start}); save the list file as UTF-8"
        ) from None


def _is_stem(token: str) -> bool:
    """Whether a one-token list line is a file stem (mmsegmentation's split files)."""
    return (
        "/" not in token and "\\" not in token and Path(token).suffix.lower() not in IMAGE_SUFFIXES
    )


def _files_by_stem(folder: Path) -> dict[str, list[Path]]:
    by_stem: dict[str, list[Path]] = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."):
            by_stem.setdefault(p.stem, []).append(p)
    return by_stem


def _scan_list(root: Path, split: str) -> Discovery:
    list_file = root if root.is_file() else root / f"{split}.txt"
    found = Discovery("list", source=list_file, split_missing=not list_file.is_file())
    if found.split_missing:
        found.problems.append(f"{list_file}: list file not found; create it or pass another split")
        return found
    folders = None  # a stem list's: the folder layout's for its split, read once
    for n, line in enumerate(_list_lines(list_file), start=1):
        parts, where = line.split(), f"{list_file}:{n}"
        if not parts or parts[0].startswith("#"):
            continue
        stem = parts[0] if len(parts) == 1 and _is_stem(parts[0]) else None
        if stem and folders is None:
            dirs = _folder_pair_dirs(list_file.parent, list_file.stem, lists=False) or ()
            folders = [(d, _files_by_stem(d)) for d in dirs]
        if stem and folders:  # mmsegmentation's split files: stems of images/ + labels/
            pair = [by_stem.get(stem, []) for _, by_stem in folders]
            if all(len(paths) == 1 for paths in pair):
                found.samples.append((pair[0][0], pair[1][0]))
                continue
            folder, paths = next((f, p) for (f, _), p in zip(folders, pair) if len(p) != 1)
            found.problems.append(f"{where}: stem {stem!r} is " + (
                f"{len(paths)} files in {folder}; keep one" if paths
                else f"in no file of {folder}; add it or remove the line"))  # fmt: skip
        elif len(parts) != 2:  # "images/a b.png labels/a b.png": where does a path end?
            found.problems.append(
                f"{where}: expected 'image_path label_path', got {len(parts)} fields in "
                f"{line.strip()!r} (a path in a list file cannot hold a space; rename such files)"
            )
        else:
            _add_listed(found, (list_file.parent / parts[0], list_file.parent / parts[1]), where)
    return found


def _add_listed(found: Discovery, pair: Pair, where: str) -> None:
    missing = [p for p in pair if not p.is_file()]
    found.problems += [
        f"{p}: listed in {where} but not found; fix the path or remove the line" for p in missing
    ]
    if not missing:
        found.samples.append(pair)


def _images_by_stem(folder: Path, problems: list[str]) -> dict[str, Path]:
    """The folder's images by stem; a stem of several files is a problem, none of them used."""
    by_stem = _files_by_stem(folder)
    for stem, paths in by_stem.items():
        if len(paths) > 1:
            problems.append(
                f"{folder}: {', '.join(p.name for p in paths)} share the name {stem!r}, so "
                "which one pairs is ambiguous; keep one of them"
            )
    return {stem: paths[0] for stem, paths in by_stem.items() if len(paths) == 1}


def _pair_in(base: Path, sub: str = "") -> tuple[Path, Path] | None:
    """The first ``(images, labels)`` folder pair side by side in ``base`` (each + ``sub``)."""
    for image_name in IMAGE_DIRS:
        images = base / image_name / sub
        if images.is_dir():
            for label_name in LABEL_DIRS:
                if (base / label_name / sub).is_dir():
                    return images, base / label_name / sub
    return None


def _is_list_file(path: Path) -> bool:
    """Whether ``path``'s first entry is an ``image label`` line or an image's stem."""
    try:
        lines = [t.split() for t in path.read_text(encoding="utf-8-sig").splitlines()]
    except (OSError, UnicodeDecodeError):
        return False
    parts = next((p for p in lines if p and not p[0].startswith("#")), [])
    if len(parts) == 1 and _is_stem(parts[0]):
        dirs = _folder_pair_dirs(path.parent, path.stem, lists=False)
        return dirs is not None and any(dirs[0].glob(f"{glob.escape(parts[0])}.*"))
    return len(parts) == 2 and all(Path(x).suffix.lower() in IMAGE_SUFFIXES for x in parts)


def _subdirs(folder: Path) -> list[Path]:
    found = folder.iterdir() if folder.is_dir() else ()
    return sorted(d for d in found if d.is_dir() and not d.name.startswith("."))


def _declares_splits(root: Path, *, lists: bool = True) -> bool:
    """Whether ``root`` names splits of its own (split subfolders, or with ``lists`` list files):
    then a flat image folder stands in for no split."""
    return (
        any(_pair_in(d) for d in _subdirs(root))
        or any(_pair_in(root, d.name) for name in IMAGE_DIRS for d in _subdirs(root / name))
        or (lists and root.is_dir() and any(_is_list_file(p) for p in root.glob("*.txt")))
    )


def _folder_pair_dirs(root: Path, split: str, *, lists: bool = True) -> tuple[Path, Path] | None:
    """``(images, labels)`` of ``split``; ``split=""`` asks for the flat pair itself."""
    if split and (found := _pair_in(root / split) or _pair_in(root, split)):
        return found
    if split and _declares_splits(root, lists=lists):
        return None
    return _pair_in(root)


def unlabelled_split(root: str | Path, split: str) -> str | None:
    """The error for a ``split`` whose image folder has no label folder beside it, else None."""
    root = Path(root)
    if not split or not root.is_dir() or _pair_in(root / split) or _pair_in(root, split):
        return None
    for name in IMAGE_DIRS:
        for images, first in ((root / name / split, False), (root / split / name, True)):
            if images.is_dir():
                a, b = (f"{split}/{n}" if first else f"{n}/{split}" for n in ("labels", "masks"))
                return (
                    f"{images} has no {a} (or {b}) beside it: split {split!r} has images but "
                    "no labels; add them there"
                )
    return None


def seen_folders(root: Path) -> str:
    """The folders ``root`` holds, for a message that could not tell what they are."""
    names = [f"{d.name}/" for d in _subdirs(root)]
    shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    return f"found {shown}" if names else "found no folders"


def _scan_folder(root: Path, split: str) -> Discovery:
    found = Discovery("folder", source=root)
    dirs = _folder_pair_dirs(root, split, lists=False)
    if dirs is None:
        found.split_missing = True
        found.problems.append(
            unlabelled_split(root, split)
            or f"{root}: no image folder ({'/, '.join(IMAGE_DIRS)}/) with a label folder "
            f"({'/, '.join(LABEL_DIRS)}/) beside it, for split {split!r} (in {root / split}, "
            f"ROOT/<images>/{split} or ROOT; {seen_folders(root)}); rename the folders to these "
            "names"
        )
        return found
    listed = root / f"{split}.txt"
    if split and dirs[0].parent == root and _is_list_file(listed):  # train would read val's
        found.split_missing = True
        found.problems.append(
            f"{root}: {listed.name} lists split {split!r}, and the flat {dirs[0].name}/ folder "
            "holds every split's images; read it with --layout list (or auto)"
        )
        return found
    found.source, found.label_source = dirs
    return _pair_by_stem(found, *dirs)


def _pair_by_stem(found: Discovery, image_dir: Path, label_dir: Path) -> Discovery:
    """Pair the images and labels of two folders by file stem; each stray file is a problem."""
    images, labels = (_images_by_stem(d, found.problems) for d in (image_dir, label_dir))
    for stem, img in images.items():
        if stem in labels:
            found.samples.append((img, labels[stem]))
        else:
            found.problems.append(f"{img}: no label with stem {stem!r} in {label_dir}; add it")
    for stem in sorted(set(labels) - set(images)):
        found.problems.append(f"{labels[stem]}: no image with stem {stem!r} in {image_dir}; add it")
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
        _add_listed(found, pair, f"{list_file}:{n}")
    return found


def _scan_cityscapes(root: Path, split: str) -> Discovery:
    img_dir, gt_dir = root / "leftImg8bit" / split, root / "gtFine" / split
    found = Discovery("cityscapes", source=img_dir, split_missing=not img_dir.is_dir())
    if found.split_missing:
        found.problems.append(f"{img_dir}: Cityscapes image folder not found; check ROOT/--split")
    for img in sorted(img_dir.glob("*/*_leftImg8bit.png")):
        label = gt_dir / img.parent.name / img.name.replace("leftImg8bit", "gtFine_labelTrainIds")
        if label.is_file():
            found.samples.append((img, label))
        else:
            found.problems.append(
                f"{label}: train-id label not found; create the *_labelTrainIds.png files with "
                "cityscapesscripts' createTrainIdLabelImgs"
            )
    return found


ADE_FOLDER = "ADEChallengeData2016"
ADE_SPLITS = {"train": "training", "val": "validation"}


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
    return _pair_by_stem(found, img_dir, ann_dir)


SCANNERS = {
    "list": _scan_list,
    "folder": _scan_folder,
    "voc": _scan_voc,
    "cityscapes": _scan_cityscapes,
    "ade20k": _scan_ade20k,
}
LAYOUTS = ("auto", *SCANNERS)


def detect(root: Path, split: str) -> str | None:
    if (root.is_file() and root.suffix == ".txt") or (root / f"{split}.txt").is_file():
        return "list"
    if (root / "ImageSets").is_dir() or (root / "VOC2012" / "JPEGImages").is_dir():
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
    subs = (root, *(root / n for n in IMAGE_DIRS), root / "leftImg8bit", _ade_root(root) / "images")
    for sub in subs:
        names |= {d.name for d in _subdirs(sub)}
    found = []
    for name in sorted(names):
        kind = detect(root, name) if layout == "auto" else layout
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


def missing_split(root: Path, split: str, layout: str = "auto") -> DataError | None:
    """The error for an absent ``split`` when others exist (or only its labels are absent)."""
    if layout in ("auto", "folder") and (unlabelled := unlabelled_split(root, split)):
        return DataError(unlabelled)
    if others := [s for s in available_splits(root, layout) if s != split]:
        return DataError(f"{root}: has no split {split!r} (splits found: {', '.join(others)}); "
                         "pass one of them as --split")  # fmt: skip
    return None


def detect_layout(root: str | Path, split: str = "train") -> str:
    """Which layout ``root`` looks like (``DataError`` when none)."""
    root = Path(root)
    layout = detect(root, split)
    if layout is not None:
        return layout
    if not root.exists():
        raise DataError(f"{root}: dataset folder not found; check the path")
    if missing := missing_split(root, split):
        raise missing
    raise DataError(
        f"{root}: cannot tell the dataset layout for split {split!r} ({seen_folders(root)}): "
        f"expected {split}.txt (list), an image folder ({'/, '.join(IMAGE_DIRS)}/) beside a "
        f"label folder ({'/, '.join(LABEL_DIRS)}/) (folder), JPEGImages/ + ImageSets/ (voc), "
        f"leftImg8bit/ (cityscapes) or {ADE_FOLDER}/images/training (ade20k); rename the "
        f"folders so, or set the layout (--layout; layout= in Python) to one of {LAYOUTS[1:]}"
    )


def detect_any_split(root: Path, splits: tuple[str, ...]) -> str:
    """The layout of the first recognisable split; an error names the first split."""
    found = next((kind for split in splits if (kind := detect(root, split))), None)
    return found or detect_layout(root, splits[0])


def discover(root: str | Path, *, split: str = "train", layout: str = "auto") -> Discovery:
    """Scan a dataset; every problem found is collected (``dualseg data check`` reports all)."""
    root = Path(root)
    if layout not in LAYOUTS:
        raise DataError(f"unknown layout {layout!r}; use one of {LAYOUTS}")
    if layout == "auto":
        layout = detect_layout(root, split)
    return SCANNERS[layout](root, split)
