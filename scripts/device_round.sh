#!/usr/bin/env bash
# One evidence round on a GPU machine: the sections named on the command line, each bounded by its own
# timeout so that one slow part cannot eat the round, everything written under /tmp/round/<section>/ and
# packed into $OUT/round.tgz at the end.
#
#   OUT=/path/to/folder bash scripts/device_round.sh suite sanitizer sweeps dtypes fp8 model
#
# Sections (the answered experiments' sections are in the git history):
#   suite        the GPU test suite (pytest -m gpu: three workers, then the scale tests alone) and
#                `cake-cute check`
#   suitewide    the GPU test suite but the scale tests, eight workers, with the kernel route's wheels of
#                .device/hfk/ (benchmarks/hf_kernels_kit.sh) first on PYTHONPATH, so every GPU test runs
#   hostcompare  benchmarks/hostbound.py (eager: torch, cake_rmsnorm, the CakeRMSNorm module) of an earlier
#                commit's tree in .device/old/ and of this tree, taking turns three times; the earlier tree
#                runs this tree's benchmarks/hostbound.py (copy it there), each tree with its own caches
#   sanitizer    compute-sanitizer memcheck / racecheck / synccheck over tests/sanitizer/cases.py
#   sanitizershort  the same over its short-row cases only (H = 1..256, dW folded per CTA)
#   dwfinish     the dW finish: tests/test_gpu_dw_finish.py (dW bitwise the fixed order of the partial rows,
#                the finish in the launch bitwise the two-launch one, graph replays, two streams), the
#                sanitizer over its cases, and benchmarks/tune.py scans of the finishes (the default two
#                launches, the reduction's one-row loads, the finish in the launch cooperative or not)
#                at the training shapes and per-head rows, with each kernel's time
#   sweeps       standard bf16 sweep, training-shapes grid, small batches (benchmarks/sweep.py)
#   dtypes       standard sweep for fp16 and fp32
#   fp8          benchmarks/fp8_bench.py (standard and training grids, bitwise-checked first)
#   fp8dtypes    benchmarks/fp8_bench.py at the training shapes for fp16 and fp32 rows
#   model        benchmarks/model_step.py (H = 2048 and 4096) and benchmarks/hostbound.py (eager and compile)
#   fp8host      benchmarks/hostbound.py for the forward to MXFP8 (its autograd.Function and its custom op)
#                next to cake_cute's bf16 step and torch's
#   distributed  the two-GPU matrix and training benchmark (torchrun, NCCL; needs 2 GPUs)
#   headdimscan  benchmarks/headdim_scan.py: the forward's and backward's configs at H = 32..256 (per-head q/k norms)
#                against their candidates, quack, torch.compile, Liger and the copy (about 4 minutes)
#   headdimgrid  `cake-cute bench --grid headdim` (benchmarks/sweep.py) for bf16
#   headdimdtypes  the same grid for fp16 and fp32, against quack and torch.compile
#   qkmodel      benchmarks/model_step.py --model qwen3 (q/k norms, GQA, H = 2048 and 4096, 8192 tokens): every
#                implementation eager (cake_cute_qk_kernel is cake_cute there), and compiled per decoder
#                layer at H = 2048 torch, cake_cute (q/k norms left to inductor, the default rule) and
#                cake_cute_qk_kernel (q/k norms on the kernel) (about 2 minutes)
#   qkmodelmore  the rest of the compiled Qwen3 steps: quack and Liger at H = 2048, everything at H = 4096
#   megatron     benchmarks/megatron_train.py: Megatron-Core's training loop, every run (stock, stock-again,
#                stock-compiled-norms, cake, cake-fused-residual); needs the megatron-core wheel in .device/wheels/
#   megatronpretrain  benchmarks/megatron_pretrain.py: Megatron-LM's own pretrain_gpt.py, dense and MoE GPTs (8 layers,
#                H = 2048; MoE: 4 experts, top 2), stock specs beside --spec gpt_layer_spec and gpt_decoder_block_spec;
#                needs .device/megatron-lm and the megatron-core wheel in .device/wheels/
#                (benchmarks/megatron_pretrain_kit.sh)
#   gated        benchmarks/gated_bench.py (bf16, SiLU and sigmoid gates), fla-core and einops from .device/wheels/
#                where present
#   gatedtests   tests/test_gpu_gated.py and tests/test_gpu_autograd_modes.py alone: the gated kernels, autograd,
#                compile, CUDA graphs, swapped classes and double backward with both gate activations
#   gatedmodel   benchmarks/gated_model_step.py: a Qwen3-Next training step with stock, fla and cake gated norms;
#                eager with both plain-norm variants, then compiled per layer (fla-core and einops as for gated)
#   kimimodel    benchmarks/gated_model_step.py --model kimi_linear: a Kimi Linear training step (sigmoid-gated
#                output norms; the torch Kimi Delta Attention at 1024 tokens) with stock, fla and cake gated
#                norms, eager, then compiled per layer (fla-core and einops as for gated)
#   memory       the memory-efficient mode: benchmarks/model_step.py (Llama, H = 4096, AdamW; torch, Liger,
#                cake_cute and cake_cute_memory_efficient, eager and compiled) and benchmarks/memory_bench.py
#   hostbound    benchmarks/hostbound.py, eager only (the host cost of one step next to F.rms_norm's)
#   torchtitan022  benchmarks/torchtitan_022_gpu.py: torchtitan 0.2.2's llama3 training step with the stock norm,
#                Liger's (liger_kernel from .device/wheels/ where present), the converter cake_rmsnorm and
#                cake_rmsnorm_memory_efficient: the 1B shape at batch 4 x 2048 (8192 tokens), 10 steps each
#                (loss curves, step times, peak memory), in torchtitan's single-device autocast and under
#                its FSDP2 bf16 parameters on one rank; needs the wheels of benchmarks/torchtitan_022_kit.sh
#                in .device/tt/
#   hfkernels    Hugging Face's kernel route: tests/test_gpu_hf_kernels.py; needs .device/hfk/
#                (benchmarks/hf_kernels_kit.sh: transformers 5.25, kernels 0.19.1), installed into /tmp/hfk,
#                first on PYTHONPATH
#   hfkernelscpu tests/test_hf_kernels_cpu.py under this machine's torch; .device/hfk/ as above
#   hfkernelsllama  benchmarks/model_step.py --route (stock norms, Liger's stand-in, cake_cute's layers through
#                use_kernels; Llama, H = 4096, 8192 tokens, AdamW, eager and compiled); .device/hfk/ as above,
#                liger_kernel from .device/wheels/ where present
#   hfkernelsqwen3  the same for Qwen3 (q/k norms), eager and compiled per decoder layer
# $CAKE_CUTE_COMMIT labels every results file (a copied tree's .git may be stale).
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
  # Three workers, one file each at a time; the scale tests (up to 127 GiB) alone, after them.
  bounded 400 "$d/gpu_tests.log" python3 -m pytest -q -rs -m gpu tests -p no:cacheprovider \
    -n 3 --dist loadfile --ignore tests/test_gpu_scale.py
  bounded 150 "$d/gpu_scale_tests.log" python3 -m pytest -q -rs -m gpu tests/test_gpu_scale.py -p no:cacheprovider
  bounded 100 "$d/check.log" cake-cute check
}

