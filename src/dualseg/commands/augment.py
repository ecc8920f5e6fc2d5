"""``dualseg augment SRC DST --count N``: flags for :func:`dualseg.data.augment.augment_dataset`."""

from __future__ import annotations

from pathlib import Path

from dualseg.commands.common import add_quiet_arg, command_parser, nonnegative_int, split_of
from dualseg.data.augment import IMAGE_FORMATS, augment_dataset
from dualseg.data.layouts import LAYOUTS
from dualseg.data.presets import PRESETS
from dualseg.data.readers import LABEL_FORMATS
from dualseg.data.transforms import BLUR_PROB, HFLIP_PROB, JITTER, SCALE_RANGE


def main(argv: list[str] | None = None) -> int:
    p = command_parser(
        "augment",
        "Write COUNT augmented image/label pairs of SRC plus a list file into DST "
        "(random scale, crop, flip, blur, colour jitter). Re-running resumes.",
        "dualseg augment ../shared/data/camvid data/camvid_aug --preset camvid --count 10000",
    )
    add = p.add_argument
    add("src", type=Path, help="source dataset folder (or list file)")
    add("dst", type=Path, help="output folder")
    add("--count", type=int, default=10_000, help="pairs to write (10000)")
    add("--workers", type=nonnegative_int, default=1, help="worker processes (1)")
    add("--split", help="split of SRC to augment (train; a list file as SRC: its name)")
    add("--layout", choices=LAYOUTS, default="auto", help="layout of SRC (auto)")
    add("--preset", choices=sorted(PRESETS), help="class set of SRC")
    add("--label-format", choices=LABEL_FORMATS, default="index", help="labels of SRC (index)")
    add("--crop-size", type=int, nargs=2, metavar=("H", "W"), help="(default: the source size)")
    add("--scale-range", type=float, nargs=2, default=SCALE_RANGE, metavar=("MIN", "MAX"),
        help=f"random scale factors {SCALE_RANGE}")  # fmt: skip
    add("--hflip-prob", type=float, default=HFLIP_PROB, help=f"({HFLIP_PROB})")
    add("--blur-prob", type=float, default=BLUR_PROB, help=f"Gaussian blur ({BLUR_PROB})")
    add("--jitter", type=float, nargs=4, default=JITTER,
        metavar=("BRIGHT", "CONTRAST", "SAT", "HUE"), help=f"colour jitter {JITTER}")  # fmt: skip
    add("--seed", type=int, default=0, help="seed of every pair's draw (0)")
    add("--image-format", choices=sorted(IMAGE_FORMATS), default="png", help="of images (png)")
    add("--list-name", default="train.txt", help="list file written into DST (train.txt)")
    add_quiet_arg(p)
    a = p.parse_args(argv)
    written, skipped = augment_dataset(
        a.src, a.dst, count=a.count, workers=a.workers, layout=a.layout, preset=a.preset,
        split=split_of(a.src, a.split, default="train", flag="SRC"), label_format=a.label_format,
        crop_size=tuple(a.crop_size) if a.crop_size else None, scale_range=tuple(a.scale_range),
        hflip_prob=a.hflip_prob, blur_prob=a.blur_prob, jitter=tuple(a.jitter), seed=a.seed,
        image_format=a.image_format, list_name=a.list_name, progress=not a.quiet,
    )  # fmt: skip
    print(f"{a.dst}: {written} pairs written, {skipped} already present; list {a.list_name}")
    return 0
