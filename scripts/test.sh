#!/usr/bin/env bash
# Set up, then run the test suite (extra arguments go to pytest).
#
# Without arguments, on a CPU whose torch kernels are AVX-512, the tests whose meaning
# depends on the instruction set (the tuner's verdicts, int8 agreement) run a second time
# on torch's and oneDNN's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2),
# as on this project's AVX2-only machines; that run gets its own inductor cache, because
# inductor's cache does not key on the ISA (a graph compiled under one, served under the
# other, computes garbage). ONNX Runtime ignores both switches.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q "$@"
if [ $# -eq 0 ] && [ "$(.venv/bin/python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')" = "AVX512" ]; then
    echo "== again on torch's and oneDNN's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)"
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
    TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/torch-tricks-inductor-avx2-$(id -u)" \
        .venv/bin/python -m pytest -q tests/test_tune.py tests/test_deploy_cli.py tests/test_deploy_quantize.py \
        tests/test_deploy_export.py
fi