section_suitewide() {
  local d=$RES/suite && mkdir -p "$d"
  { cake-cute info; nvidia-smi; } > "$d/env.txt" 2>&1
  hf_kernels_kit
  bounded 560 "$d/gpu_tests.log" env PYTHONPATH="/tmp/hfk${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q -rs -m gpu \
    tests -p no:cacheprovider -n 8 --dist loadfile --ignore tests/test_gpu_scale.py
}

section_hostcompare() {
  local d=$RES/hostcompare && mkdir -p "$d"
  local run tree dir
  for run in 1 2 3; do
    for tree in old new; do
      dir=$PWD && [[ $tree == old ]] && dir=$PWD/.device/old
      (cd "$dir" && bounded 150 "$d/$tree-run$run.log" env CAKE_CUTE_CACHE_DIR=/tmp/cache-$tree \
        TORCH_EXTENSIONS_DIR=/tmp/ext-$tree python3 benchmarks/hostbound.py "$d/$tree-run$run.json" \
        --modes eager --impls torch,cake_cute,cake_cute_module --reps 60)
    done
  done
}

section_sanitizershort() {
  local d=$RES/sanitizer-short && mkdir -p "$d"
  bounded 300 "$d/run.log" bash tests/sanitizer/run.sh "$d" short
}

