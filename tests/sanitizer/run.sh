#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and synccheck over tests/sanitizer/cases.py (on a GPU).
# Kernels are compiled first without the sanitizer (it slows the DSL compiler down), then each tool
# runs the same workload; logs go to ${1:-sanitizer-logs}/<tool>.log. A second argument runs only the
# cases whose label starts with it (cases.py's docstring).
set -uo pipefail
out=${1:-sanitizer-logs}
mkdir -p "$out"
here=$(dirname "${BASH_SOURCE[0]}")
only=${2:-}
python3 "$here/cases.py" "$only" > "$out/plain.log" 2>&1 || { cat "$out/plain.log"; exit 1; }
status=0
# --report-api-errors no: cuda-python resolves driver entry points with cuGetProcAddress, and the
# lookups of symbols this driver lacks return CUDA_ERROR_INVALID_VALUE by design; memcheck would
# count each as an error although no memory access is involved.
for tool in memcheck racecheck synccheck; do
  compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 python3 "$here/cases.py" "$only" > "$out/$tool.log" 2>&1
  rc=$?
  echo "$tool: exit $rc, $(grep -c '^ok ' "$out/$tool.log") cases ok; $(grep 'ERROR SUMMARY' "$out/$tool.log" | tail -1)"
  [[ $rc == 0 ]] || status=1
done
exit $status
