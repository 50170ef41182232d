#!/usr/bin/env bash
# Fetches what Hugging Face's kernel route needs beside torch (tests/test_gpu_hf_kernels.py, the --route
# runs of benchmarks/model_step.py) as pinned wheels for CPython 3.12 on x86-64 Linux, into .device/hfk/:
# transformers 5.25 and the kernels release it asks for (0.19.1), the huggingface_hub 2.x they need with
# its own dependencies, and accelerate (the Trainer's). The machine they serve is assumed to have torch
# and transformers 5.x's other dependencies (numpy, tokenizers, safetensors, regex, typer, tqdm, pyyaml,
# packaging, fsspec, filelock); installed into a folder of their own first on PYTHONPATH, they leave an
# older transformers there untouched.
#
#   bash benchmarks/hf_kernels_kit.sh                      # here, from the project root (needs the index)
#   # there, with .device/hfk/ copied beside the tree (no index needed):
#   python3 -m pip install --no-index --no-deps --target /tmp/hfk .device/hfk/*.whl
#   PYTHONPATH=/tmp/hfk${PYTHONPATH:+:$PYTHONPATH} python3 -m pytest -m gpu tests/test_gpu_hf_kernels.py
#
# scripts/device_round.sh's sections hfkernels, hfkernelscpu, hfkernelsllama and hfkernelsqwen3 do both steps.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
wheels=(
  transformers==5.25.0 kernels==0.19.1 tomlkit==0.15.3
  huggingface-hub==2.4.0 hf-xet==1.8.0 click==8.5.1
  httpx2==2.17.0 httpcore2==2.17.0 h11==0.16.0 truststore==0.10.5 anyio==4.16.0 idna==3.21
  typing-extensions==4.16.0
  accelerate==1.16.0 psutil==7.2.2
)
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .device/hfk "${wheels[@]}"
du -sh .device/hfk