section_dwfinish() {
  local d=$RES/dwfinish && mkdir -p "$d"
  bounded 500 "$d/gpu_tests.log" python3 -m pytest -q -rs -m gpu tests/test_gpu_dw_finish.py -p no:cacheprovider
  bounded 300 "$d/sanitizer.log" bash tests/sanitizer/run.sh "$d/sanitizer" finish
  local candidates=(dw.rows_in_flight=1 bwd.dw_in_launch=true bwd.dw_in_launch=true,bwd.cooperative=false)
  bounded 400 "$d/scan_training.log" python3 benchmarks/tune.py scan 1024,2048,4096,8192 \
    --rows-list 256,2048,4096,16384 "${candidates[@]}" --kernels
  bounded 200 "$d/scan_headdim.log" python3 benchmarks/tune.py scan 64,128 --rows-list 65536,262144 \
    "${candidates[@]}" --kernels
}

section_sanitizer() {
  local d=$RES/sanitizer && mkdir -p "$d"
  bounded 400 "$d/run.log" bash tests/sanitizer/run.sh "$d"
}

section_sweeps() {
  local d=$RES/sweeps && mkdir -p "$d"
  bounded 260 "$d/standard.log" python3 benchmarks/sweep.py --json "$d/$day-nvidia-h200.json" --plot "$d/$day-nvidia-h200.png"
  bounded 240 "$d/training.log" python3 benchmarks/sweep.py --grid training \
    --json "$d/$day-nvidia-h200-training-shapes.json" --plot "$d/$day-nvidia-h200-training-shapes.png"
  bounded 90 "$d/small.log" python3 benchmarks/sweep.py --grid small --json "$d/$day-nvidia-h200-small.json" --no-plot
}

section_dtypes() {
  local d=$RES/dtypes && mkdir -p "$d"
  for dt in fp16 fp32; do
    bounded 240 "$d/$dt.log" python3 benchmarks/sweep.py --dtype "$dt" --vs quack \
      --json "$d/$day-nvidia-h200-$dt.json" --plot "$d/$day-nvidia-h200-$dt.png"
  done
}

section_fp8() {
  local d=$RES/fp8 && mkdir -p "$d"
  bounded 300 "$d/fp8.log" python3 benchmarks/fp8_bench.py "$d/$day-nvidia-h200-fp8.json" --check
}

section_model() {
  local d=$RES/model && mkdir -p "$d"
  local ms=$d/$day-nvidia-h200-model-step.json hb=$d/$day-nvidia-h200-hostbound.json
  bounded 240 "$d/model_step.log" python3 benchmarks/model_step.py "$ms" --hidden 2048
  bounded 200 "$d/model_step_4096.log" python3 benchmarks/model_step.py "$ms" --hidden 4096 --append
  bounded 150 "$d/hostbound.log" python3 benchmarks/hostbound.py "$hb" --modes eager
  bounded 300 "$d/hostbound_compile.log" python3 benchmarks/hostbound.py "$hb" --modes compile,compile-graphs --append
}

section_fp8dtypes() {
  local d=$RES/fp8dtypes && mkdir -p "$d"
  for dt in fp16 fp32; do
    bounded 200 "$d/$dt.log" python3 benchmarks/fp8_bench.py "$d/$day-nvidia-h200-fp8-$dt.json" --dtype "$dt" \
      --grid training --impls cake_cute
  done
}

section_fp8host() {
  local d=$RES/fp8host && mkdir -p "$d"
  bounded 240 "$d/fp8_host.log" python3 benchmarks/hostbound.py "$d/$day-nvidia-h200-fp8-hostbound.json" \
    --impls cake_cute,cake_cute_mxfp8,cake_cute_mxfp8_op,torch --modes eager,compile
}

section_distributed() {
  local d=$RES/distributed && mkdir -p "$d"
  bounded 300 "$d/matrix-eager.log" torchrun --nproc_per_node=2 -m tests.distributed_harness.matrix \
    --only 1-,2-,3-,4-,5-,6-,8-,9- --tag eager --out "$d"
  bounded 240 "$d/matrix-compile.log" torchrun --nproc_per_node=2 -m tests.distributed_harness.matrix \
    --only 7- --tag compile --out "$d"
  bounded 240 "$d/train.log" torchrun --nproc_per_node=2 benchmarks/distributed_train.py --out "$d"
}

