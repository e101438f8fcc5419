#!/usr/bin/env bash
# Runs clang-tidy (the checks .clang-tidy enables) on every C++ source under infra/, engine/,
# protocol/, client/, ctl/ and server/, and on python/ragshard_c.cc, with the build's compile database. CUDA sources (.cu)
# are not checked. Exits 1 naming the count when any check warns.
#
#   scripts/lint.sh [BUILD_DIR]      (default: build; configure it first, as scripts/test.sh does)
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
db="$build/compile_commands.json"
[[ -f "$db" ]] || { echo "lint: $db not found: configure the build first" >&2; exit 2; }
command -v clang-tidy > /dev/null || { echo "lint: clang-tidy not found (scripts/install-deps.sh)" >&2; exit 2; }
# Only the sources the build compiles (the database's files), so that optional parts are checked
# exactly when they are built.
mapfile -t files < <(python3 - "$db" "$PWD" <<'PY'
import json, os, re, sys
db, root = sys.argv[1], sys.argv[2]
wanted = re.compile(r'^(infra|engine|protocol|client|ctl|server)/.*\.cc$|^python/ragshard_c\.cc$')
seen = set()
for entry in json.load(open(db)):
    path = os.path.relpath(os.path.join(entry['directory'], entry['file']), root)
    if wanted.match(path) and path not in seen:
        seen.add(path)
        print(path)
PY
)
log="$build/clang-tidy.log"
echo "lint: clang-tidy on ${#files[@]} files, $(nproc) at a time (output: $log)"
start=$SECONDS
status=0
printf '%s\n' "${files[@]}" | xargs -P "$(nproc)" -n 1 clang-tidy -p "$build" --quiet \
    --warnings-as-errors='*' > "$log" 2>&1 || status=$?
warnings=$(grep -cE '(warning|error): .*\[[A-Za-z0-9.,-]+\]$' "$log" || true)
echo "lint: ${warnings} finding(s) in $((SECONDS - start)) s"
if [[ $status -ne 0 || $warnings -ne 0 ]]; then
  grep -E '(warning|error): ' "$log" | sort -u | head -100
  exit 1
fi
