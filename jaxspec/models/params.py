"""Typed params: `flax.struct` dataclasses whose fields carry their logical axis names.

Every trunk and head declares its params as frozen pytree dataclasses (`LlamaParams`,
`Qwen35Params`, `Eagle3Params`, `MtpParams`, and the blocks they share: `AttentionParams`,
`MlpParams`, `DeltaNetParams`). A field that holds an array is declared with `param(axes=...)`:
one logical axis name per dimension, read by `logical_axes`, so a sharding rule (docs/design.md,
"Sharding") maps names to mesh axes without any model knowing about meshes. A field declared
plainly (`layers`, a nested block) is structure: `logical_axes` walks into it.

Logical axis names: "vocab", "embed", "heads", "kv_heads", "ffn", and None (replicated; e.g.
a per-head-dim norm every head shares); Qwen3.5 adds "linear_heads" and "linear_channels".
Optional params (biases, QK-norm, an untied lm_head) are None when the config has none: None
is an empty pytree, so jit, optax and orbax see only the arrays that exist.

The same dataclasses describe checkpoints: a family builds its params tree with any leaf
type (shape tuples for `param_shapes`, `TensorSource`s for a file's tensor names, arrays),
so a loader and the forward agree on the structure by construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from flax import struct

from jaxspec.errors import InvalidRequestError

Axes = tuple[str | None, ...]


def param(*, axes: Axes, linear: bool = False, default: Any = dataclasses.MISSING) -> Any:
    """A params field holding one array (or None when absent), with its logical axes.

    `linear`: a weight matrix [out, in] the forward multiplies through `quant.matmul` (or an
    embedding table it gathers through `quant.embedding_rows`), so a weight format converts it
    (jaxspec.models.quant); every other param stays float32.
    """
    metadata = {"axes": tuple(axes), "linear": linear}
    if default is dataclasses.MISSING:
        return struct.field(metadata=metadata)
    return struct.field(metadata=metadata, default=default)


def is_shape(leaf: Any) -> bool:
    """`is_leaf` for a params tree whose leaves are shape tuples (`Family.param_shapes`)."""
    return isinstance(leaf, tuple) and all(isinstance(dim, int) for dim in leaf)


def is_axes(leaf: Any) -> bool:
    """`is_leaf` for `logical_axes` trees, whose leaves are axis-name tuples."""
    return isinstance(leaf, tuple) and all(name is None or isinstance(name, str) for name in leaf)


def logical_axes(tree: Any) -> Any:
    """`tree` with every param leaf replaced by its field's axes tuple (None stays None).

    Works on any tree of params dataclasses, whatever its leaves hold (arrays, shapes, tensor
    sources): what a field holds is a leaf exactly when the field was declared with `param`.
    """
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        updates = {}
        for field in dataclasses.fields(tree):
            value = getattr(tree, field.name)
            if "axes" in field.metadata:
                updates[field.name] = None if value is None else field.metadata["axes"]
            elif not field.metadata.get("pytree_node", True):
                continue  # static metadata (a fused projection's row counts): not an array
            else:
                updates[field.name] = logical_axes(value)
        return dataclasses.replace(tree, **updates)
    if isinstance(tree, tuple | list):
        return type(tree)(logical_axes(item) for item in tree)
    if tree is None:
        return None
    raise InvalidRequestError(f"{type(tree).__name__} is not a params dataclass or a sequence of them: a Model's "
                              "params come from jaxspec.load or a family's init_params")


# A param's value given its name and layer index (None for the trunk-level params).
LeafFn = Callable[[str, int | None], Any]


def trunk_params(params_class: type, cfg: Any, leaf: LeafFn, layer: Callable[[int, Callable[[str], Any]], Any]) -> Any:
    """A trunk's params tree (`embed`, `layers`, `final_norm`, `lm_head`; lm_head None when
    `cfg.tie_embeddings`), each param `leaf(name, layer index)` and each layer built by
    `layer(index, leaf of that layer)`, asked in checkpoint order: embed, layer by layer, the rest
    (so a reader's first missing tensor is the first one a file would hold)."""
    return params_class(
        embed=leaf("embed", None),
        layers=tuple(layer(index, lambda name, index=index: leaf(name, index)) for index in range(cfg.num_layers)),
        final_norm=leaf("final_norm", None),
        lm_head=None if cfg.tie_embeddings else leaf("lm_head", None),
    )
