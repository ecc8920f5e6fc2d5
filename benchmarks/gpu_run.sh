#!/usr/bin/env bash
# The GPU path in one command, on a fresh Linux machine with one NVIDIA GPU:
#   bash benchmarks/gpu_run.sh /path/to/camvid [--minutes 6] [--weights imagenet|none|FILE]
# installs dualseg (and PyTorch when missing), trains dualseg_resnet101 at full 360x480 with
# bf16 AMP for a fixed budget (default 6 min, at most 8), evaluates on val and prints
# training / inference images per second and the val mIoU (also in runs/gpu_run/gpu_run.json).
set -euo pipefail
data=${1:?usage: bash benchmarks/gpu_run.sh CAMVID_DIR [gpu_run.py options]}
shift
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# Online: a normal install. Offline (no package index): dualseg alone on the machine's torch.
python3 -m pip install -q -e . 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-build-isolation -e .
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible to torch'"
exec python3 benchmarks/gpu_run.py --data "$data" "$@"
