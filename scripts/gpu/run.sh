#!/usr/bin/env bash
# The GPU bundle's one command (docs/gpu.md): on a machine with a GPU, checks the GPU, the driver
# and NCCL, runs the CUDA backend's tests, trains on the CUDA backend and compares with the host
# backend, recovers a killed rank in place on it, reads the device's memory, and measures the intra-device data plane and the FP8
# kernels; on any machine, checks the bundle's libraries, programs, host data plane and Python
# package. Where there is no GPU every GPU check is reported as skipped, with the reason.
#
#   bash run.sh OUTDIR        (PYTHON=... picks the interpreter; default python3)
#
# Writes OUTDIR/summary.json, OUTDIR/summary.md, OUTDIR/checks/*.json and OUTDIR/logs/; exits 1
# if a check failed, 2 on bad usage.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [[ $# -ne 1 || -z $1 ]]; then
  echo "usage: bash run.sh OUTDIR" >&2
  exit 2
fi
out=$1
mkdir -p "$out/checks" "$out/logs" || exit 2
out=$(cd "$out" && pwd)
rm -f "$out"/checks/*.json
export PATH="$here/bin:$PATH"
py=${PYTHON:-python3}
started=$(date +%s)

# JSON string contents: backslashes and quotes escaped, newlines as \n, tabs as spaces, other
# control characters and bytes that are not UTF-8 dropped.
esc() {
  local s
  if command -v iconv >/dev/null; then
    s=$(printf '%s' "$1" | iconv -c -f UTF-8 -t UTF-8 | tr -d '\000-\010\013-\037')
  else
    s=$(printf '%s' "$1" | LC_ALL=C tr -d '\000-\010\013-\037\200-\377')
  fi
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/\\n}
  printf '%s' "${s//$'\t'/ }"
}
# Each program gets at most this long (a hang in NCCL or a stuck peer is a failure, not a hang).
limit=300
# record NAME passed|failed|skipped REASON [FIGURES (a JSON object)]
record() {
  local figures=${4:-}
  printf '{"name": "%s", "status": "%s", "reason": "%s", "figures": %s}\n' \
    "$1" "$2" "$(esc "${3:-}")" "${figures:-"{}"}" >"$out/checks/$1.json"
  echo "$1: $2${3:+ ($3)}"
}

# -- the GPU, the driver, NCCL ------------------------------------------------------------------
gpu=0 no_gpu=""
if ! command -v nvidia-smi >/dev/null; then
  no_gpu="no GPU: nvidia-smi is not on PATH"
elif ! info=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1); then
  no_gpu="no GPU: nvidia-smi: $(echo "$info" | head -1)"
elif [[ -z $info ]]; then
  no_gpu="no GPU: nvidia-smi lists none"
else
  gpu=1
  device=$(echo "$info" | head -1)
  record gpu passed "" "{\"devices\": \"$(esc "$info")\", \"count\": $(echo "$info" | wc -l)}"
fi
[[ $gpu == 1 ]] || record gpu skipped "$no_gpu"

have_py=0
if command -v "$py" >/dev/null && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  have_py=1
fi
if [[ $gpu == 1 ]]; then
  nccl=""
  [[ $have_py == 1 ]] && nccl=$("$py" "$here/tools/checks.py" "$here" "$out" nccl 2>/dev/null)
  if [[ -z $nccl ]]; then
    nccl=$(PATH=$PATH:/sbin:/usr/sbin ldconfig -p 2>/dev/null | awk '/libnccl.so.2 / {print $NF; exit}')
  fi
  if [[ -n $nccl && -f $nccl ]]; then
    export RAGSHARD_NCCL_LIBRARY=$nccl
    record nccl passed "" "{\"library\": \"$(esc "$nccl")\"}"
  else
    record nccl failed "no libnccl.so.2: not in RAGSHARD_NCCL_LIBRARY, in $py's nvidia-nccl wheel or in ldconfig's cache"
  fi
else
  record nccl skipped "$no_gpu"
fi

# -- the CUDA backend's tests --------------------------------------------------------------------
if [[ $gpu == 1 ]]; then
  failed=() skipped=() ran=0
  for t in gpu_test gpu_data_plane_test nccl_api_test; do
    log=$out/logs/$t.log
    if ! timeout "$limit" "$here/bin/$t" >"$log" 2>&1; then failed+=("$t"); fi
    grep -q '\[  SKIPPED \]' "$log" && skipped+=("$t")
    ran=$((ran + $(grep -c '^\[       OK \] \|^\[  FAILED  \] .* ([0-9]* ms)$' "$log")))
  done
  if ((${#failed[@]})); then
    record cuda_tests failed "failing: ${failed[*]} (logs/)" "{\"tests\": $ran}"
  elif ((${#skipped[@]})); then
    record cuda_tests failed "tests skipped on a GPU machine: ${skipped[*]} (logs/)" "{\"tests\": $ran}"
  else
    record cuda_tests passed "" "{\"tests\": $ran}"
  fi
  lines=$(timeout "$limit" "$here/bin/gpu_data_plane_bench" --max-mib 256 --reps 5 2>"$out/logs/gpu_data_plane_bench.log")
  rc=$?
  if [[ $rc == 0 ]] && ! grep -q '"error"\|"skipped"' <<<"$lines"; then
    record data_plane_bandwidth passed "" "{\"sizes\": [$(paste -sd, <<<"$lines")]}"
  else
    record data_plane_bandwidth failed "gpu_data_plane_bench exit $rc: $(tail -1 <<<"$lines") $(tail -1 "$out/logs/gpu_data_plane_bench.log")"
  fi
else
  for c in cuda_tests data_plane_bandwidth; do record "$c" skipped "$no_gpu"; done
fi

# -- the host side: libraries, programs, the host data plane --------------------------------------
missing=()
if command -v ldd >/dev/null; then
  for f in "$here"/bin/* "$here"/lib/* "$here"/python/ragshard/*.so; do
    while read -r name _; do missing+=("$(basename "$f"): $name"); done < <(ldd "$f" 2>/dev/null | grep 'not found')
  done
  if ((${#missing[@]})); then
    record libraries failed "the loader cannot find: ${missing[*]}"
  else
    record libraries passed "" "{\"files\": $(ls "$here"/bin/* "$here"/lib/* "$here"/python/ragshard/*.so | wc -l)}"
  fi
else
  record libraries skipped "no ldd on this machine"
fi
bad=()
for p in ragshardd ragshard-planner ragshardctl; do
  "$here/bin/$p" --help >"$out/logs/$p-help.log" 2>&1 && grep -qi usage "$out/logs/$p-help.log" || bad+=("$p")
done
if ((${#bad[@]})); then record programs failed "--help fails: ${bad[*]}"; else record programs passed; fi
if rows=$(timeout "$limit" "$here/bin/daemon_bench" --config 2x1 --bytes 4194304 2>"$out/logs/daemon_bench.log"); then
  record host_data_plane passed "" "{\"daemon_bench_2x1_4MiB\": \"$(esc "$rows")\"}"
else
  record host_data_plane failed "daemon_bench: $(tail -1 "$out/logs/daemon_bench.log")"
fi

# -- Python: the package, training on both backends, the device's memory, FP8 --------------------
if [[ $have_py == 1 ]]; then
  for c in package training recovery; do
    RAGSHARD_BUNDLE_GPU=$gpu timeout "$limit" "$py" "$here/tools/checks.py" "$here" "$out" "$c" >>"$out/logs/python-$c.log" 2>&1
  done
  [[ -f $out/checks/python_package.json ]] || record python_package failed "checks.py package wrote nothing (logs/python-package.log)"
  [[ -f $out/checks/training_host.json ]] || record training_host failed "checks.py training wrote nothing (logs/python-training.log)"
  rec=recovery_host
  [[ $gpu == 1 ]] && rec=recovery_cuda
  [[ -f $out/checks/$rec.json ]] || record "$rec" failed "checks.py recovery wrote nothing (logs/python-recovery.log)"
else
  record python_package skipped "no CPython 3.10 or later at '$py'"
  record training_host skipped "no CPython 3.10 or later at '$py'"
  record recovery_host skipped "no CPython 3.10 or later at '$py'"
fi
if [[ $gpu == 1 && $have_py == 0 ]]; then record recovery_cuda skipped "no CPython 3.10 or later at '$py'"; fi
if [[ $gpu == 0 ]]; then record recovery_cuda skipped "$no_gpu"; fi
if [[ $gpu == 1 ]]; then record recovery_host skipped "a GPU: the trial ran on the CUDA backend (recovery_cuda)"; fi
if [[ $gpu == 1 && $have_py == 1 ]]; then
  timeout "$limit" "$py" "$here/tools/checks.py" "$here" "$out" quant >>"$out/logs/python-quant.log" 2>&1
  for c in training_cuda memory_cuda quant_bandwidth; do
    [[ -f $out/checks/$c.json ]] || record "$c" failed "checks.py wrote nothing (logs/python-*.log)"
  done
else
  why=$no_gpu
  [[ $gpu == 1 ]] && why="no CPython 3.10 or later at '$py'"
  for c in training_cuda memory_cuda quant_bandwidth; do record "$c" skipped "$why"; done
fi

# -- the summary -----------------------------------------------------------------------------------
order=(gpu nccl cuda_tests training_cuda memory_cuda recovery_cuda data_plane_bandwidth
  quant_bandwidth libraries programs host_data_plane python_package training_host recovery_host)
seconds=$(($(date +%s) - started))
nfail=0
items=()
{
  echo "# GPU bundle run"
  echo
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname 2>/dev/null || echo '?'): ${device:-no GPU}; $seconds s."
  echo
  echo "| check | status | reason | figures |"
  echo "|---|---|---|---|"
} >"$out/summary.md"
for c in "${order[@]}"; do
  f=$out/checks/$c.json
  [[ -f $f ]] || record "$c" failed "the check wrote no result"
  items+=("$(cat "$f")")
  status=$(grep -o '"status": "[a-z]*"' "$f" | head -1 | cut -d'"' -f4)
  [[ $status == failed ]] && nfail=$((nfail + 1))
  reason=$(grep -o '"reason": "[^"]*' "$f" | head -1 | cut -d'"' -f4)
  figures=$(sed 's/.*"figures": //; s/}$//' "$f")
  echo "| $c | $status | ${reason//|/\\|} | \`${figures//|/\\|}\` |" >>"$out/summary.md"
done
{
  printf '{"date": "%s", "device": "%s", "gpu": %s, "seconds": %d, "failed": %d, "checks": [\n' \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(esc "${device:-none}")" \
    "$([[ $gpu == 1 ]] && echo true || echo false)" "$seconds" "$nfail"
  (IFS=$'\n'; paste -sd, <<<"${items[*]}")
  echo "]}"
} >"$out/summary.json"
echo "run.sh: $nfail failed; $out/summary.json, $out/summary.md ($seconds s)"
((nfail == 0))
