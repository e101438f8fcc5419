#!/usr/bin/env bash
# Installs every build, test and benchmark dependency of ragshard, idempotently:
#   * the C++ side from Debian's packages (apt-get runs only when something is missing; as root,
#     or through sudo when not root);
#   * the Python side into the project's virtual environment `.venv` at the repository root,
#     at the versions pinned in scripts/requirements.txt (pip runs only when one differs).
# Debian's python3-torch is not used: torch comes from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  clang-format clang-tidy
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libucx-dev ucx-utils
  libabsl-dev libgoogle-glog-dev libgflags-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libsqlite3-dev sqlite3 libssl-dev openssl nlohmann-json3-dev libcli11-dev zlib1g-dev libzstd-dev
  libisal-dev
  prometheus-cpp-dev
  libopenmpi-dev openmpi-bin libgloo-dev
  python3-venv
  patchelf iproute2 nftables
  slurmctld slurmd slurm-client munge systemd
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} Debian packages present"
else
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The Python environment. Made from Debian's interpreter, whose headers (python3-dev) the
# extension module builds against.
VENV=.venv
REQ=scripts/requirements.txt
if [ ! -x "$VENV/bin/python" ]; then
  echo "install-deps: creating $VENV"
  /usr/bin/python3 -m venv "$VENV"
fi
stamp="$VENV/.requirements.sha256"
want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "install-deps: $VENV matches $REQ"
else
  echo "install-deps: installing $REQ into $VENV (first time: torch is a large download)"
  # torch's CUDA wheel and its nvidia-* wheels take about 5 GiB installed; pip's wheel cache
  # would keep another copy of the download, so it is not used. Say plainly when the disk is
  # too small instead of leaving pip's "No space left on device" as the only hint.
  need_kib=$((7 * 1024 * 1024))
  free_kib=$(df -Pk "$VENV" | awk 'NR==2 {print $4}')
  tmp_free_kib=$(df -Pk "${TMPDIR:-/tmp}" | awk 'NR==2 {print $4}')
  echo "install-deps: free space: $((free_kib / 1024)) MiB at $VENV, $((tmp_free_kib / 1024)) MiB at ${TMPDIR:-/tmp}"
  if [ "$free_kib" -lt "$need_kib" ]; then
    echo "install-deps: warning: $VENV needs about 7 GiB free for torch; $((free_kib / 1024)) MiB is free" >&2
  fi
  pip_install() {
    if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir "$@"; then
      echo "install-deps: pip install $* failed; free space now: $(df -Ph "$VENV" | awk 'NR==2 {print $4}') at $VENV, $(df -Ph "${TMPDIR:-/tmp}" | awk 'NR==2 {print $4}') at ${TMPDIR:-/tmp}" >&2
      exit 1
    fi
  }
  pip_install --upgrade pip
  pip_install -r "$REQ"
  echo "$want" >"$stamp"
fi
"$VENV/bin/python" -c "import torch; print('install-deps: torch', torch.__version__, 'in $VENV')"
