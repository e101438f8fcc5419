#!/usr/bin/env bash
# The GPU bundle (scripts/gpu-bundle.sh), made from this build and copied alone to another folder:
# with a bare environment (env -i, no build folder or -dev library on any search path), ldd finds
# every library of every program inside the bundle or in the base system, the programs run (the
# GPU tests skip without a device, saying so), and `bash run.sh OUT` runs to its end: with the
# system's python3 (no numpy, no torch), and with PYTHON (the project's .venv, with torch) for the
# training and recovery checks. On a machine without a GPU every GPU check must say "skipped", "no GPU...", and
# every host check must pass (training_host only where PYTHON has torch).
#   bash tests/gpu_bundle_test.sh BUILD [PYTHON]
set -euo pipefail
build=$(cd "$1" && pwd)
python=${2:-}
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
for f in "$tmp"/moved/bin/* "$tmp"/moved/python/ragshard/*.so; do
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

# run.sh, bare, then with PYTHON; summary.json checked with the system's python3.
check_summary() {  # OUT HOST_CHECKS_THAT_MUST_PASS...
  /usr/bin/python3 - "$@" <<'PY'
import json, sys
out, must_pass = sys.argv[1], sys.argv[2:]
s = json.load(open(out + "/summary.json"))
by = {c["name"]: c for c in s["checks"]}
gpu_checks = ["gpu", "nccl", "cuda_tests", "training_cuda", "memory_cuda", "recovery_cuda",
              "data_plane_bandwidth", "quant_bandwidth"]
bad = [n for n in must_pass if by.get(n, {}).get("status") != "passed"]
if not s["gpu"]:
    bad += [n for n in gpu_checks if by.get(n, {}).get("status") != "skipped" or
            not by[n]["reason"].startswith("no GPU")]
bad += [n for n, c in by.items() if c["status"] == "failed"]
if bad or s["failed"]:
    sys.exit(f"FAIL: {out}: checks {sorted(set(bad))}: {json.dumps(s['checks'], indent=1)}")
print(f"{out}: " + ", ".join(f"{n} {c['status']}" for n, c in by.items()))
PY
}
host_checks=(libraries programs host_data_plane python_package)
if "${bare[@]}" bash "$tmp/moved/run.sh" "$tmp/out-bare" >"$tmp/run-bare.log" 2>&1; then
  check_summary "$tmp/out-bare" "${host_checks[@]}" || fail=1
else
  cat "$tmp/run-bare.log" >&2
  echo "FAIL: run.sh (bare) exited non-zero" >&2
  fail=1
fi
if [[ -n $python ]]; then
  if "${bare[@]}" PYTHON="$python" bash "$tmp/moved/run.sh" "$tmp/out-py" >"$tmp/run-py.log" 2>&1; then
    check_summary "$tmp/out-py" "${host_checks[@]}" training_host recovery_host || fail=1
  else
    cat "$tmp/run-py.log" "$tmp"/out-py/logs/python-*.log >&2
    echo "FAIL: run.sh (PYTHON=$python) exited non-zero" >&2
    fail=1
  fi
fi
exit $fail
