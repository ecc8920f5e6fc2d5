"""Dataset descriptions: class names, palette and the raw-value mapping (``DatasetMeta``).

Internally 255 means "ignore". Raw label values become class ids through one lookup table
(:meth:`DatasetMeta.lookup_table`); ``ROOT/meta.json`` holds the same fields as ``to_dict``.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

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
    source_ignore: tuple[int, ...] = ()  # raw label values mapped to 255 (CamVid: (11,))
    void_colors: tuple[Color, ...] = field(default=())  # colours decoded to 255 (colour labels)
    ignore_value: int | None = IGNORE_INDEX  # the raw value meaning ignore (None: none)
    label_map: tuple[tuple[int, int], ...] = ()  # (raw value, class id or 255), applied last
    reduce_zero_label: bool = False  # raw 0 -> 255, raw v -> class v - 1 (ADE20K)
    ignore_index: ClassVar[int] = IGNORE_INDEX  # the class id of "ignore", always 255

    def __post_init__(self) -> None:
        if len(self.palette) != len(self.class_names):
            raise DataError(
                f"dataset {self.name!r}: {len(self.class_names)} class names but "
                f"{len(self.palette)} palette colours; give one RGB colour per class"
            )
        if not 0 < len(self.class_names) < IGNORE_INDEX:
            raise DataError(f"dataset {self.name!r}: needs 1..254 classes")
        raw = [*self.source_ignore, *(s for s, _ in self.label_map), self.ignore_value or 0]
        bad = [v for v in raw if not 0 <= v <= 255]
        bad += [d for _, d in self.label_map if not (0 <= d < self.num_classes or d == 255)]
        if bad:
            raise DataError(
                f"dataset {self.name!r}: label values {bad} out of range; raw values are "
                f"0..255 and label_map targets a class id 0..{self.num_classes - 1} or 255"
            )

    def require_distinct_colours(self) -> None:
        """Each colour means one thing (needed to decode colour labels, not to draw)."""
        owner: dict[tuple[int, ...], str] = {}
        for name, colour in [
            *zip(self.class_names, self.palette),
            *((None, c) for c in self.void_colors),
        ]:
            c = tuple(colour)
            if c in owner:
                what = (f"void colour {c} is also class {owner[c]!r}'s palette colour"
                        if name is None else f"classes {owner[c]!r} and {name!r} share the "
                        f"palette colour {c}")  # fmt: skip
                raise DataError(f"dataset {self.name!r}: {what}; give each class its own colour")
            if name is not None:
                owner[c] = name

    def lookup_table(self) -> np.ndarray:
        """``int16 [256]``: raw value -> class id, 255 (ignore) or -1 (invalid); label_map wins."""
        lut = np.full(256, -1, dtype=np.int16)
        first = int(self.reduce_zero_label)
        lut[first : first + self.num_classes] = np.arange(self.num_classes)
        lut[[0] * self.reduce_zero_label + list(self.source_ignore)] = IGNORE_INDEX
        if self.ignore_value is not None:
            lut[self.ignore_value] = IGNORE_INDEX
        for src, dst in self.label_map:
            lut[src] = dst
        return lut

    def unreachable_classes(self) -> list[int]:
        """Class ids no raw value maps to (an ignore or label_map entry took their value)."""
        reached = {int(v) for v in self.lookup_table() if 0 <= v < self.num_classes}
        return [k for k in range(self.num_classes) if k not in reached]

    def describe_ignore(self) -> str:
        """The raw values that mean ignore, for messages: ``"11, 255"`` or ``"none"``."""
        return ", ".join(map(str, np.flatnonzero(self.lookup_table() == IGNORE_INDEX))) or "none"

    def describe_mapping(self) -> str:
        """The whole raw-value mapping in a few words, for messages."""
        first = int(self.reduce_zero_label)
        parts = [
            f"classes {first}..{first + self.num_classes - 1}",
            f"ignore {self.describe_ignore()}",
        ]
        if self.label_map:
            parts.append("label_map " + ",".join(f"{s}:{d}" for s, d in self.label_map))
        return ", ".join(parts)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def to_dict(self) -> dict[str, Any]:
        """The ``meta.json`` form (``ignore_index``: the raw ignore value)."""
        return {
            "name": self.name,
            "class_names": list(self.class_names),
            "palette": [list(c) for c in self.palette],
            "ignore_index": self.ignore_value,
            "source_ignore": list(self.source_ignore),
            "label_map": {str(s): d for s, d in self.label_map},
            "void_colors": [list(c) for c in self.void_colors],
            "reduce_zero_label": self.reduce_zero_label,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DatasetMeta:
        """Read the ``meta.json`` form."""
        try:
            ignore = d.get("ignore_index", IGNORE_INDEX)
            label_map = d.get("label_map") or {}
            if not isinstance(label_map, Mapping):
                raise DataError(f'label_map must be an object like {{"255": 1}}, got {label_map!r}')
            pairs = [(int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else k, k, v)
                     for k, v in label_map.items()]  # fmt: skip
            mapping = [(_int(r, f"label_map key {k!r}"), _int(v, f"label_map[{k!r}]"))
                       for r, k, v in pairs]  # fmt: skip
            return cls(
                name=str(d["name"]),
                class_names=_class_names(d["class_names"]),
                palette=_colors(d["palette"], "palette"),
                source_ignore=tuple(_int(v, "source_ignore") for v in d.get("source_ignore", ())),
                void_colors=_colors(d.get("void_colors", ()), "void_colors"),
                ignore_value=None if ignore is None else _int(ignore, "ignore_index"),
                label_map=tuple(sorted(mapping)),
                reduce_zero_label=_int(
                    d.get("reduce_zero_label", False), "reduce_zero_label", bool
                ),
            )
        except DataError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise DataError(
                f"invalid dataset description ({err!r}); it needs 'name', 'class_names' and "
                "'palette' (one [r, g, b] per class); 'label_map' is {\"raw\": class_id}"
            ) from err


def _int(value: Any, key: str, kind: type = int) -> Any:
    """A JSON integer (``int()`` would take 1.9, true and "7"), or with ``kind=bool`` a boolean."""
    if isinstance(value, bool) is not (kind is bool) or not isinstance(value, kind):
        what = "true or false (a JSON boolean)" if kind is bool else "an integer"
        raise DataError(f"{key} must be {what}, got {value!r}")
    return value


def _class_names(value: Any) -> tuple[str, ...]:
    """meta.json's ``class_names``: a list of unique strings."""
    if not isinstance(value, list | tuple) or not all(isinstance(c, str) for c in value):
        raise DataError(
            f'class_names must be a list of strings, got {value!r}; e.g. ["road", "car"]'
        )
    if twice := [name for i, name in enumerate(value) if name in value[:i]]:
        raise DataError(f"class_names lists {twice[0]!r} twice; give each class a unique name")
    return tuple(value)


