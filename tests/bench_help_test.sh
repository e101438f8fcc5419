#!/usr/bin/env bash
# Every benchmark program's --help prints its usage and exits 0 at once, without running the
# benchmark or starting a server (issue 26); and every Python report script under bench/ parses.
#   bash tests/bench_help_test.sh BUILD/bench
set -uo pipefail
dir=$1
fail=0
count=0
for b in "$dir"/*; do
  [[ -f $b && -x $b ]] || continue
  count=$((count + 1))
  out=$(timeout 20 "$b" --help 2>&1)
  rc=$?
  if [[ $rc -ne 0 ]] || ! grep -qi "usage" <<<"$out"; then
    echo "FAIL: $(basename "$b") --help: exit $rc: ${out:0:300}" >&2
    fail=1
  fi
done
if [[ $count -lt 5 ]]; then
  echo "FAIL: only $count benchmark programs in $dir" >&2
  fail=1
fi
# The report scripts (python3's parser: no bytecode written, nothing imported or run).
scripts=("$(dirname "$0")"/../bench/*.py)
if ! python3 -c 'import ast, sys
for f in sys.argv[1:]:
    ast.parse(open(f).read(), f)' "${scripts[@]}"; then
  echo "FAIL: a report script under bench/ does not parse" >&2
  fail=1
fi
[[ $fail -eq 0 ]] && echo "ok: $count benchmark programs print their usage; ${#scripts[@]} report scripts parse"
exit $fail