section_headdimscan() {
  local d=$RES/headdimscan && mkdir -p "$d"
  bounded 280 "$d/run.log" python3 benchmarks/headdim_scan.py --out "$d" --budget-s 230 --vs quack,compile,liger
}

section_headdimgrid() {
  local d=$RES/headdimgrid && mkdir -p "$d"
  bounded 240 "$d/sweep.log" python3 benchmarks/sweep.py --grid headdim --json "$d/$day-nvidia-h200-headdim.json" \
    --plot "$d/$day-nvidia-h200-headdim.png"
}

section_headdimdtypes() {
  local d=$RES/headdimgrid && mkdir -p "$d"
  for dt in fp16 fp32; do
    bounded 200 "$d/sweep-$dt.log" python3 benchmarks/sweep.py --grid headdim --dtype "$dt" --vs quack,compile \
      --json "$d/$day-nvidia-h200-headdim-$dt.json" --no-plot
  done
}

section_qkmodel() {
  local d=$RES/qkmodel && mkdir -p "$d"
  local out=$d/$day-nvidia-h200-model-step-qwen3.json
  bounded 75 "$d/eager.log" python3 benchmarks/model_step.py "$out" --model qwen3 --modes eager \
    --impls torch,cake_cute,liger,quack --warmup 2 --steps 6
  bounded 90 "$d/compile.log" python3 benchmarks/model_step.py "$out" --append --model qwen3 --modes compile \
    --compile-scope layers --hidden 2048 --impls torch,cake_cute,cake_cute_qk_kernel --warmup 2 --steps 6
}

section_qkmodelmore() {
  local d=$RES/qkmodel && mkdir -p "$d"
  local out=$d/$day-nvidia-h200-model-step-qwen3.json
  bounded 100 "$d/compile_peers.log" python3 benchmarks/model_step.py "$out" --append --model qwen3 --modes compile \
    --compile-scope layers --hidden 2048 --impls quack,liger --warmup 3 --steps 8
  bounded 200 "$d/compile_4096.log" python3 benchmarks/model_step.py "$out" --append --model qwen3 --modes compile \
    --compile-scope layers --hidden 4096 --warmup 3 --steps 8
}

install_wheels() {  # install_wheels NAME...: the staged wheels of those names, offline, never fatal
  local name
  for name in "$@"; do
    ls .device/wheels/"$name"-*.whl > /dev/null 2>&1 &&
      python3 -m pip install -q --no-index --no-deps .device/wheels/"$name"-*.whl >> "$RES/pip.log" 2>&1
  done
}

section_megatron() {
  local d=$RES/megatron && mkdir -p "$d"
  install_wheels megatron_core
  bounded 420 "$d/train.log" python3 benchmarks/megatron_train.py "$d/$day-nvidia-h200-megatron-train.json"
}

section_megatronpretrain() {
  local d=$RES/megatronpretrain && mkdir -p "$d"
  install_wheels megatron_core
  local model
  for model in dense moe; do
    bounded 270 "$d/$model.log" python3 benchmarks/megatron_pretrain.py \
      "$d/$day-nvidia-h200-megatron-pretrain-$model.json" --megatron-lm .device/megatron-lm --models "$model" \
      --timeout 130
  done
}

section_gated() {
  local d=$RES/gated && mkdir -p "$d"
  install_wheels einops fla_core
  bounded 420 "$d/bench.log" python3 benchmarks/gated_bench.py "$d/$day-nvidia-h200-gated.json"
}

section_gatedmodel() {
  local d=$RES/gatedmodel && mkdir -p "$d"
  local out=$d/$day-nvidia-h200-gated-model-step.json
  install_wheels einops fla_core
  # Eager first, both plain-norm variants: a compile that runs long then costs only compiled rows.
  bounded 180 "$d/eager.log" python3 benchmarks/gated_model_step.py "$out" --modes eager --plain-norms stock,cake \
    --linear-attention torch
  bounded 300 "$d/compile.log" python3 benchmarks/gated_model_step.py "$out" --append --modes compile \
    --linear-attention torch
}

section_gatedtests() {
  local d=$RES/gatedtests && mkdir -p "$d"
  bounded 500 "$d/gpu_gated.log" python3 -m pytest -q -rs -m gpu tests/test_gpu_gated.py -p no:cacheprovider
  bounded 200 "$d/gpu_autograd_modes.log" python3 -m pytest -q -rs -m gpu tests/test_gpu_autograd_modes.py \
    -p no:cacheprovider
}

