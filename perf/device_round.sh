#!/usr/bin/env bash
# One evidence round on a lent GPU machine, section by section, everything written under
# /tmp/round/<section>/ and packed into $OUT/round.tgz at the end (the device tool brings back only a few
# files per call).
#
#   . /opt/cake/env.sh && bash perf/device_round.sh suite sanitizer sweeps ...
#
# Sections (each bounded by its own timeout, so one slow part cannot eat the call):
#   suite        the GPU test suite (pytest -m gpu) and `cake-cute check`
#   sanitizer    compute-sanitizer memcheck / racecheck / synccheck over tests/sanitizer/cases.py
#   sweeps       standard bf16 sweep, training-shapes grid, small batches (perf/sweep.py)
#   dtypes       standard sweep for fp16 and fp32
#   fp8          perf/fp8_bench.py (standard and training grids)
#   model        perf/model_step.py (H = 2048 and 4096) and perf/hostbound.py (eager and compile)
#   passhost     perf/model_step.py compiled at 256 tokens (host-bound) with and without the gradient-sum
#                pass (its op has a C++ kernel since session 15: the pass's host cost in a compiled step)
#   fp8dtypes    perf/fp8_bench.py at the training shapes for fp16 and fp32 rows (the bf16-only sweep's
#                other input dtypes)
#   fp8host      perf/hostbound.py for the forward to MXFP8 (eager through its autograd.Function and through
#                its custom op, compiled) next to cake's bf16 step and torch's (issue #15: host cost)
#   fp32persistent  the GPU tests and sanitizer cases of the FP32 persistent forward to FP8 alone (the
#                suite's order reaches them last; both ran clean at af41b79:
#                perf/results/2026-12-02-h200-gpu-suite-af41b79/)
#   dwcolumns    perf/dw_columns_experiment.py (issue #13: dW summed by columns beside the row kernel)
#   fp32tilings  perf/tune.py scans of the fp32 cluster backward tilings (8 vectors per lane) against the
#                4-vector tilings they replaced (issue #13)
#   fp32rows     perf/tune.py scans of fp32 backward tilings where quack is faster or the copy far (issue #13:
#                residual H = 1024, 5120 2-5% behind quack; H = 5120 tiles its row raggedly, plain 0.85)
#   timeline     perf/backward_timeline.py (issue #13: each backward kernel's start and end, the row kernel
#                without dW, a copy kernel of the same bytes)
#   smallt       perf/tune.py forward / backward tilings of more lanes per row at T = 16 and 256, H = 4096
#                (issue #13: forward <= 2 us, backward <= 4 / 5 us of kernel time)
#   distributed  the two-GPU matrix and training benchmark (torchrun, NCCL; needs 2 GPUs)
#   headdimscan  perf/headdim_scan.py: the forward's and backward's configs at H = 32..256 (per-head q/k norms)
#                against their candidates, quack, torch.compile and the copy (about 4 minutes)
#   headdimgrid  `cake-cute bench --grid headdim` (perf/sweep.py) for bf16
#   qkmodel      perf/model_step.py --model qwen3 (q/k norms, GQA, H = 2048 and 4096, 8192 tokens): every
#                implementation eager, and compiled per decoder layer at H = 2048 torch, cake_cute and
#                cake_cute with the model's own q/k norms (left to inductor) (about 2 minutes)
#   qkmodelmore  the rest of the compiled Qwen3 steps: quack and Liger at H = 2048, everything at H = 4096
# $CAKE_CUTE_COMMIT labels every results file (the copied tree's .git may be stale).
set -uo pipefail
: "${OUT:?set OUT to the folder that comes back}"
RES=/tmp/round
mkdir -p "$RES"
export CAKE_CUTE_CACHE_DIR=${CAKE_CUTE_CACHE_DIR:-/tmp/cake-cute-cache}
export NCCL_NVLS_ENABLE=0 CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$RES/pip.log" 2>&1
day=$(date -u +%F)

bounded() {  # bounded SECONDS LOG COMMAND...: run, log, and print one status line
  local limit=$1 log=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$log" 2>&1
  local rc=$?
  echo "$(basename "$log"): rc=$rc in $((SECONDS - start)) s; $(grep -E 'passed|failed|error' "$log" | tail -1)"
}

