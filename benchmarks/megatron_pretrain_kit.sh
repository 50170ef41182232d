#!/usr/bin/env bash
# Stages what benchmarks/megatron_pretrain.py needs on the GPU machine (CPython 3.12, no package index)
# into .device/, which git ignores: Megatron-LM's pretrain_gpt.py, gpt_builders.py and model_provider.py at
# REF of a Megatron-LM git repository in .device/megatron-lm/ (the megatron-core wheel ships
# megatron.training, not these files of the repository's root), and the megatron-core wheel in
# .device/wheels/ (with torch, numpy and packaging, all pretrain_gpt.py imports).
#
#   bash benchmarks/megatron_pretrain_kit.sh MEGATRON_LM_REPO [REF]      # REF default: core_r0.19.0
#   MEGATRON_VERSION=0.19.2 (default) picks the wheel; REF should be the release branch or tag it came from.
#
# Then, there (CuTe DSL staged as usual; .device/megatron-lm and .device/wheels carried):
#   python3 -m pip install -q --no-index --no-deps .device/wheels/megatron_core-*.whl
#   python3 benchmarks/megatron_pretrain.py "$OUT/megatron-pretrain.json" --megatron-lm .device/megatron-lm
# scripts/device_round.sh's section megatronpretrain does both.
set -euo pipefail
repo=$1
ref=${2:-core_r0.19.0}
version=${MEGATRON_VERSION:-0.19.2}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exclude=$(git rev-parse --git-path info/exclude)
grep -qxF '/.device/' "$exclude" 2>/dev/null || echo '/.device/' >> "$exclude"
mkdir -p .device/megatron-lm .device/wheels
for file in pretrain_gpt.py gpt_builders.py model_provider.py; do
  git -C "$repo" show "$ref:$file" > ".device/megatron-lm/$file"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .device/wheels "megatron-core==$version"
du -sh .device/megatron-lm .device/wheels
