#!/usr/bin/env bash
# Set up, then run the main job: tune the built-in default model (ResNet-18, 3x64x64,
# batch 32) on this machine and write the report, plot and tricks.toml to ./tune-report.
# Extra arguments go to `torch-tricks tune` (e.g. --budget-seconds 60, --model resnet50).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/torch-tricks tune --model resnet18 --input 3x64x64 --batch 32 --out tune-report "$@"
