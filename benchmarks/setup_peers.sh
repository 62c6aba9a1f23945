#!/usr/bin/env bash
# Install what benchmarks/data_loading.py needs for its peer comparison (idempotent):
# WebDataset, and FFCV built from source against Debian's opencv and libjpeg-turbo.
#
#   bash benchmarks/setup_peers.sh            # as root (apt-get), from anywhere
#
# Why by hand: FFCV (1.0.2, the last release) ships only a source distribution whose
# setup.py needs pkg-config + opencv4 + libturbojpeg headers, and whose install_requires
# list `opencv-python`, which would install a second cv2 next to the project's
# opencv-python-headless (they overwrite each other's files). So FFCV is installed with
# --no-deps and its real runtime dependencies are listed here. It does not need
# torchvision. torch itself is never touched: every pip call is constrained to the
# installed torch version, and a dry run checks the plan first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-.venv/bin/python}"
PIP=("$PY" -m pip --disable-pip-version-check)

TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
PIN="$(mktemp)"
trap 'rm -f "$PIN"' EXIT
echo "torch==$TORCH_VERSION" > "$PIN"

# 1. system libraries FFCV compiles against (Debian / Ubuntu)
need_apt=0
for pkg in pkg-config libopencv-dev libturbojpeg0-dev; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_apt=1
done
if [ "$need_apt" = 1 ]; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
        pkg-config libopencv-dev libturbojpeg0-dev g++
fi

# 2. Python packages: WebDataset, and FFCV's runtime dependencies (not opencv-python)
DEPS=(
    "webdataset>=0.2.86"
    "numba>=0.58"
    "terminaltables>=3.1"
    "pytorch-pfn-extras>=0.7"
    "fastargs>=1.2"
    "assertpy>=1.1"
    "psutil>=5.9"
)
plan="$("${PIP[@]}" install --dry-run -c "$PIN" "${DEPS[@]}" 2>&1)" || { echo "$plan" >&2; exit 1; }
if echo "$plan" | grep -E "^Would install" | grep -qiE "(^| )torch(vision)?-"; then
    echo "setup_peers: refusing, the plan would change torch:" >&2
    echo "$plan" | grep -E "^Would install" >&2
    exit 1
fi
"${PIP[@]}" install -q -c "$PIN" "${DEPS[@]}" 2> >(grep -v "is ignored: it is neither" >&2)

# 3. FFCV itself, compiled here (a minute or two), without its declared dependencies
if ! "$PY" -c "import ffcv" >/dev/null 2>&1; then
    "${PIP[@]}" install -q -c "$PIN" --no-deps --no-build-isolation "ffcv==1.0.2" 2> >(grep -v "is ignored: it is neither" >&2)
fi
"$PY" -c "import ffcv, webdataset; from importlib.metadata import version as v; print('setup_peers: ffcv', v('ffcv'), '/ webdataset', v('webdataset'))"
