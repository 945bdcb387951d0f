"""The W8A16 matmul kernel against its XLA reference at the default model's shapes.

    . .venv/bin/activate && python bench/int8_matmul.py           # a GPU: native Triton kernel
    . .venv/bin/activate && python bench/int8_matmul.py --tiny    # CPU: Pallas interpreter, tiny sizes

For each weight O x I of SmolLM2-135M (576x576 attention q/o, 1536x576 MLP gate/up, 576x1536 MLP
down, 49152x576 the tied lm_head) and N = 2, 5, 64 activation columns (decode, a verify, a full
verify batch): the kernel's and the reference's median time over `--repeats` runs (each waited
on with block_until_ready), their largest difference relative to the reference's largest value,
and the HBM roofline: the bytes the call must move (int8 weight, float32 scales, bf16 x, float32
out) over the bandwidth (H200: 4.8 TB/s; --hbm-gbps). With --tiny (CPU) every dimension is cut
by 16 and the kernel runs in the Pallas interpreter: that checks the plumbing only; its times
mean nothing.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from forward_cost import median_seconds, require_gpu_or_tiny  # noqa: E402  (bench/ is on sys.path)
from jaxspec.pallas.int8_matmul import w8a16_matmul_pallas, w8a16_matmul_reference  # noqa: E402

WEIGHT_SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]  # [O, I]
TOKEN_COUNTS = [2, 5, 64]  # N
TINY_DIVISOR = 16



def timing(args) -> str:
    interpret = require_gpu_or_tiny(args.tiny)
    divisor, repeats = (TINY_DIVISOR, 3) if args.tiny else (1, args.repeats)
    kernel = jax.jit(lambda values, scales, x: w8a16_matmul_pallas(values, scales, x, interpret=interpret))
    reference = jax.jit(w8a16_matmul_reference)
    rng = np.random.RandomState(0)
    rows = []
    for out_features, in_features in WEIGHT_SHAPES:
        out_features, in_features = out_features // divisor, in_features // divisor
        values = jnp.asarray(rng.randint(-127, 128, (out_features, in_features)), jnp.int8)  # [O, I]
        scales = jnp.asarray(rng.uniform(0.5, 4.0, out_features) / 127.0, jnp.float32)  # [O]
        for tokens in TOKEN_COUNTS:
            x = jnp.asarray(rng.randn(in_features, tokens), jnp.bfloat16)  # [I, N]
            ours, theirs = kernel(values, scales, x), reference(values, scales, x)
            error = float(jnp.max(jnp.abs(ours - theirs)) / jnp.max(jnp.abs(theirs)))
            kernel_s = median_seconds(kernel, values, scales, x, repeats=repeats)
            reference_s = median_seconds(reference, values, scales, x, repeats=repeats)
            moved = values.nbytes + scales.nbytes + x.nbytes + out_features * tokens * 4
            roofline_s = moved / (args.hbm_gbps * 1e9)
            rows.append((out_features, in_features, tokens, moved, kernel_s, reference_s, roofline_s, error))
            print(f"{out_features}x{in_features} N={tokens}: kernel {kernel_s * 1e6:.1f} us, "
                  f"reference {reference_s * 1e6:.1f} us, max rel diff {error:.1e}", flush=True)
    mode = "Pallas interpreter on CPU: plumbing check, times meaningless" if interpret else jax.devices()[0].device_kind
    lines = [f"W8A16 matmul, int8 [O, I] @ bf16 [I, N] -> float32 [O, N] ({mode}); median of {repeats} runs; "
             f"roofline = bytes moved / {args.hbm_gbps:.0f} GB/s",
             "",
             "| O x I | N | MB moved | kernel us | XLA ref us | kernel GB/s | of roofline | ref / kernel | max rel diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for out_features, in_features, tokens, moved, kernel_s, reference_s, roofline_s, error in rows:
        lines.append(f"| {out_features}x{in_features} | {tokens} | {moved / 1e6:.2f} | {kernel_s * 1e6:.1f} | "
                     f"{reference_s * 1e6:.1f} | {moved / kernel_s / 1e9:.0f} | {roofline_s / kernel_s:.0%} | "
                     f"{reference_s / kernel_s:.2f}x | {error:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="dimensions / 16, Pallas interpreter on CPU")
    parser.add_argument("--hbm-gbps", type=float, default=4800.0, help="HBM bandwidth (H200: 4800)")
    parser.add_argument("--repeats", type=int, default=50, help="timed runs per call (median); --tiny: 3")
    args = parser.parse_args(argv)
    print(timing(args), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
