"""dualseg.data: dataset presets, readers, layouts, joint transforms and the synthetic scenes.

>>> from dualseg.data import build_dataset, build_train_transform
>>> ds = build_dataset("../shared/data/camvid", split="train", preset="camvid",
...                    transform=build_train_transform(crop_size=(360, 480)))  # doctest: +SKIP
>>> image, label = ds[0]   # float32 [3,360,480] normalized, int64 [360,480] (255 = ignore)
"""

from dualseg.data.check import check_dataset
from dualseg.data.datasets import SegmentationDataset, build_dataset, dataset_meta
from dualseg.data.layouts import LAYOUTS, available_splits, detect_layout, discover
from dualseg.data.presets import (
    IGNORE_INDEX,
    PRESETS,
    DatasetMeta,
    get_preset,
    load_meta_file,
    parse_label_map,
    require_same_classes,
    with_label_mapping,
)
from dualseg.data.readers import decode_color_label, read_label
from dualseg.data.synthetic import make_synthetic_dataset
from dualseg.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    build_augment_pipeline,
    build_eval_transform,
    build_train_transform,
)
from dualseg.imaging import read_image
from dualseg.viz import denormalize

__all__ = [
    "IGNORE_INDEX",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "LAYOUTS",
    "PRESETS",
    "DatasetMeta",
    "SegmentationDataset",
    "available_splits",
    "build_augment_pipeline",
    "build_dataset",
    "build_eval_transform",
    "build_train_transform",
    "check_dataset",
    "dataset_meta",
    "decode_color_label",
    "denormalize",
    "detect_layout",
    "discover",
    "get_preset",
    "load_meta_file",
    "make_synthetic_dataset",
    "parse_label_map",
    "read_image",
    "read_label",
    "require_same_classes",
    "with_label_mapping",
]
