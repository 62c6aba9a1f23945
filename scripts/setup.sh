#!/usr/bin/env bash
# Set up torch-tricks in ./.venv (idempotent). Sourced or run by scripts/main.sh and
# scripts/test.sh; EXTRAS selects the pip extras (default: dev).
#
# torch: if the Python that creates the venv can already import torch (say, your own
# CUDA build), the venv sees it (--system-site-packages) and nothing is downloaded.
# Otherwise we install torch==2.13.0, which this project's CPU machines carry as a local
# CPU wheel; a plain `pip install torch` would pull a multi-GB CUDA build instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
EXTRAS="${EXTRAS:-dev}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

if [ ! -x .venv/bin/python ]; then
    if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
        "$PYTHON" -m venv --system-site-packages .venv
    else
        "$PYTHON" -m venv .venv
    fi
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    echo "setup: installing $TORCH_SPEC (CPU build where a local wheel exists)" >&2
    "${PIP[@]}" install "$TORCH_SPEC" 2> >(grep -v "is ignored: it is neither" >&2)
fi
stamp=".venv/.torch-tricks-$(cat pyproject.toml | cksum | cut -d' ' -f1)-$EXTRAS"
if [ ! -f "$stamp" ]; then
    "${PIP[@]}" install -e ".[$EXTRAS]" 2> >(grep -v "is ignored: it is neither" >&2)
    rm -f .venv/.torch-tricks-* && touch "$stamp"
fi
