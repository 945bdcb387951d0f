"""Native CPU kernels (C++ through jax.ffi), each beside a numpy reference (`reference`).

- `f32_matmul.cc`, `int8_matmul.cc`: the skinny products of decoding, over weights packed at load
  (`packing`), bitwise the same at every token count, thread count and instruction set.
- `build`: compiled at first use with the system C++ compiler into jaxspec's cache.
- `kernels`: registration with XLA, instruction-set detection, the call wrappers.

`jaxspec.models.backends` decides where they serve; nothing here is imported by a model's forward
unless its weights are packed.
"""

from jaxspec.cpu.kernels import available, detected_isa, supported_isas, unavailable_reason

__all__ = ["available", "detected_isa", "supported_isas", "unavailable_reason"]