def _colors(value: Any, key: str) -> tuple[Color, ...]:
    if not isinstance(value, list | tuple):
        raise DataError(f"{key} must be a list of [r, g, b] colours, got {value!r}")
    for i, c in enumerate(value):
        ok = isinstance(c, list | tuple) and len(c) == 3
        if not ok or not all(type(v) is int and 0 <= v <= 255 for v in c):
            raise DataError(f"{key}[{i}] must be [r, g, b] with 3 integers 0..255, got {c!r}")
    return tuple((c[0], c[1], c[2]) for c in value)


def voc_palette(n: int) -> tuple[Color, ...]:
    """The first ``n`` colours of the PASCAL VOC colour map."""
    i, rgb = np.arange(n)[:, None], np.zeros((n, 3), np.int64)
    for j in range(8):  # bit 3j+k of the index -> bit 7-j of channel k
        rgb |= ((i >> (3 * j + np.arange(3))) & 1) << (7 - j)
    return tuple((int(r), int(g), int(b)) for r, g, b in rgb)


VOC_COLOURS = voc_palette(256)


def _names(text: str) -> tuple[str, ...]:
    return tuple(text.split())


def _colours(text: str) -> tuple[Color, ...]:
    """``"808080 800000"`` -> ``((128, 128, 128), (128, 0, 0))``: palettes written compactly."""
    return tuple(tuple(bytes.fromhex(h)) for h in text.split())  # type: ignore[misc]


CAMVID = DatasetMeta(
    name="camvid",
    class_names=_names(
        "sky building pole road pavement tree sign_symbol fence car pedestrian bicyclist"
    ),
    palette=_colours(
        "808080 800000 c0c080 804080 3c28de 808000 c08080 404080 400080 404000 0080c0"
    ),
    source_ignore=(11,),
    void_colors=((0, 0, 0),),
)

VOC = DatasetMeta(
    name="voc",
    class_names=_names(
        "background aeroplane bicycle bird boat bottle bus car cat chair cow diningtable dog "
        "horse motorbike person pottedplant sheep sofa train tvmonitor"
    ),
    palette=voc_palette(21),
    void_colors=((224, 224, 192),),
)

CITYSCAPES = DatasetMeta(
    name="cityscapes",
    class_names=_names(
        "road sidewalk building wall fence pole traffic_light traffic_sign vegetation terrain "
        "sky person rider car truck bus train motorcycle bicycle"
    ),
    palette=_colours(
        "804080 f423e8 464646 66669c be9999 999999 faaa1e dcdc00 6b8e23 98fb98 4682b4 dc143c "
        "ff0000 00008e 000046 003c64 005064 0000e6 770b20"
    ),
    void_colors=((0, 0, 0),),
)