section_kimimodel() {
  local d=$RES/kimimodel && mkdir -p "$d"
  local out=$d/$day-nvidia-h200-kimi-model-step.json
  local run=(python3 benchmarks/gated_model_step.py "$out" --model kimi_linear --linear-attention torch --seq 1024
    --impls stock-torch,fla,cake)
  install_wheels einops fla_core
  bounded 240 "$d/eager.log" "${run[@]}" --modes eager
  bounded 340 "$d/compile.log" "${run[@]}" --append --modes compile
}

section_memory() {
  local d=$RES/memory && mkdir -p "$d"
  install_wheels liger_kernel
  bounded 330 "$d/model_step.log" python3 benchmarks/model_step.py "$d/$day-nvidia-h200-model-step-memory.json" \
    --hidden 4096 --optimizer adamw --impls torch,liger,cake_cute,cake_cute_memory_efficient
  bounded 150 "$d/bench.log" python3 benchmarks/memory_bench.py "$d/$day-nvidia-h200-memory-bench.json"
}

section_hostbound() {
  local d=$RES/hostbound && mkdir -p "$d"
  bounded 150 "$d/hostbound.log" python3 benchmarks/hostbound.py "$d/$day-nvidia-h200-hostbound.json" --modes eager
}

section_torchtitan022() {
  local d=$RES/torchtitan022 && mkdir -p "$d"
  rm -rf /tmp/tt  # --target does not replace what an earlier install left there
  bounded 60 "$d/pip.log" python3 -m pip install --no-index --no-deps --target /tmp/tt .device/tt/*.whl
  install_wheels liger_kernel
  local run=(env PYTHONPATH="/tmp/tt${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/torchtitan_022_gpu.py
    --flavor 1B --batch 4 --seq 2048)
  # The converters' tests, which need 0.2.x installed (the CI has 0.3).
  bounded 120 "$d/tests.log" env PYTHONPATH="/tmp/tt${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q \
    tests/test_torchtitan_022_cpu.py -p no:cacheprovider
  local precision
  for precision in autocast fsdp; do
    bounded 200 "$d/run_1b_$precision.log" "${run[@]}" --precision "$precision" \
      --out "$d/$day-nvidia-h200-torchtitan-022-1b-$precision.json"
  done
}

hf_kernels_kit() {  # the kernel route's wheels into /tmp/hfk, replaced each time
  rm -rf /tmp/hfk
  python3 -m pip install -q --no-index --no-deps --target /tmp/hfk .device/hfk/*.whl >> "$RES/pip.log" 2>&1
  install_wheels liger_kernel
}

section_hfkernels() {
  local d=$RES/hfkernels && mkdir -p "$d"
  hf_kernels_kit
  bounded 480 "$d/gpu_tests.log" env PYTHONPATH="/tmp/hfk${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q -rs \
    tests/test_gpu_hf_kernels.py -p no:cacheprovider --junitxml="$d/gpu_tests.xml"
}

section_hfkernelscpu() {
  local d=$RES/hfkernels && mkdir -p "$d"
  hf_kernels_kit
  bounded 400 "$d/cpu_tests.log" env PYTHONPATH="/tmp/hfk${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q -rs \
    tests/test_hf_kernels_cpu.py -p no:cacheprovider --junitxml="$d/cpu_tests.xml"
}

section_hfkernelsllama() {
  local d=$RES/hfkernels && mkdir -p "$d"
  hf_kernels_kit
  bounded 480 "$d/model_step_llama.log" env PYTHONPATH="/tmp/hfk${PYTHONPATH:+:$PYTHONPATH}" \
    python3 benchmarks/model_step.py "$d/$day-nvidia-h200-model-step-route-llama.json" --route --hidden 4096 \
    --optimizer adamw
}

section_hfkernelsqwen3() {
  local d=$RES/hfkernels && mkdir -p "$d"
  hf_kernels_kit
  bounded 480 "$d/model_step_qwen3.log" env PYTHONPATH="/tmp/hfk${PYTHONPATH:+:$PYTHONPATH}" \
    python3 benchmarks/model_step.py "$d/$day-nvidia-h200-model-step-route-qwen3.json" --route --model qwen3 \
    --hidden 4096 --optimizer adamw --compile-scope layers
}

for section in "$@"; do
  "section_$section"
done
tar -C "$RES" -czf "$OUT/round.tgz" .
