#!/usr/bin/env bash
# Fetches torchtitan 0.2.2 and what `import torchtitan.models.llama3` pulls in (0.2.2's llama3 package
# imports its whole train spec: datasets, the tensorboard writer, the tyro config manager), as pinned
# wheels for CPython 3.12 on x86-64 Linux, into .device/tt/ (about 62 MiB, pyarrow 43 of them). The
# machine they serve is assumed to have torch, transformers' dependencies (numpy, fsspec, huggingface_hub,
# httpx, pyyaml, packaging, filelock, tqdm) and cake_cute's (protobuf, through nvidia-cutlass-dsl); with
# torch 2.11 there, torchtitan 0.3 does not import and benchmarks/torchtitan_022_gpu.py uses 0.2.2 instead.
#
#   bash benchmarks/torchtitan_022_kit.sh                       # here, from the project root (needs the index)
#   # there, with .device/tt/ copied beside the tree (no index needed):
#   python3 -m pip install --no-index --no-deps --target /tmp/tt .device/tt/*.whl
#   PYTHONPATH=/tmp/tt${PYTHONPATH:+:$PYTHONPATH} python3 benchmarks/torchtitan_022_gpu.py --out OUT.json
#
# /tmp/tt goes first on PYTHONPATH so that it wins over any other torchtitan installed there. The list
# assumes triton is installed (0.2.2's MoE kernels module imports it; CUDA builds of torch bring it):
# for the CPU check (`--device cpu`, tests/test_torchtitan_022_cpu.py) add a triton wheel.
# scripts/device_round.sh's section torchtitan022 does both steps.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
wheels=(
  torchtitan==0.2.2
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 typing-extensions==4.16.0
  torchdata==0.11.0 requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3
  tensorboard==2.21.0 absl-py==2.5.1
  datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 xxhash==4.1.0 pyarrow==21.0.0
  pandas==2.2.3 python-dateutil==4.0.0 pytz==2026.6 tzdata==2026.6
)
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .device/tt "${wheels[@]}"
du -sh .device/tt
