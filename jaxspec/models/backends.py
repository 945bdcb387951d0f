"""Product backends: which code computes a model's weight products, chosen at load per (format,
platform) and carried by the Model's params.

A backend is data, like a weight format: `apply(params, backend)` lays the linear weights out for
it (the native CPU kernels take `jaxspec.cpu.packing.PackedWeight`s; XLA takes the standard
arrays), and `quant.matmul` dispatches on the weight it is given, so trunks and heads never
branch on the backend and a Model's backend is whatever its params hold (`of_params`).

- "xla": XLA's own products on every platform (on a GPU, int8 weights take the Pallas W8A16
  kernel, `jaxspec.pallas.int8_matmul`). Not bitwise the same across token counts for int8 and
  bf16 weights on a CPU: decode forwards are padded to `quant.TOKEN_LANES` tokens.
- "native": the C++ kernels of `jaxspec.cpu` through jax.ffi, for f32, int8 and q4 weights on a
  CPU. Each output element is accumulated in a fixed order that depends only on the input width,
  so a position's product is bitwise the same in a 1-token step and inside a 16-token verify, and
  decode forwards need no padding.

"auto" is native on a CPU where the kernels build (a one-line notice says why when they do not,
and XLA serves), for f32, int8 and q4 weights of a model on one device; XLA everywhere else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxspec.choice import Choice
from jaxspec.cpu import packing
from jaxspec.cpu.packing import PackedWeight
from jaxspec.errors import InvalidRequestError
from jaxspec.models import quant
from jaxspec.models.quant import WeightFormat


class Products(Choice):
    AUTO = "auto"
    XLA = "xla"
    NATIVE = "native"

    @classmethod
    def label(cls) -> str:
        return "product backend"


NATIVE_FORMATS = (WeightFormat.F32, WeightFormat.INT8, WeightFormat.Q4)


@dataclasses.dataclass(frozen=True)
class Backend:
    """What a backend declares about the products it computes for one weight format."""

    name: Products
    fmt: WeightFormat

    @property
    def width_invariant(self) -> bool:
        """Whether a position's result is bitwise the same at every token count."""
        return self.name is Products.NATIVE or self.fmt is WeightFormat.F32

    @property
    def token_lanes(self) -> int:
        """Decode forwards carry a multiple of this many tokens (quant.TOKEN_LANES where the
        products are not width-invariant: every token then takes the same code path)."""
        return 1 if self.width_invariant else quant.TOKEN_LANES


def resolve(requested: Products | str, fmt: WeightFormat, *, sharded: bool = False) -> Products:
    """The concrete backend for weights in `fmt` on this platform: AUTO picks native where it
    serves (module docstring); NATIVE asked for where it cannot serve is refused by name."""
    requested = Products.parse(requested)
    fmt = fmt.resolve()
    serves = jax.default_backend() == "cpu" and fmt in NATIVE_FORMATS and not sharded
    if requested is Products.XLA or (requested is Products.AUTO and not serves):
        return Products.XLA
    if not serves:
        where = "a model sharded over a mesh" if sharded else f"{fmt.value} weights on {jax.default_backend()}"
        raise InvalidRequestError(
            f"the native product backend serves f32, int8 and q4 weights on a CPU, on one device; not {where}")
    from jaxspec.cpu import kernels

    if kernels.available():
        return Products.NATIVE
    if requested is Products.NATIVE:
        raise InvalidRequestError(f"the native CPU kernels are unavailable here: {kernels.unavailable_reason()}")
    return Products.XLA


def pack(weight: quant.Weight) -> PackedWeight:
    """A float32, int8 or q4 weight (host or device) in the native kernels' layout, on the host."""
    host = jax.device_get(weight)
    if isinstance(host, quant.Int8Weight):
        return packing.pack_int8(host.values, host.scales)
    if isinstance(host, quant.Q4Weight):
        return packing.pack_q4(host.codes, host.scales, host.mins, host.in_features)
    return packing.pack_f32(host)


def unpack(packed: PackedWeight) -> quant.Weight:
    """`pack` undone (exact), on the host: a float32 matrix, an Int8Weight or a Q4Weight."""
    if packed.kind == "int8":
        values, scales = packing.unpack_int8(packed)
        return quant.Int8Weight(values=values, scales=scales)
    if packed.kind == "q4":
        return quant.Q4Weight(*packing.unpack_q4(packed), in_features=packed.in_features)
    return packing.unpack_f32(packed)


def _to_native(leaf: Any) -> Any:
    if leaf is None or isinstance(leaf, PackedWeight):
        return leaf
    on_device = not isinstance(jax.tree.leaves(leaf)[0], np.ndarray)
    packed = pack(leaf)
    return jax.device_put(packed) if on_device else packed


def _to_standard(leaf: Any) -> Any:
    if not isinstance(leaf, PackedWeight):
        return leaf
    on_device = not isinstance(leaf.data, np.ndarray)
    host = unpack(leaf)
    return jax.device_put(host) if on_device else host


def apply(params: Any, products: Products) -> Any:
    """`params` with every linear weight laid out for `products` (numpy or device trees; exact)."""
    return quant.map_linear(params, lambda weight: apply_weight(weight, products))


def apply_weight(weight: Any, products: Products) -> Any:
    """One linear weight (a field `apply` converts) laid out for `products`."""
    return (_to_native if Products.parse(products) is Products.NATIVE else _to_standard)(weight)


def standard(params: Any) -> Any:
    """`params` in the standard layout (what converting, sharding and training take)."""
    return apply(params, Products.XLA)


def of_params(params: Any) -> Backend:
    """The backend a params tree is laid out for, with its weight format."""
    found = set()

    def note(leaf: Any) -> Any:
        if leaf is not None:
            found.add(Products.NATIVE if isinstance(leaf, PackedWeight) else Products.XLA)
        return leaf

    quant.map_linear(params, note)
    if len(found) > 1:
        raise InvalidRequestError("params mix product backends: some weights packed for the native kernels, some not")
    return Backend(name=found.pop() if found else Products.XLA, fmt=quant.format_of(params))


def describe_machine() -> dict:
    """What `python -m jaxspec.cli info` reports of this machine's product backends."""
    import os

    from jaxspec.cpu import kernels

    report = {"platform": jax.default_backend(), "auto": {}}
    for fmt in (WeightFormat.F32, WeightFormat.BF16, WeightFormat.INT8, WeightFormat.Q4):
        report["auto"][fmt.value] = resolve(Products.AUTO, fmt).value
    if jax.default_backend() == "cpu":
        reason = kernels.unavailable_reason()
        report["native_cpu_kernels"] = {"available": reason is None} | (
            {"reason": reason} if reason else {"isa": kernels.detected_isa(), "isas": list(kernels.supported_isas()),
                                               "threads": len(os.sched_getaffinity(0)),
                                               "library": kernels.library_file()})
    return report
