"""Pallas kernels, each beside its float32 jnp reference (docs/design.md, "Kernels beside references").

    flash_decode.py  attention of T = 1 (decode) or k+1 (verify) queries per row over the cache
    tuning.py        the decode kernel's tuned table: (GPU kind, shape class, KV format) -> parameters
    kv_quant.py      KV storage formats (f32, bf16, ggml q8_0 / q5_1) and quantize-on-write
    int8_matmul.py   W8A16 matmul: int8 weights, per-channel scales, bf16 activations, float32 sums

`Attention` and `int8_matmul.Implementation` are the switches (`attend`, `w8a16_matmul`): for
attention "auto" is the XLA reference, except on a GPU where the tuned table has measured the
kernel beating it (none yet: the untuned kernel was slower on an H200), and "pallas" the kernel;
for the matmul "auto" runs the kernel on GPU and the reference elsewhere. The kernel
functions live in their modules (`flash_decode.flash_decode`, `kv_quant.quantize`,
`int8_matmul.w8a16_matmul_pallas`); the package does not re-export `flash_decode`, which would
shadow its module.
"""

from jaxspec.pallas import flash_decode, int8_matmul, kv_quant, tuning
from jaxspec.pallas.flash_decode import Attention, attend, resolve_attention
from jaxspec.pallas.int8_matmul import w8a16_matmul
from jaxspec.pallas.kv_quant import Format, Q5_1, Q8_0

__all__ = ["Attention", "Format", "Q5_1", "Q8_0", "attend", "flash_decode", "int8_matmul", "kv_quant",
           "resolve_attention", "tuning", "w8a16_matmul"]