section_suite() {
  local d=$RES/suite && mkdir -p "$d"
  { cake-cute info; nvidia-smi; } > "$d/env.txt" 2>&1
  bounded 420 "$d/gpu_tests.log" python3 -m pytest -q -rs -m gpu tests -p no:cacheprovider
  bounded 150 "$d/check.log" cake-cute check
}

section_sanitizer() {
  local d=$RES/sanitizer && mkdir -p "$d"
  bounded 400 "$d/run.log" bash tests/sanitizer/run.sh "$d"
}

section_sweeps() {
  local d=$RES/sweeps && mkdir -p "$d"
  bounded 260 "$d/standard.log" python3 perf/sweep.py --json "$d/$day-nvidia-h200.json" --plot "$d/$day-nvidia-h200.png"
  bounded 240 "$d/training.log" python3 perf/sweep.py --grid training \
    --json "$d/$day-nvidia-h200-training-shapes.json" --plot "$d/$day-nvidia-h200-training-shapes.png"
  bounded 90 "$d/small.log" python3 perf/sweep.py --grid small --json "$d/$day-nvidia-h200-small.json" --no-plot
}

section_dtypes() {
  local d=$RES/dtypes && mkdir -p "$d"
  for dt in fp16 fp32; do
    bounded 240 "$d/$dt.log" python3 perf/sweep.py --dtype "$dt" --vs quack \
      --json "$d/$day-nvidia-h200-$dt.json" --plot "$d/$day-nvidia-h200-$dt.png"
  done
}

section_fp8() {
  local d=$RES/fp8 && mkdir -p "$d"
  bounded 300 "$d/fp8.log" python3 perf/fp8_bench.py "$d/$day-nvidia-h200-fp8.json" --check
}

section_model() {
  local d=$RES/model && mkdir -p "$d"
  local ms=$d/$day-nvidia-h200-model-step.json hb=$d/$day-nvidia-h200-hostbound.json
  bounded 240 "$d/model_step.log" python3 perf/model_step.py "$ms" --hidden 2048
  bounded 200 "$d/model_step_4096.log" python3 perf/model_step.py "$ms" --hidden 4096 --append
  bounded 150 "$d/hostbound.log" python3 perf/hostbound.py "$hb" --modes eager
  bounded 300 "$d/hostbound_compile.log" python3 perf/hostbound.py "$hb" --modes compile,compile-graphs --append
}

section_passhost() {
  local d=$RES/passhost && mkdir -p "$d"
  local out=$d/$day-nvidia-h200-model-step-256-tokens.json
  bounded 200 "$d/with_pass.log" python3 perf/model_step.py "${out%.json}-pass.json" --hidden 2048 --seq 64 \
    --impls torch,cake_cute --modes compile
  bounded 200 "$d/without_pass.log" python3 perf/model_step.py "${out%.json}-no-pass.json" --hidden 2048 \
    --seq 64 --impls torch,cake_cute --modes compile --no-gradient-sums
}

section_fp8dtypes() {
  local d=$RES/fp8dtypes && mkdir -p "$d"
  for dt in fp16 fp32; do
    bounded 200 "$d/$dt.log" python3 perf/fp8_bench.py "$d/$day-nvidia-h200-fp8-$dt.json" --dtype "$dt" \
      --grid training --impls cake_cute
  done
}

section_fp8host() {
  local d=$RES/fp8host && mkdir -p "$d"
  bounded 240 "$d/fp8_host.log" python3 perf/hostbound.py "$d/$day-nvidia-h200-fp8-hostbound.json" \
    --impls cake_cute,cake_cute_mxfp8,cake_cute_mxfp8_op,torch --modes eager,compile
}

section_fp32persistent() {
  local d=$RES/fp32persistent && mkdir -p "$d"
  local fp32_rows="fp32-256 or fp32-1024 or fp32-2048 or fp32-2560 or fp32-4096 or fp32-8192"
  bounded 240 "$d/gpu_tests.log" python3 -m pytest -q -rs -m gpu tests/test_gpu_fp8.py tests/test_gpu_native.py \
    -p no:cacheprovider -k "persistent and ($fp32_rows or row_limit)"
  bounded 240 "$d/sanitizer.log" bash tests/sanitizer/run.sh "$d" "fp8 persistent fp32"
}

section_dwcolumns() {
  local d=$RES/dwcolumns && mkdir -p "$d"
  bounded 300 "$d/dw_columns.log" python3 perf/dw_columns_experiment.py "$d/$day-nvidia-h200-dw-columns.json"
}

