#!/usr/bin/env bash
# Fails when any C++ or CUDA file of the tree differs from clang-format's output.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
if [ ${#files[@]} -eq 0 ]; then exit 0; fi
clang-format --dry-run --Werror "${files[@]}"
echo "check-format: ${#files[@]} files formatted"
