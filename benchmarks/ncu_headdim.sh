#!/usr/bin/env bash
# bash benchmarks/ncu_headdim.sh OUT_DIR: Nsight Compute over the head-dim shapes where a peer leads
# (evidence/kernel-rules-h200-2026-12-01/headdim-ncu/): one ncu run per (implementation, case), text report per run in $1. IMPLS (default: cake_cute and the case's peer)
# narrows the implementations, e.g. IMPLS=compile.
set -u
out=$1
here=$(dirname "$0")
cases=(
  "fwd bf16 64 65536 1"
  "fwd bf16 128 65536 0"
  "fwd bf16 128 1048576 0"
  "bwd fp32 80 1048576 1"
  "bwd bf16 64 1048576 0"
)
peers=(compile compile compile compile quack)
for i in "${!cases[@]}"; do
  set -- ${cases[$i]}
  tag="$1-$2-h$3-t$4-r$5"
  for impl in ${IMPLS:-cake_cute ${peers[$i]}}; do
    timeout 120 ncu --profile-from-start off --section SpeedOfLight --section LaunchStats --section Occupancy \
      --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
      python3 "$here/ncu_call.py" "$impl" ${cases[$i]} > "$out/$tag-$impl.txt" 2>&1
    echo "$tag $impl rc=$? $(grep -c 'Duration' "$out/$tag-$impl.txt") kernels"
  done
done
