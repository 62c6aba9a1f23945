#!/usr/bin/env bash
# Set up, then run the main job on the built-in default model (extra arguments go to it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/torch-tricks summary "$@"
