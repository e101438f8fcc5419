#!/usr/bin/env bash
# The README's run command: installs what is missing, builds, starts a planner (data directory
# in a temporary folder) and 2 daemons on loopback, trains a small decoder-only transformer with
# 4 ranks (2 per daemon) through ragshard, shows progress, prints `ragshardctl jobs` and
# `plan metrics`, scrapes the planner's and the daemons' Prometheus endpoints (printing their
# non-zero series: operation counts, latency histograms, pool figures) and shuts everything down.
# The job uses policy auto: the planner's strategy search picks the shard group and unit
# grouping for this machine's profile (profiles/host-2x2-loopback.json), shown by `plan show`.
#   DEMO_STEPS (default 30), DEMO_OPTIMIZER (adamw or muon), DEMO_POLICY (auto, ragged),
#   BUILD_DIR (default build), DEMO_SKIP_BUILD=1 (use BUILD_DIR as it is: the test of this script).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
if [[ "${DEMO_SKIP_BUILD:-0}" != 1 ]]; then
  bash scripts/install-deps.sh >/dev/null
  echo "== building (first time: several minutes)"
  cmake -S . -B "$BUILD_DIR" -G Ninja -DPython_EXECUTABLE="$PWD/.venv/bin/python" >/dev/null
  cmake --build "$BUILD_DIR" -j "$(nproc)" --target ragshard-planner ragshardd ragshardctl \
    ragshard_c ragshard_python >/dev/null
fi
export PYTHONPATH="$PWD/$BUILD_DIR/python${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python - "$BUILD_DIR" "${DEMO_STEPS:-30}" "${DEMO_OPTIMIZER:-adamw}" \
  "${DEMO_POLICY:-auto}" <<'PY'
import subprocess, sys
from ragshard.cluster import LocalCluster
from ragshard.metrics import format_series, nonzero, scrape

build, steps, optimizer, policy = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
ctl = [f"{build}/ctl/ragshardctl"]
with LocalCluster(build, daemons=2, pool_bytes=512 << 20, metrics=True,
                  cluster_profile="profiles/host-2x2-loopback.json") as c:
    print(f"== planner at {c.planner}; daemons node-0, node-1 on {c.dir}", flush=True)
    print(f"== the planner's access token: {c.token_file} (mode 600; every client below reads "
          "it from RAGSHARD_TOKEN_FILE)", flush=True)
    print(f"== training examples/train_tiny.py: 4 ranks over 2 daemons, {steps} steps, "
          f"{optimizer}, policy {policy}", flush=True)
    subprocess.run([sys.executable, "-m", "ragshard.launch", "--planner", c.planner,
                    "--job", "demo", "--nproc", "4", "--sockets", ",".join(c.sockets),
                    "--create-job", "--policy", policy,
                    # train_tiny's defaults: 4 sequences of 32 tokens per rank, 4 ranks
                    "--tokens-per-step", str(4 * 32 * 4),
                    "examples/train_tiny.py", "--steps", steps,
                    "--optimizer", optimizer], check=True)
    print("\n== ragshardctl jobs", flush=True)
    subprocess.run(ctl + ["--planner", c.planner, "jobs"], check=True)
    print("\n== ragshardctl plan show demo", flush=True)
    subprocess.run(ctl + ["--planner", c.planner, "plan", "show", "demo"], check=True)
    print("\n== ragshardctl plan metrics demo", flush=True)
    subprocess.run(ctl + ["--planner", c.planner, "plan", "metrics", "demo"], check=True)
    for server, url in c.metrics_urls.items():
        print(f"\n== metrics of {server} ({url}), non-zero series", flush=True)
        for name, labels, value in nonzero(scrape(url)):
            print(format_series(name, labels, value))
    print("\n== shutting down", flush=True)
print("demo finished")
PY
