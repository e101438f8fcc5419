#!/usr/bin/env bash
# Collects the GPU build's programs into a self-contained folder for a GPU machine that has no
# package access (issue 23; docs/daemon.md, "GPU backend"):
#   BUNDLE/bin  the daemons, the CLI, the GPU tests and the benchmark programs, stripped, with an
#               rpath of $ORIGIN/../lib;
#   BUNDLE/lib  every shared library they load that is not part of the base system (libc,
#               libstdc++, libm, libgcc_s, libdl, libpthread, librt, libz, the loader), found
#               with ldd, with an rpath of $ORIGIN;
#   BUNDLE/python/ragshard  the Python package, its client library (libragshard_c.so, a C ABI
#               loaded with ctypes: any CPython 3.10 to 3.13) with an rpath of $ORIGIN/../../lib;
#   BUNDLE/run.sh, BUNDLE/tools/checks.py  the one command (scripts/gpu/run.sh) and its Python
#               checks; BUNDLE/examples/train_tiny.py  the training they run (with its modules).
# Neither the driver (libcuda) nor NCCL is bundled: the programs link the CUDA runtime statically
# and open NCCL at run time (server/daemon/cuda/nccl_api.h).
#
#   bash scripts/gpu-bundle.sh [BUILD] [BUNDLE]     (defaults: build, BUILD/gpu-bundle)
#
# BUILD is configured (with RAGSHARD_WITH_CUDA=ON) if it is not yet, and must have the GPU targets
# (CUDA found); the programs are built there if they are not yet. Fails, naming it, if a library cannot be found or
# the bundle passes 48 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
bundle=${2:-$build/gpu-bundle}
max_mib=48

programs=(server/ragshardd server/ragshard-planner ctl/ragshardctl
  tests/gpu_test tests/gpu_data_plane_test tests/nccl_api_test
  bench/daemon_bench bench/collectives_bench bench/gpu_data_plane_bench)
pylib=python/ragshard/libragshard_c.so
source scripts/gpu-base-libs.sh
base=$GPU_BASE_LIBS

if [[ ! -f $build/CMakeCache.txt ]]; then
  # A fresh clone: configure BUILD with the GPU targets required (the dependencies come from
  # scripts/install-deps.sh).
  python=()
  [[ -x .venv/bin/python ]] && python=(-DPython_EXECUTABLE="$PWD/.venv/bin/python")
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRAGSHARD_WITH_CUDA=ON \
    "${python[@]}" || { echo "gpu-bundle: configuring $build with CUDA failed" >&2; exit 2; }
fi
known_targets=$(cmake --build "$build" --target help)
if ! grep -q '^RAGSHARD_WITH_CUDA:STRING=\(AUTO\|ON\)' "$build/CMakeCache.txt" ||
  ! grep -q '^gpu_test:' <<<"$known_targets"; then
  echo "gpu-bundle: $build has no GPU targets (CUDA Toolkit 13 and NCCL's header not found;" \
    "configure it with -DRAGSHARD_WITH_CUDA=ON to see why)" >&2
  exit 2
fi
for tool in patchelf strip ldd; do
  command -v "$tool" >/dev/null || { echo "gpu-bundle: $tool is missing (scripts/install-deps.sh)" >&2; exit 2; }
done
targets=()
for p in "${programs[@]}"; do targets+=("$(basename "$p")"); done
# Not the target that assembles build/python (tests may be importing from it meanwhile): the
# package's Python files come from the source tree, its library from the build.
cmake --build "$build" --target "${targets[@]}" ragshard_c

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib" "$bundle/python" "$bundle/tools" "$bundle/examples"
for p in "${programs[@]}"; do
  install -m 755 "$build/$p" "$bundle/bin/"
  strip --strip-unneeded "$bundle/bin/$(basename "$p")"
done
cp -r python/ragshard "$bundle/python/"
find "$bundle/python" -name __pycache__ -prune -exec rm -rf {} +
install -m 755 "$build/$pylib" "$bundle/$pylib"
strip --strip-unneeded "$bundle/$pylib"
install -m 755 scripts/gpu/run.sh "$bundle/run.sh"
install -m 644 scripts/gpu/checks.py "$bundle/tools/checks.py"
# The example and the modules beside it that it imports.
install -m 644 examples/train_tiny.py examples/tiny_model.py examples/tiny_optim.py \
    examples/reference_optim.py examples/example_flags.py examples/example_faults.py \
    "$bundle/examples/"

# The libraries every program loads, directly or through another library.
for p in "${programs[@]}" "$pylib"; do
  while read -r name _ path _; do
    [[ $name =~ $base ]] && continue
    if [[ $path == "not" ]]; then
      echo "gpu-bundle: $p needs $name, which the loader cannot find here" >&2
      exit 1
    fi
    [[ -f $bundle/lib/$name ]] && continue
    install -m 644 "$(readlink -f "$path")" "$bundle/lib/$name"
    strip --strip-unneeded "$bundle/lib/$name"
  done < <(ldd "$build/$p" | awk '/=>/ {print $1, $2, $3, $4}')
done
for f in "$bundle"/bin/*; do patchelf --set-rpath '$ORIGIN/../lib' "$f"; done
for f in "$bundle"/lib/*; do patchelf --set-rpath '$ORIGIN' "$f"; done
patchelf --set-rpath '$ORIGIN/../../lib' "$bundle/$pylib"

size_kib=$(du -sk "$bundle" | cut -f1)
echo "gpu-bundle: $bundle, $((size_kib / 1024)) MiB: $(ls "$bundle/bin" | wc -l) programs," \
  "$(ls "$bundle/lib" | wc -l) libraries"
if ((size_kib > max_mib * 1024)); then
  echo "gpu-bundle: the bundle is over $max_mib MiB" >&2
  exit 1
fi
