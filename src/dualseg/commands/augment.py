"""``dualseg augment SRC DST --count N``: flags for :func:`dualseg.data.augment.augment_dataset`."""

from __future__ import annotations

from pathlib import Path

from dualseg.commands.common import add_quiet_arg, nonnegative_int, split_of
from dualseg.console import ArgumentParser, argparse_kwargs
from dualseg.data.augment import IMAGE_FORMATS, augment_dataset
from dualseg.data.datasets import LAYOUTS
from dualseg.data.presets import PRESETS
from dualseg.data.readers import LABEL_FORMATS
from dualseg.data.transforms import BLUR_PROB, HFLIP_PROB, JITTER, SCALE_RANGE


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(
        prog="dualseg augment",
        description="Write COUNT augmented image/label pairs of SRC plus a list file into DST "
        "(random scale, crop, flip, blur, colour jitter). Re-running resumes.",
        **argparse_kwargs(
            "dualseg augment ../shared/data/camvid data/camvid_aug --preset camvid --count 10000",
        ),
    )
    p.add_argument("src", type=Path, help="source dataset folder (or list file)")
    p.add_argument("dst", type=Path, help="output folder")
    p.add_argument("--count", type=int, default=10_000, help="pairs to write (default 10000)")
    p.add_argument(
        "--workers", type=nonnegative_int, default=1, help="worker processes (default 1)"
    )
    p.add_argument(
        "--split", help="split of SRC to augment (default train; a list file as SRC: its name)"
    )
    p.add_argument("--layout", choices=LAYOUTS, default="auto", help="layout of SRC (auto)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="class set of SRC")
    p.add_argument(
        "--label-format", choices=LABEL_FORMATS, default="index", help="labels of SRC (index)"
    )
    p.add_argument(
        "--crop-size", type=int, nargs=2, metavar=("H", "W"), help="default: the source size"
    )
    p.add_argument(
        "--scale-range",
        type=float,
        nargs=2,
        default=SCALE_RANGE,
        metavar=("MIN", "MAX"),
        help=f"random scale factors {SCALE_RANGE}",
    )
    p.add_argument("--hflip-prob", type=float, default=HFLIP_PROB, help=f"({HFLIP_PROB})")
    p.add_argument(
        "--blur-prob", type=float, default=BLUR_PROB, help=f"Gaussian blur ({BLUR_PROB})"
    )
    p.add_argument(
        "--jitter",
        type=float,
        nargs=4,
        default=JITTER,
        metavar=("BRIGHT", "CONTRAST", "SAT", "HUE"),
        help=f"colour jitter {JITTER}",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of every pair's draw (0)")
    p.add_argument(
        "--image-format", choices=sorted(IMAGE_FORMATS), default="png", help="of images (png)"
    )
    p.add_argument(
        "--list-name", default="train.txt", help="list file written into DST (train.txt)"
    )
    add_quiet_arg(p)
    a = p.parse_args(argv)
    a.split = split_of(a.src, a.split, default="train", flag="SRC")
    written, skipped = augment_dataset(
        a.src,
        a.dst,
        count=a.count,
        workers=a.workers,
        split=a.split,
        layout=a.layout,
        preset=a.preset,
        label_format=a.label_format,
        crop_size=tuple(a.crop_size) if a.crop_size else None,
        scale_range=tuple(a.scale_range),
        hflip_prob=a.hflip_prob,
        blur_prob=a.blur_prob,
        jitter=tuple(a.jitter),
        seed=a.seed,
        image_format=a.image_format,
        list_name=a.list_name,
        progress=not a.quiet,
    )
    print(f"{a.dst}: {written} pairs written, {skipped} already present; list {a.list_name}")
    return 0
