#!/usr/bin/env bash
# `pip install .` as a user does it, into a fresh virtual environment: then `import ragshard.torch`,
# `--help` of ragshard-launch, ragshardctl, ragshard-planner and ragshardd from the environment's
# bin/, and a 3-step training through the installed package and programs that must match the
# one-process reference within 1e-5.
#
# To stay inside CI's time, it reuses the project's build folder (scikit-build-core's build-dir:
# nothing is compiled twice) and sees torch and numpy from the project's .venv through a .pth
# file (nothing is downloaded). ctest runs it alone (RUN_SERIAL): it reconfigures that folder.
# Usage: pip_install_test.sh SOURCE_DIR BUILD_DIR PYTHON
set -euo pipefail
src=$(cd "$1" && pwd)
build=$(cd "$2" && pwd)
py=$(cd "$(dirname "$3")" && pwd)/$(basename "$3")
tmp=$(mktemp -d -t ragshard-pip-XXXXXX)
# Leave the build folder configured as before: its interpreter back, scikit-build-core's
# variables (paths into a temporary wheel folder) gone.
restore() {
  cmake -DPython_EXECUTABLE="$py" -U 'SKBUILD*' "$build" >/dev/null || true
  rm -rf "$tmp"
}
trap restore EXIT
unset PYTHONPATH

"$py" -m venv "$tmp/v"
v="$tmp/v/bin"
deps=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
site=$("$v/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$deps" >"$site/ragshard-test-deps.pth"

echo "== pip install $src (build-dir $build)"
"$v/python" -m pip install -q --disable-pip-version-check --no-index --no-deps \
  --no-build-isolation --config-settings=build-dir="$build" \
  --config-settings=cmake.define.RAGSHARD_BUILD_TESTS=ON \
  --config-settings=cmake.define.RAGSHARD_BUILD_BENCH=ON "$src"

cd "$tmp"
where=$("$v/python" -c 'import ragshard.torch, ragshard; print(ragshard.__file__)')
case "$where" in
  "$tmp/v/"*) echo "== import ragshard.torch: $where" ;;
  *) echo "FAIL: ragshard imported from $where, not from the new environment" >&2; exit 1 ;;
esac
for prog in ragshard-launch ragshardctl ragshard-planner ragshardd; do
  if [ ! -x "$v/$prog" ]; then echo "FAIL: $prog is not in $v" >&2; exit 1; fi
  "$v/$prog" --help >"$tmp/help.txt" 2>&1 || { cat "$tmp/help.txt"; echo "FAIL: $prog --help" >&2; exit 1; }
  grep -qi "usage" "$tmp/help.txt" || { cat "$tmp/help.txt"; echo "FAIL: $prog --help prints no usage" >&2; exit 1; }
  echo "== $prog --help: ok"
done

echo "== training through the installed package"
PATH="$v:$PATH" "$v/python" - "$src/examples/train_tiny.py" "$tmp" <<'PY'
import json, subprocess, sys
from ragshard.cluster import LocalCluster

example, tmp = sys.argv[1], sys.argv[2]
small = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
         "--vocab", "32", "--steps", "3", "--quiet"]
with LocalCluster(None, daemons=2, pool_bytes=64 << 20) as c:
    subprocess.run(["ragshard-launch", "--planner", c.planner, "--job", "pip", "--nproc", "2",
                    "--sockets", ",".join(c.sockets), "--create-job", example,
                    "--out", f"{tmp}/sharded"] + small, check=True, timeout=600)
subprocess.run([sys.executable, example, "--reference", "--world", "2",
                "--out", f"{tmp}/ref"] + small, check=True, timeout=600)
a = json.load(open(f"{tmp}/sharded.json"))["losses"]
b = json.load(open(f"{tmp}/ref.json"))["losses"]
print("losses", a, "reference", b)
assert len(a) == len(b) == 3
for step, (x, y) in enumerate(zip(a, b)):
    assert abs(x - y) <= 1e-5 * abs(y), f"step {step + 1}: {x} vs reference {y}"
PY
echo "pip install test: passed"
