#!/usr/bin/env bash
# Set up, then run the test suite (extra arguments go to pytest, and then it runs as given).
#
# Without arguments the suite runs on up to two pytest-xdist workers (TEST_WORKERS overrides;
# 0 or 1 runs it in this process), a test module per worker at a time (--dist loadscope, so a
# module's fixtures run once), one torch intra-op thread each (tests/conftest.py). On 2 cores
# this measured 4.8 min against 8.1 for one process with two threads: much of a test's time is
# one core's (Python, subprocess start-up, a tiny model's step), and the other core sat idle.
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
if [ $# -gt 0 ]; then
    exec .venv/bin/python -m pytest -q "$@"
fi
workers="${TEST_WORKERS:-$(( $(nproc) < 2 ? $(nproc) : 2 ))}"
parallel=()
if [ "$workers" -gt 1 ]; then
    parallel=(-n "$workers" --dist loadscope)
fi
.venv/bin/python -m pytest -q "${parallel[@]}"
if [ "$(.venv/bin/python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')" = "AVX512" ]; then
    echo "== again on torch's and oneDNN's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)"
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
    TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/torch-tricks-inductor-avx2-$(id -u)" \
        .venv/bin/python -m pytest -q "${parallel[@]}" tests/test_tune.py tests/test_deploy_cli.py \
        tests/test_deploy_quantize.py tests/test_deploy_export.py
fi
