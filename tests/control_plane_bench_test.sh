#!/usr/bin/env bash
# bench/control_plane_bench end to end at a tiny size (issue 73): its simulated nodes spread over
# several simulator processes register a model with a real planner, every node holds the one
# plan, the rendezvous answers every node every address, heartbeats flow on their streams (and
# on unary calls with --unary-heartbeats), each process reports its CPU; bad flags are refused
# by name.
#   bash tests/control_plane_bench_test.sh BUILD/bench/control_plane_bench
set -uo pipefail
bench=$1
fail=0
check() {  # check NAME JSON: the run's figures, as a passing run has them
  python3 - "$1" "$2" <<'PY' || fail=1
import json, sys
name, text = sys.argv[1], sys.argv[2]
d = json.loads(text.strip().splitlines()[-1])
want = {"nodes_holding_plan": 6, "mismatched_plans": 0, "failed_calls": 0,
        "rendezvous_wrong_answers": 0, "final_job_status": "JOB_READY", "ranks": 12,
        "simulator_processes": 3}
bad = {k: (d.get(k), v) for k, v in want.items() if d.get(k) != v}
if len(d.get("simulator_cpu_s", [])) != 3:
    bad["simulator_cpu_s"] = d.get("simulator_cpu_s")
if not d.get("heartbeats", 0) > 0:
    bad["heartbeats"] = d.get("heartbeats")
if not 0 < d.get("ready_s", -1) <= d.get("all_nodes_hold_plan_s", -1):
    bad["times"] = (d.get("ready_s"), d.get("all_nodes_hold_plan_s"))
if bad:
    sys.exit(f"FAIL: {name}: {bad}")
print(f"ok: {name}: READY {d['ready_s']:.2f} s, {d['heartbeats']} heartbeats")
PY
}
for how in "" --unary-heartbeats; do
  out=$(timeout 240 "$bench" --nodes 6 --ranks-per-node 2 --processes 3 --model llama-7b \
    --heartbeat-s 3 --json $how 2>/tmp/control_plane_bench_test.$$.err)
  rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "FAIL: control_plane_bench $how: exit $rc: ${out:0:600}" >&2
    tail -20 /tmp/control_plane_bench_test.$$.err >&2
    fail=1
  else
    check "control_plane_bench ${how:-(streams)}" "$out"
  fi
done
rm -f /tmp/control_plane_bench_test.$$.err
# Bad flags: refused at once, by name (exit 2, or CLI11's code for a value out of its range).
for args in "--model nope" "--granule rows:x" "--nodes 1 --ranks-per-node 1" "--processes 99"; do
  err=$(timeout 60 "$bench" $args 2>&1 >/dev/null)
  rc=$?
  name=${args%% *}
  [[ $args == "--nodes 1 --ranks-per-node 1" ]] && name="--ranks-per-node"
  if [[ $rc -eq 0 || $rc -eq 1 ]] || ! grep -q -- "$name" <<<"$err"; then
    echo "FAIL: control_plane_bench $args: exit $rc: ${err:0:300}" >&2
    fail=1
  fi
done
[[ $fail -eq 0 ]] && echo "ok: control_plane_bench"
exit $fail