# The procedurally drawn street scenes of dualseg.data.synthetic (the `dualseg demo` data).
SYNTHETIC = DatasetMeta(
    name="synthetic",
    class_names=_names("sky building road sidewalk vegetation car pole sign"),
    palette=_colours("808080 800000 804080 3c28de 808000 400080 c0c080 c08080"),
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

# ADEChallengeData2016: raw 0 = "other" (ignored), classes 1..150
ADE20K = DatasetMeta(
    name="ade20k",
    class_names=tuple(_ADE20K_NAMES.split()),
    palette=voc_palette(151)[1:],
    reduce_zero_label=True,
)

PRESETS: dict[str, DatasetMeta] = {m.name: m for m in (CAMVID, VOC, CITYSCAPES, SYNTHETIC, ADE20K)}

META_FILE = "meta.json"  # optional dataset description beside a list-file or folder dataset


def get_preset(name: str) -> DatasetMeta:
    """The preset called ``name``."""
    try:
        return PRESETS[name]
    except KeyError:
        raise DataError(
            f"unknown dataset preset {name!r}; choose one of {sorted(PRESETS)} or describe "
            f"your classes in a {META_FILE} file (name, class_names, palette)"
        ) from None


def load_meta_file(path: str | Path) -> DatasetMeta:
    """Read a ``meta.json`` dataset description (``DatasetMeta.to_dict``'s form)."""
    path = Path(path)
    try:
        d = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path}: not UTF-8 (byte {err.start}); save the dataset description as UTF-8 JSON"
        ) from None
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(
            f"{path}: cannot read dataset description ({err}); fix or delete it"
        ) from err
    # "_comment"-style keys are notes; a misspelled key would silently read as its default
    keys = d if isinstance(d, dict) else {}
    unknown = [k for k in keys if k not in META_KEYS and not str(k).startswith("_")]
    if unknown and len(unknown) < len(d):  # none known: another tool's file, said below
        key = str(unknown[0])
        close = difflib.get_close_matches(key, META_KEYS, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else f"the keys are {', '.join(META_KEYS)}"
        raise DataError(f"{path}: unknown key {key!r}; {hint}")
    try:
        return DatasetMeta.from_dict(d)
    except DataError as err:
        raise DataError(f"{path}: {err}") from err


META_KEYS = tuple(CAMVID.to_dict())  # the keys of meta.json


def without_source_ignore(meta: DatasetMeta) -> DatasetMeta:
    """The same classes for labels dualseg wrote (class ids, 255 = ignore)."""
    return replace(
        meta, source_ignore=(), ignore_value=IGNORE_INDEX, label_map=(), reduce_zero_label=False
    )


def parse_label_map(text: str) -> dict[int, int]:
    """``"255:1"`` or ``"255:1,128:2"`` -> ``{255: 1, 128: 2}`` (raw value -> class id)."""
    mapping: dict[int, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        src, sep, dst = item.partition(":")
        if not sep or not src.strip().isdigit() or not dst.strip().isdigit():
            raise DataError(
                f"label map entry {item!r}: write RAW:CLASS pairs separated by commas, "
                "e.g. 255:1 or 255:1,128:2"
            )
        mapping[int(src)] = int(dst)
    return mapping


IgnoreSetting = int | None | Literal["auto"]


def with_label_mapping(
    meta: DatasetMeta,
    *,
    label_map: Mapping[int, int] | None = None,
    ignore_value: IgnoreSetting = "auto",
) -> DatasetMeta:
    """``meta`` with command-line overrides (``ignore_value="auto"``: keep the dataset's)."""
    mapped = {int(s): int(d) for s, d in (label_map or {}).items()}
    if ignore_value not in ("auto", None) and (v := int(ignore_value)) in mapped:
        raise DataError(
            f"raw label {v} is both the ignore value (--ignore-index {v}) and mapped to class "
            f"{mapped[v]} (--label-map {v}:{mapped[v]}): drop one of the two"
        )
    if mapped:
        meta = replace(meta, label_map=tuple(sorted({**dict(meta.label_map), **mapped}.items())))
    if ignore_value != "auto":
        meta = replace(meta, ignore_value=None if ignore_value is None else int(ignore_value))
    return meta


def require_same_classes(
    model_names: tuple[str, ...] | list[str],
    data_names: tuple[str, ...] | list[str],
    *,
    model: str,
    data: str,
) -> None:
    """Raise one DataError listing both class lists when they differ."""
    if tuple(model_names) != tuple(data_names):
        raise DataError(
            f"{model} has {len(model_names)} classes {list(model_names)} but {data} has "
            f"{len(data_names)} {list(data_names)}; use a model trained on this dataset (or "
            "pass the matching --preset)"
        )
