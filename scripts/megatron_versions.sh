#!/usr/bin/env bash
# The Megatron-Core tests on the newest Megatron-Core the package supports, beside the 0.16.1 that the dev
# extras install (the newest that declares Python 3.11). Megatron-Core 0.17+ declares Python 3.12 but ships
# cp311 wheels that run here: installed with --ignore-requires-python into a folder of its own (with triton,
# which 0.19 imports unconditionally; kept between runs) that goes first on PYTHONPATH, so that the hybrid
# model tests, which need triton, run too.
#
#   scripts/megatron_versions.sh
#   MEGATRON_VERSION=0.18.0 scripts/megatron_versions.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
version=${MEGATRON_VERSION:-0.19.2}
target=$root/.cache/megatron-core-$version
if [ ! -d "$target/megatron/core" ]; then
    pip install -q --no-deps --ignore-requires-python --target "$target" "megatron-core==$version" triton==3.9.0
fi
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
python -c "import megatron.core as m; assert m.__version__.startswith('$version'), m.__version__; print('== megatron-core', m.__version__)"
python -m pytest -q -p no:cacheprovider tests/test_megatron_cpu.py tests/test_megatron_spec_flag_cpu.py \
  tests/test_megatron_gdn_cpu.py tests/test_megatron_hybrid_cpu.py
