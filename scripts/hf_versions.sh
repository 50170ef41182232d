#!/usr/bin/env bash
# The Hugging Face conformance matrix, the norm classes' dtype mixes and the fusion tests on the oldest and
# the newest transformers the package declares (pyproject: transformers>=4.51), each in a venv of its own
# under $HF_VENVS (default .cache/hf-venvs, kept between runs). Exits non-zero if any version fails; every
# version runs either way.
#
#   scripts/hf_versions.sh              # the tests, oldest and newest
#   scripts/hf_versions.sh --docs       # also regenerate their sections of docs/hf_families.md
#   HF_VERSIONS="4.57.6" scripts/hf_versions.sh
#   HF_EXCEPT=5.25.0 scripts/hf_versions.sh     # skip a version the caller's environment already ran
#
# Then Hugging Face's kernel route (tests/test_hf_kernels_cpu.py) on the oldest pair it declares,
# transformers 5.17.0 with kernels 0.16.0 ($HF_ROUTE_OLDEST; empty: none); the newest pair is 5.25.0 with
# the kernels 0.19 it depends on, which the main run and the 5.25.0 venv have.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
# The oldest declared minor's last release, and the newest release this machine's index can install
# (5.25.0, which brings kernels 0.19 as a dependency).
versions=${HF_VERSIONS:-"4.51.3 5.25.0"}
venvs=${HF_VENVS:-$root/.cache/hf-venvs}
tests=(tests/test_hf_conformance_cpu.py tests/test_hf_norm_dtypes_cpu.py tests/test_fusion_cpu.py tests/test_fusion_plans_cpu.py)
export TMPDIR=${TMPDIR:-$root/.cache/tmp} CUTE_DSL_CACHE_DIR=${CUTE_DSL_CACHE_DIR:-$root/.cache/cute-dsl}
export CAKE_CUTE_CACHE_DIR=${CAKE_CUTE_CACHE_DIR:-$root/.cache/kernels}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$root/.cache/torch-extensions}
mkdir -p "$TMPDIR" "$venvs"
failed=()
for version in $versions; do
    if [ "$version" = "${HF_EXCEPT:-}" ]; then
        echo "== transformers $version: run by the calling environment, not again here"
        continue
    fi
    venv=$venvs/transformers-$version
    echo "== transformers $version ($venv)"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
        # The CPU build of torch that lies on this machine's disk, first: otherwise pip fetches a CUDA build.
        "$venv/bin/pip" install -q torch==2.13.0 || { failed+=("$version (install)"); continue; }
    fi
    # peft: the LoRA fusion test; the package itself, editable, so the tests run this checkout.
    "$venv/bin/pip" install -q -e "$root" pytest numpy peft "transformers==$version" \
        || { failed+=("$version (install)"); continue; }
    start=$SECONDS
    junit=$TMPDIR/hf-matrix-$version.xml
    "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" --junitxml="$junit" || failed+=("$version")
    echo "== transformers $version: $((SECONDS - start))s of tests"
    if [ "${1:-}" = "--docs" ]; then
        "$venv/bin/python" scripts/hf_matrix.py --junit "$junit" || failed+=("$version (docs)")
    fi
done
read -r route_transformers route_kernels <<< "${HF_ROUTE_OLDEST-5.17.0 0.16.0}"
if [ -n "${route_transformers:-}" ]; then
    venv=$venvs/transformers-$route_transformers-kernels-$route_kernels
    echo "== the kernel route: transformers $route_transformers, kernels $route_kernels ($venv)"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q torch==2.13.0 || failed+=("route (install)")
    fi
    # accelerate: the Trainer test.
    "$venv/bin/pip" install -q -e "$root" pytest numpy accelerate "transformers==$route_transformers" \
        "kernels==$route_kernels" || failed+=("route (install)")
    "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_hf_kernels_cpu.py || failed+=("route")
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}" >&2
    exit 1
fi
