#!/usr/bin/env bash
# Runs clang-tidy (the checks .clang-tidy enables) on every C++ source under infra/, engine/,
# protocol/, client/, ctl/ and server/, and on python/ragshard_c*.cc, with the build's compile
# database. CUDA sources (.cu) are not checked. Exits 1 naming the findings when any check warns.
#
#   scripts/lint.sh [--all] [BUILD_DIR]      (default: build; build it first, as scripts/test.sh
#                                             does)
#
# A source found clean is not checked again while nothing its findings depend on changes: its
# key (scripts/lint_inputs.py: the clang-tidy version, .clang-tidy, its compile command and every
# file its compilation read) is recorded in .ci/lint-clean.txt, and a source whose key is there
# is skipped. --all checks every source. The record is rewritten after each run: commit it with
# the sources it speaks of (docs/testing.md, "Lint").
set -euo pipefail
cd "$(dirname "$0")/.."
all=0
if [[ "${1:-}" == --all ]]; then all=1; shift; fi
build="${1:-build}"
db="$build/compile_commands.json"
[[ -f "$db" ]] || { echo "lint: $db not found: configure the build first" >&2; exit 2; }
command -v clang-tidy > /dev/null || { echo "lint: clang-tidy not found (scripts/install-deps.sh)" >&2; exit 2; }
# Only the sources the build compiles (the database's files), so that optional parts are checked
# exactly when they are built.
mapfile -t files < <(python3 scripts/lint_inputs.py "$build" list)
record=.ci/lint-clean.txt
touch "$record"
declare -A key
todo=()
while read -r k f; do
  key[$f]=$k
  if [[ $all -eq 1 || $k == - ]] || ! grep -qxF "$k $f" "$record"; then todo+=("$f"); fi
done < <(python3 scripts/lint_inputs.py "$build" keys "${files[@]}")
log="$build/clang-tidy.log"
work="$build/lint"
rm -rf "$work" && mkdir -p "$work"
echo "lint: clang-tidy on ${#todo[@]} of ${#files[@]} files, $(nproc) at a time (the others" \
  "unchanged since found clean: $record; output: $log)"
start=$SECONDS
lint_one() {
  local out="$LINT_WORK/${1//\//_}"
  local rc=0
  clang-tidy -p "$LINT_BUILD" --quiet --warnings-as-errors='*' "$1" > "$out.log" 2>&1 || rc=$?
  echo "$rc" > "$out.rc"
}
export -f lint_one
export LINT_WORK="$work" LINT_BUILD="$build"
if [[ ${#todo[@]} -gt 0 ]]; then
  printf '%s\n' "${todo[@]}" | xargs -P "$(nproc)" -n 1 bash -c 'lint_one "$0"'
fi
cat /dev/null "$work"/*.log > "$log" 2> /dev/null || true
finding='(warning|error): .*\[[A-Za-z0-9.,-]+\]$'
failed=()
declare -A fresh
for f in "${todo[@]}"; do
  out="$work/${f//\//_}"
  if [[ "$(cat "$out.rc" 2> /dev/null)" == 0 ]] && ! grep -qE "$finding" "$out.log"; then
    fresh[$f]=1
  else
    failed+=("$f")
  fi
done
# The record: every source clean now (skipped as recorded, or checked clean), by its key.
for f in "${files[@]}"; do
  k=${key[$f]}
  [[ $k == - ]] && continue
  if [[ -n "${fresh[$f]:-}" ]] || { [[ $all -eq 0 ]] && grep -qxF "$k $f" "$record"; }; then
    echo "$k $f"
  fi
done | sort -k2 > "$record.new"
mv "$record.new" "$record"
warnings=$(grep -cE "$finding" "$log" || true)
echo "lint: ${warnings} finding(s) in $((SECONDS - start)) s"
if [[ ${#failed[@]} -ne 0 ]]; then
  echo "lint: failed: ${failed[*]}"
  grep -E '(warning|error): ' "$log" | sort -u | head -100
  exit 1
fi
