#!/usr/bin/env bash
# One short check of the Pallas kernels on a GPU (issue 7):
#   1. the kernel tests (tests/test_flash_decode.py, tests/test_kv_quant.py,
#      tests/test_int8_matmul.py), natively compiled;
#   2. the decode kernel against the XLA reference at B=8 S=8192 N=32 K=8 H=128, T=1, for each
#      K/V format, against the HBM roofline (packed KV bytes / 4.8 TB/s, an H200's);
#   3. the W8A16 matmul kernel against its XLA reference at the default model's weight shapes
#      (576x576, 1536x576, 576x1536, 49152x576) for N = 2, 5, 64, against the same roofline
#      (int8 weight + bf16 x + float32 out bytes). Each timing step prints its table last.
#
#   bench/gpu_check.sh          on a GPU machine (jax with CUDA); falls back to --cpu without one
#   bench/gpu_check.sh --cpu    the same steps on CPU: kernels in the Pallas interpreter, tiny sizes
#   HBM_GBPS=3350 bench/gpu_check.sh    another GPU's bandwidth (H100 SXM: 3350)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -f .venv/bin/activate ]]; then . .venv/bin/activate; fi

mode=gpu
if [[ "${1:-}" == "--cpu" ]]; then
  mode=cpu
elif [[ "$(python -c 'import jax; print(jax.default_backend())')" != "gpu" ]]; then
  echo "gpu_check: no GPU backend here; running the CPU-side checks (--cpu)" >&2
  mode=cpu
fi
timing_args=(--hbm-gbps "${HBM_GBPS:-4800}")
if [[ $mode == cpu ]]; then
  export JAX_PLATFORMS=cpu
  timing_args+=(--tiny)
else
  python -c 'import jax; print("device:", jax.devices()[0].device_kind)'
fi

# Every step runs even when one before it fails (the first H200 run stopped at the tests and
# lost its timings); the script's status is the first failure's.
status=0
step() { "$@" || { rc=$?; echo "gpu_check: step failed (exit $rc): $*" >&2; [[ $status != 0 ]] || status=$rc; }; }

echo "== kernel tests ($mode: $([[ $mode == cpu ]] && echo 'Pallas interpreter' || echo 'native Triton'))"
step python -m pytest -q -p no:cacheprovider tests/test_flash_decode.py tests/test_kv_quant.py \
  tests/test_int8_matmul.py

echo "== decode kernel vs XLA reference"
step python bench/kv_formats.py timing "${timing_args[@]}"

echo "== W8A16 matmul kernel vs XLA reference"
step python bench/int8_matmul.py "${timing_args[@]}"
exit $status