section_fp32tilings() {  # the FP32 cluster tilings' rule (8 vectors per lane) against the 4-vector one it replaced
  local d=$RES/fp32tilings && mkdir -p "$d"
  local H T old
  for H in 8192:2048,8192 16384:2048,4096 32768:1024,2048 65536:512,1024; do
    T=${H#*:} H=${H%%:*} old=256:4:1:$((H / 4096))
    bounded 150 "$d/scan_$H.log" python3 perf/tune.py scan "$H" default "bwd.tiling=$old" --dtype fp32 \
      --rows-list "$T" --kernels
  done
}

section_fp32rows() {  # every candidate compiles spill-free for sm_90a (checked on CPU, session 15)
  local d=$RES/fp32rows && mkdir -p "$d"
  bounded 150 "$d/scan_1024.log" python3 perf/tune.py scan 1024 default bwd.tiling=128:2:1:1 \
    bwd.tiling=128:2:2:1 bwd.register_budget=64 bwd.tiling=64:4:2:1 --dtype fp32 --rows-list 16384,65536 --kernels
  bounded 150 "$d/scan_5120.log" python3 perf/tune.py scan 5120 default bwd.tiling=160:4:1:2 \
    bwd.tiling=320:4:1:1 bwd.tiling=128:5:1:2 bwd.tiling=320:2:1:2 --dtype fp32 --rows-list 4096,13107 --kernels
}

section_timeline() {
  local d=$RES/timeline && mkdir -p "$d"
  bounded 120 "$d/backward_timeline.log" python3 perf/backward_timeline.py "$d/backward-timeline.json"
}

section_smallt() {
  local d=$RES/smallt && mkdir -p "$d"
  for T in 16 256; do
    bounded 100 "$d/fwd_T$T.log" python3 perf/tune.py fwd 4096 256,2,1 512,1,1 --rows "$T" --reps 50
    bounded 100 "$d/bwd_T$T.log" python3 perf/tune.py bwd 4096 256,2,1,0 128,4,1,0 --rows "$T" --reps 50
  done
}

section_distributed() {
  local d=$RES/distributed && mkdir -p "$d"
  bounded 300 "$d/matrix-eager.log" torchrun --nproc_per_node=2 perf/distributed/matrix.py \
    --only 1-,2-,3-,4-,5-,6-,8-,9- --tag eager --out "$d"
  bounded 240 "$d/matrix-compile.log" torchrun --nproc_per_node=2 perf/distributed/matrix.py \
    --only 7- --tag compile --out "$d"
  bounded 240 "$d/train.log" torchrun --nproc_per_node=2 perf/distributed/train_bench.py --out "$d"
}

section_headdimscan() {
  local d=$RES/headdimscan && mkdir -p "$d"
  bounded 260 "$d/run.log" python3 perf/headdim_scan.py --out "$d" --budget-s 220
}

section_headdimgrid() {
  local d=$RES/headdimgrid && mkdir -p "$d"
  bounded 240 "$d/sweep.log" python3 perf/sweep.py --grid headdim --json "$d/$day-nvidia-h200-headdim.json" \
    --plot "$d/$day-nvidia-h200-headdim.png"
}

section_qkmodel() {
  local d=$RES/qkmodel && mkdir -p "$d"
  local out=$d/$day-nvidia-h200-model-step-qwen3.json
  bounded 75 "$d/eager.log" python3 perf/model_step.py "$out" --model qwen3 --modes eager --warmup 2 --steps 6
  bounded 90 "$d/compile.log" python3 perf/model_step.py "$out" --append --model qwen3 --modes compile \
    --compile-scope layers --hidden 2048 --impls torch,cake_cute,cake_cute_qk_torch --warmup 2 --steps 6
}

section_qkmodelmore() {
  local d=$RES/qkmodel && mkdir -p "$d"
  local out=$d/$day-nvidia-h200-model-step-qwen3.json
  bounded 100 "$d/compile_peers.log" python3 perf/model_step.py "$out" --append --model qwen3 --modes compile \
    --compile-scope layers --hidden 2048 --impls quack,liger --warmup 3 --steps 8
  bounded 200 "$d/compile_4096.log" python3 perf/model_step.py "$out" --append --model qwen3 --modes compile \
    --compile-scope layers --hidden 4096 --warmup 3 --steps 8
}

for section in "$@"; do
  "section_$section"
done
tar -C "$RES" -czf "$OUT/round.tgz" .
