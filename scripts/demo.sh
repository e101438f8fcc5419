#!/usr/bin/env bash
# The README's run command.
#
# The full demo (planner + daemons + training ranks on loopback) arrives with the data plane.
# Until then this builds ragshard and runs its offline planner on real model inventories,
# comparing RaggedShard with the FSDP2, FSDP1, ZeRO-3 and Megatron layouts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh >/dev/null
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DPython3_EXECUTABLE=/usr/bin/python3 >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target ragshardctl >/dev/null
CTL="$BUILD_DIR/client/ragshardctl"

echo "== DeepSeek-V3, 1024 ranks, FP8 128x128 blocks (granule rows:128)"
"$CTL" compare --model deepseek-v3 --world 1024 --granule rows:128
echo
echo "== LLaMA-3 70B, 256 ranks, 8-bit Adam 32x32 blocks (granule rows:32)"
"$CTL" compare --model llama3-70b --world 256 --granule rows:32
echo
echo "== One plan in detail: Mixtral 8x7B, 64 ranks, rows:128"
"$CTL" plan --model mixtral-8x7b --world 64 --granule rows:128 | tail -4
