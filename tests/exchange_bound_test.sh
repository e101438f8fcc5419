#!/usr/bin/env bash
# bench/exchange_bound at tiny sizes: its rows parse as bench_common.h's CSV (what
# bench/collectives_report.py reads), for 2 daemons x 1 and x 2 ranks, and bad flags are refused
# with exit 2 and an error naming what is wrong (issue 52, "Bad input").
#   bash tests/exchange_bound_test.sh BUILD/bench/exchange_bound
set -uo pipefail
bin=$1
fail=0
check_rows() {  # config members output
  python3 - "$1" "$2" "$3" <<'PY' || fail=1
import sys
config, members, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
seen = set()
for line in out.splitlines():
    impl, op, n, size, sec, alg, bus = line.split(",")
    assert impl == f"exchange-bound-{config}", line
    assert op in ("allgather", "reducescatter"), line
    assert int(n) == members, line
    assert float(sec) > 0 and float(alg) > 0 and float(bus) > 0, line
    assert abs(float(bus) - float(alg) * (members - 1) / members) < 1e-3 + 1e-3 * float(alg), line
    seen.add((op, int(size)))
want = {(op, s) for op in ("allgather", "reducescatter") for s in (65536, 1 << 20)}
assert seen == want, f"{config}: rows {sorted(seen)}, want {sorted(want)}"
print(f"ok: exchange-bound-{config}: {len(seen)} rows parse")
PY
}
for cfg in "1 2" "2 4"; do
  set -- $cfg
  out=$(timeout 120 "$bin" --daemons 2 --ranks "$1" --sizes 64K,1M)
  rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "FAIL: exchange_bound --ranks $1 --sizes 64K,1M: exit $rc" >&2
    fail=1
  else
    check_rows "2x$1" "$2" "$out"
  fi
done
# Bad input: exit 2 and the name of what is wrong.
refuse() {  # pattern flags...
  local pattern=$1
  shift
  local err
  err=$(timeout 60 "$bin" "$@" 2>&1 >/dev/null)
  local rc=$?
  if [[ $rc -ne 2 ]] || ! grep -q -- "$pattern" <<<"$err"; then
    echo "FAIL: exchange_bound $*: exit $rc, want 2 and '$pattern' in: ${err:0:300}" >&2
    fail=1
  else
    echo "ok: exchange_bound $* refused: $(grep -m1 -- "$pattern" <<<"$err")"
  fi
}
refuse "'0' is not a positive size" --sizes 0
refuse "'-1M' is not a positive size" --sizes 64K,-1M
refuse "--max-mib 0 is not positive" --max-mib 0
refuse "--max-mib -16 is not positive" --max-mib -16
refuse "--members 3 is more than --daemons 2" --daemons 2 --members 3
refuse "--members must be at least 2" --members 1
refuse "UCX does not know transport 'nosuchtl'" --transport nosuchtl --sizes 64K
refuse "UCX does not know transport 'nosuchtl'" --transport tcp,nosuchtl --sizes 64K
refuse "unknown flag --bogus" --bogus 1
[[ $fail -eq 0 ]] && echo "ok: exchange_bound"
exit $fail
