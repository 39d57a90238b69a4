#!/usr/bin/env bash
# Build zerosum's wheel and its dependencies' wheels into testbed/wheelhouse, on the host. The image
# then installs from there with --no-index, so `docker build` needs no network (air-gapped clusters,
# CI machines whose containers cannot verify certificates).
set -euo pipefail
cd "$(dirname "$0")/.."
out=testbed/wheelhouse
rm -f "$out"/zerosum-*.whl
# WITH_TORCH=1 adds torch (CPU build) for the training example in the testbed.
if [ "${WITH_TORCH:-0}" = 1 ]; then
    python3 -m pip wheel -q -w "$out" '.[switch,torch]'
else
    rm -f "$out"/torch-*.whl
    python3 -m pip wheel -q -w "$out" '.[switch]'
fi
ls "$out"
