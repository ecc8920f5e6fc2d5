"""Dataset descriptions: class names, palette and ignore handling (``DatasetMeta``, ``PRESETS``).

Internally every label map uses **255 for "ignore"** (loss and metrics skip it). A preset names
the raw label values of its source that mean "ignore" (``source_ignore``, e.g. CamVid's 11) and
the colours that mean "ignore" in colour-coded label images (``void_colors``). ADE20K stores
"other" as 0 and its 150 classes as 1..150: ``reduce_zero_label`` maps raw 0 to 255 and raw
``v`` to class ``v - 1`` (mmsegmentation's option of that name).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dualseg.errors import DataError

IGNORE_INDEX = 255
Color = tuple[int, int, int]


@dataclass(frozen=True)
class DatasetMeta:
    """What a label value means: class names, one RGB colour per class, ignore handling."""

    name: str
    class_names: tuple[str, ...]
    palette: tuple[Color, ...]  # one RGB colour per class
    ignore_index: int = IGNORE_INDEX  # always 255 internally
    source_ignore: tuple[int, ...] = ()  # raw label values mapped to 255 (CamVid: (11,))
    void_colors: tuple[Color, ...] = field(default=())  # colours decoded to 255 (colour labels)
    reduce_zero_label: bool = False  # raw 0 -> 255, raw v -> v - 1 (ADE20K)

    def __post_init__(self) -> None:
        if len(self.palette) != len(self.class_names):
            raise DataError(
                f"dataset {self.name!r}: {len(self.class_names)} class names but "
                f"{len(self.palette)} palette colours; give one RGB colour per class"
            )
        if self.ignore_index != IGNORE_INDEX:
            raise DataError(
                f"dataset {self.name!r}: ignore_index must be {IGNORE_INDEX} internally; "
                f"map your raw ignore value through source_ignore=({self.ignore_index},) instead"
            )
        if not 0 < len(self.class_names) < IGNORE_INDEX:
            raise DataError(f"dataset {self.name!r}: needs 1..254 classes")

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def raw_lut(self) -> np.ndarray:
        """uint8 ``[256]``: raw label value -> class index or 255 (``source_ignore``,
        ``reduce_zero_label``). Values it maps past the classes are invalid labels."""
        lut = np.arange(256, dtype=np.int64)
        if self.reduce_zero_label:
            lut = np.where(lut == 0, IGNORE_INDEX, lut - 1)
            lut[IGNORE_INDEX] = IGNORE_INDEX  # a 255 already written as ignore stays ignore
        lut[list(self.source_ignore)] = IGNORE_INDEX
        return lut.astype(np.uint8)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (checkpoints, ``meta.json``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DatasetMeta:
        try:
            return cls(
                name=str(d["name"]),
                class_names=tuple(str(c) for c in d["class_names"]),
                palette=tuple(tuple(int(v) for v in c) for c in d["palette"]),  # type: ignore[misc]
                ignore_index=int(d.get("ignore_index", IGNORE_INDEX)),
                source_ignore=tuple(int(v) for v in d.get("source_ignore", ())),
                void_colors=tuple(tuple(int(v) for v in c) for c in d.get("void_colors", ())),  # type: ignore[misc]
                reduce_zero_label=bool(d.get("reduce_zero_label", False)),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(
                f"invalid dataset description ({err!r}); it needs 'name', 'class_names' and "
                "'palette' (one [r, g, b] per class)"
            ) from err


def _voc_palette(n: int) -> tuple[Color, ...]:
    # The PASCAL VOC colour map: bits of the class index spread over the high bits of r, g, b.
    colors = []
    for i in range(n):
        r = g = b = 0
        c = i
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        colors.append((r, g, b))
    return tuple(colors)


CAMVID = DatasetMeta(
    name="camvid",
    class_names=(
        "sky",
        "building",
        "pole",
        "road",
        "pavement",
        "tree",
        "sign_symbol",
        "fence",
        "car",
        "pedestrian",
        "bicyclist",
    ),
    palette=(
        (128, 128, 128),
        (128, 0, 0),
        (192, 192, 128),
        (128, 64, 128),
        (60, 40, 222),
        (128, 128, 0),
        (192, 128, 128),
        (64, 64, 128),
        (64, 0, 128),
        (64, 64, 0),
        (0, 128, 192),
    ),
    source_ignore=(11,),
    void_colors=((0, 0, 0),),
)

VOC = DatasetMeta(
    name="voc",
    class_names=(
        "background",
        "aeroplane",
        "bicycle",
        "bird",
        "boat",
        "bottle",
        "bus",
        "car",
        "cat",
        "chair",
        "cow",
        "diningtable",
        "dog",
        "horse",
        "motorbike",
        "person",
        "pottedplant",
        "sheep",
        "sofa",
        "train",
        "tvmonitor",
    ),
    palette=_voc_palette(21),
    void_colors=((224, 224, 192),),
)

CITYSCAPES = DatasetMeta(
    name="cityscapes",
    class_names=(
        "road",
        "sidewalk",
        "building",
        "wall",
        "fence",
        "pole",
        "traffic_light",
        "traffic_sign",
        "vegetation",
        "terrain",
        "sky",
        "person",
        "rider",
        "car",
        "truck",
        "bus",
        "train",
        "motorcycle",
        "bicycle",
    ),
    palette=(
        (128, 64, 128),
        (244, 35, 232),
        (70, 70, 70),
        (102, 102, 156),
        (190, 153, 153),
        (153, 153, 153),
        (250, 170, 30),
        (220, 220, 0),
        (107, 142, 35),
        (152, 251, 152),
        (70, 130, 180),
        (220, 20, 60),
        (255, 0, 0),
        (0, 0, 142),
        (0, 0, 70),
        (0, 60, 100),
        (0, 80, 100),
        (0, 0, 230),
        (119, 11, 32),
    ),
    void_colors=((0, 0, 0),),
)

# The procedurally drawn street scenes of dualseg.data.synthetic (the `dualseg demo` data).
SYNTHETIC = DatasetMeta(
    name="synthetic",
    class_names=(
        "sky",
        "building",
        "road",
        "sidewalk",
        "vegetation",
        "car",
        "pole",
        "sign",
    ),
    palette=(
        (128, 128, 128),
        (128, 0, 0),
        (128, 64, 128),
        (60, 40, 222),
        (128, 128, 0),
        (64, 0, 128),
        (192, 192, 128),
        (192, 128, 128),
    ),
    void_colors=((0, 0, 0),),
)

# ADE20K's 150 benchmark class names in label order (spaces in names written as "_").
_ADE20K_NAMES = (
    "wall building sky floor tree ceiling road bed windowpane grass cabinet sidewalk person "
    "earth door table mountain plant curtain chair car water painting sofa shelf house sea "
    "mirror rug field armchair seat fence desk rock wardrobe lamp bathtub railing cushion "
    "base box column signboard chest_of_drawers counter sand sink skyscraper fireplace "
    "refrigerator grandstand path stairs runway case pool_table pillow screen_door stairway "
    "river bridge bookcase blind coffee_table toilet flower book hill bench countertop stove "
    "palm kitchen_island computer swivel_chair boat bar arcade_machine hovel bus towel light "
    "truck tower chandelier awning streetlight booth television_receiver airplane dirt_track "
    "apparel pole land bannister escalator ottoman bottle buffet poster stage van ship "
    "fountain conveyer_belt canopy washer plaything swimming_pool stool barrel basket "
    "waterfall tent bag minibike cradle oven ball food step tank trade_name microwave pot "
    "animal bicycle lake dishwasher screen blanket sculpture hood sconce vase traffic_light "
    "tray ashcan fan pier crt_screen plate monitor bulletin_board shower radiator glass "
    "clock flag"
)

# ADE20K / SceneParsing (ADEChallengeData2016): the 150 benchmark classes, in label order 1..150
# (raw 0 = "other", ignored). The palette is generated (VOC's bit pattern), one colour per class.
ADE20K = DatasetMeta(
    name="ade20k",
    class_names=tuple(_ADE20K_NAMES.split()),
    palette=_voc_palette(151)[1:],
    reduce_zero_label=True,
)

PRESETS: dict[str, DatasetMeta] = {m.name: m for m in (CAMVID, VOC, CITYSCAPES, SYNTHETIC, ADE20K)}

META_FILE = "meta.json"  # optional dataset description beside a list-file or folder dataset


def get_preset(name: str) -> DatasetMeta:
    """The preset called ``name`` (``camvid``, ``voc``, ``cityscapes``, ``synthetic``,
    ``ade20k``)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise DataError(
            f"unknown dataset preset {name!r}; choose one of {sorted(PRESETS)} or describe "
            f"your classes in a {META_FILE} file (name, class_names, palette)"
        ) from None


def load_meta_file(path: str | Path) -> DatasetMeta:
    """Read a ``meta.json`` dataset description (the form written by ``DatasetMeta.to_dict``)."""
    path = Path(path)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(
            f"{path}: cannot read dataset description ({err}); fix or delete it"
        ) from err
    try:
        return DatasetMeta.from_dict(d)
    except DataError as err:
        raise DataError(f"{path}: {err}") from err


def without_source_ignore(meta: DatasetMeta) -> DatasetMeta:
    """The same classes for label maps that already hold 255 for ignore (written by dualseg)."""
    return replace(meta, source_ignore=(), reduce_zero_label=False)
