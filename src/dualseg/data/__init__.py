"""dualseg.data: dataset presets, readers, layouts, joint transforms and the synthetic scenes.

>>> from dualseg.data import build_dataset, build_train_transform
>>> ds = build_dataset("../shared/data/camvid", split="train", preset="camvid",
...                    transform=build_train_transform(crop_size=(360, 480)))  # doctest: +SKIP
>>> image, label = ds[0]   # float32 [3,360,480] normalized, int64 [360,480] (255 = ignore)
"""

from dualseg.data.datasets import (
    LAYOUTS,
    SegmentationDataset,
    build_dataset,
    detect_layout,
    discover,
)
from dualseg.data.presets import (
    IGNORE_INDEX,
    PRESETS,
    DatasetMeta,
    get_preset,
    load_meta_file,
)
from dualseg.data.readers import decode_color_label, read_image, read_label
from dualseg.data.synthetic import make_synthetic_dataset
from dualseg.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    build_augment_pipeline,
    build_eval_transform,
    build_train_transform,
    denormalize,
)

__all__ = [
    "IGNORE_INDEX",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "LAYOUTS",
    "PRESETS",
    "DatasetMeta",
    "SegmentationDataset",
    "build_augment_pipeline",
    "build_dataset",
    "build_eval_transform",
    "build_train_transform",
    "decode_color_label",
    "denormalize",
    "detect_layout",
    "discover",
    "get_preset",
    "load_meta_file",
    "make_synthetic_dataset",
    "read_image",
    "read_label",
]
