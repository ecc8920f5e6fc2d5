"""The README's learning-curve figure, from the committed plateau results (no run folder needed).

Every ``results.json`` that ``benchmarks/camvid.py`` writes keeps each model's dev curve
(``train.<model>.dev_curve``: iteration, training minutes, dev mIoU). This script draws the
curves of ``CURVES`` (label -> file in ``docs/results/plateau/``, model) with
:func:`camvid.save_learning_curves`::

    python benchmarks/plot_learning_curves.py            # docs/results/plateau/learning_curves.png
    python benchmarks/plot_learning_curves.py --probes   # docs/results/plateau/probe_curves.png

``--probes`` draws issue 14's ReNet probes (``PROBE_CURVES``) with their paired peer and the
earlier rows they are read against, in a figure of their own.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from camvid import save_learning_curves

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "plateau"
CURVES = {  # label: (results file, model); fp32 + contiguous unless the label says otherwise
    "peer, T=1,500": ("results_peer.json", "peer"),
    "peer, T=2,100": ("method_b_control_peer.json", "peer"),
    "peer, T=3,000": ("results_peer_T3000_full.json", "peer"),
    "peer, T=6,000 (paused part of the time)": ("results_peer_T6000_full.json", "peer"),
    "peer, T=3,000, bf16 + channels-last": ("fast_peer_T3000.json", "peer"),
    "peer, T=3,000, bf16, stride 8 (paused 8 min)": ("stride_peer_os8_T3000.json", "peer"),
    "peer, T=3,308, stride 8 (control; another CPU)": ("control_peer_os8_T3308_fp32.json", "peer"),
    "peer, T=1,500, head LR 1x": ("recipe_peer_head_lr_1.json", "peer"),
    "A, T=1,500": ("results_dualseg.json", "dualseg"),
    "A, T=1,932 (control)": ("results_dualseg_control.json", "dualseg"),
    "A, T=3,000, bf16 + channels-last": ("fast_dualseg_T3000.json", "dualseg"),
    "A, T=1,500, bf16, stride 16": ("stride_A_os16.json", "dualseg"),
    "A, T=1,500, bf16, stride 8": ("stride_A_os8.json", "dualseg"),
    "A, T=1,500, head LR 1x": ("recipe_dualseg_head_lr_1.json", "dualseg"),
    "A without ReNet, T=1,500": ("results_no_renet.json", "no_renet"),
    "A, single branch, T=1,500": ("results_single_branch.json", "single_branch"),
    "A, no coordinate channels, T=1,500": ("results_no_coord.json", "no_coord"),
    "A, v3 ASPP, T=1,500": ("results_aspp_v3.json", "aspp_v3"),
    "A without ReNet, v3 ASPP, T=1,500": ("results_no_renet_v3.json", "no_renet_v3"),
    "A, logits upsampled first, T=1,500": ("results_logits_first.json", "logits_first"),
}
PROBE_CURVES = {  # the ReNet probes: bf16 + channels-last, two runs at a time, one AMD EPYC
    "peer, T=1,500 (paired)": ("probe_peer_os16_T1500.json", "peer"),
    "peer, T=3,000 (paired)": ("probe_peer_os16_T3000.json", "peer"),
    "A, BatchNorm on ReNet inputs, v3 ASPP, T=1,500": ("probe_renet_bn_v3.json", "renet_bn_v3"),
    "A, skip around ReNet, v3 ASPP, T=1,500": ("probe_renet_skip_v3.json", "renet_skip_v3"),
    "A, skip around ReNet, v3 ASPP, T=3,000": ("probe_renet_skip_v3_T3000.json", "renet_skip_v3"),
    "A, T=1,500 (earlier, another CPU)": ("stride_A_os16.json", "dualseg"),
    "A, v3 ASPP, T=1,500 (earlier, fp32)": ("results_aspp_v3.json", "aspp_v3"),
    "A without ReNet, v3 ASPP, T=1,500 (earlier, fp32)": (
        "results_no_renet_v3.json",
        "no_renet_v3",
    ),
}
NO_TIME_AXIS = {  # their minutes are not comparable
    "peer, T=6,000 (paused part of the time)",
    "peer, T=3,000, bf16, stride 8 (paused 8 min)",
    "peer, T=3,308, stride 8 (control; another CPU)",
    "A, T=1,500 (earlier, another CPU)",
    "A, skip around ReNet, v3 ASPP, T=3,000",  # resumed at 617 with 2 threads
    "A, v3 ASPP, T=1,500 (earlier, fp32)",
    "A without ReNet, v3 ASPP, T=1,500 (earlier, fp32)",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="default: in docs/results/plateau/")
    p.add_argument("--probes", action="store_true", help="the ReNet probes' figure instead")
    args = p.parse_args(argv)
    curves = PROBE_CURVES if args.probes else CURVES
    if args.out is None:
        args.out = RESULTS / ("probe_curves.png" if args.probes else "learning_curves.png")
    train = {}
    for label, (name, model) in curves.items():
        path = RESULTS / name
        if not path.is_file():
            print(f"skipped {label}: no {path}")
            continue
        train[label] = json.loads(path.read_text())["train"][model]
        if label in NO_TIME_AXIS:
            train[label] = {**train[label], "time_axis": False}
    save_learning_curves(train, args.out)
    print(f"wrote {args.out} ({len(train)} curves)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
