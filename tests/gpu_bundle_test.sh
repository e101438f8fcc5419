#!/usr/bin/env bash
# The GPU bundle (scripts/gpu-bundle.sh), made from this build and copied alone to another folder:
# with a bare environment (env -i, no build folder or -dev library on any search path), ldd finds
# every library of every program inside the bundle or in the base system, and the programs run
# (the GPU tests skip without a device, saying so).
#   bash tests/gpu_bundle_test.sh BUILD
set -euo pipefail
build=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bash scripts/gpu-bundle.sh "$build" "$tmp/made"
mv "$tmp/made" "$tmp/moved"
lib=$(readlink -f "$tmp/moved/lib")
bare=(env -i PATH=/usr/bin:/bin)
source scripts/gpu-base-libs.sh
base=$GPU_BASE_LIBS
fail=0
for f in "$tmp"/moved/bin/*; do
  while read -r name _ path _; do
    if [[ $path == "not" ]]; then
      echo "FAIL: $(basename "$f") needs $name: not found" >&2
      fail=1
    elif [[ $(readlink -f "$path") != "$lib/"* && ! $name =~ $base ]]; then
      echo "FAIL: $(basename "$f") loads $name from $path, outside the bundle and the base system" >&2
      fail=1
    fi
  done < <("${bare[@]}" ldd "$f" | awk '/=>/ {print $1, $2, $3, $4}')
done
"${bare[@]}" "$tmp/moved/bin/ragshardd" --help >/dev/null || { echo "FAIL: ragshardd --help" >&2; fail=1; }
for t in gpu_test nccl_api_test; do
  "${bare[@]}" "$tmp/moved/bin/$t" >"$tmp/$t.log" 2>&1 || { cat "$tmp/$t.log" >&2; echo "FAIL: $t" >&2; fail=1; }
done
exit $fail
