#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and synccheck over tests/sanitizer/cases.py (on a GPU).
# Kernels are compiled first without the sanitizer (it slows the DSL compiler down), then each tool
# runs the same workload; logs go to ${1:-sanitizer-logs}/<tool>.log.
set -uo pipefail
out=${1:-sanitizer-logs}
mkdir -p "$out"
here=$(dirname "${BASH_SOURCE[0]}")
python3 "$here/cases.py" > "$out/plain.log" 2>&1 || { cat "$out/plain.log"; exit 1; }
status=0
for tool in memcheck racecheck synccheck; do
  compute-sanitizer --tool "$tool" --error-exitcode 9 python3 "$here/cases.py" > "$out/$tool.log" 2>&1
  rc=$?
  echo "$tool: exit $rc, $(grep -c '^ok ' "$out/$tool.log") cases ok; $(grep 'ERROR SUMMARY' "$out/$tool.log" | tail -1)"
  [[ $rc == 0 ]] || status=1
done
exit $status
