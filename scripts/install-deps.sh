#!/usr/bin/env bash
# Installs every build, test and benchmark dependency of ragshard from Debian's packages.
# Idempotent: packages already installed are skipped, and apt-get runs only when something is
# missing. Runs unattended as root (or through sudo when not root).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  clang-format clang-tidy
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libucx-dev ucx-utils
  libabsl-dev libgoogle-glog-dev libgflags-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libsqlite3-dev sqlite3 libssl-dev openssl nlohmann-json3-dev libcli11-dev zlib1g-dev
  libopenmpi-dev openmpi-bin libgloo-dev
  python3-numpy python3-torch python3-matplotlib pybind11-dev python3-dev python3-pytest
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: done"
