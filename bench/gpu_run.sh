#!/usr/bin/env bash
# One GPU run of the kernels and the engine (issue 60), at most 8 minutes on one H100 or H200:
# the kernel tests, the decode kernel's sweep, the W8A16 product, generate end to end
# (bench/gpu_run.py says what each step measures; OUT gets a markdown table per step).
#
#   bench/gpu_run.sh OUT          on the GPU machine: jaxspec from this tree, the machine's own jax
#   bench/gpu_run.sh --cpu OUT    the rehearsal on CPU (tiny shapes, Pallas interpreted, this tree's .venv)
#   bench/gpu_run.sh --only sweep OUT    some of the steps (tests, sweep, w8a16, generate)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ " $* " == *" --cpu "* ]]; then
  export JAX_PLATFORMS=cpu
  if [[ -f .venv/bin/activate ]]; then . .venv/bin/activate; fi
  # The rehearsal's times mean nothing, and XLA:CPU compiles 2-3x faster so (tests/conftest.py).
  export XLA_FLAGS="${XLA_FLAGS:---xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" bench/gpu_run.py "$@"
