"""Many devices: a model's params, caches and loop state laid out over a `jax.sharding.Mesh`.

jaxspec runs on JAX's own SPMD engine (docs/design.md, "Sharding"): every array gets a
`NamedSharding`, XLA partitions the one jitted program (prefill, the `lax.while_loop` of
rounds) and inserts the collectives. Nothing in the models knows about meshes: params fields
declare logical axis names (jaxspec.models.params), caches declare theirs (`KVCache.logical_axes`,
`Qwen35Cache.logical_axes`), and a rule table maps each logical name to a mesh axis or to
None (replicated). The default rules, over a mesh with axes "data" and "model":

    batch -> data                                  rows of a batch (data parallel)
    heads, kv_heads, ffn, vocab -> model           tensor parallel (Megatron-style: column-
    linear_heads, linear_key_heads -> model        parallel q/k/v and gate/up, row-parallel o and
                                                   down; a vocabulary-parallel embedding and head)
    embed, qkv, gate_up, linear_channels, kv_seq, head_dim -> replicated
    (linear_channels follows linear_key_heads when those split: see below)

Fused projections (`qkv_proj`, `gate_up_proj`) stack rows of different heads and halves, so a
split of their rows cuts across q, k and v: `shard` unfuses them wherever their parts are split.
The Qwen3.5 DeltaNet's q/k/v channels ("linear_channels": its `qkv_proj`, conv weight and conv
state) are stacked the same way; where its key heads split, `shard` regroups the channels per key
head (`gated_deltanet.by_key_head`) and splits them with the key heads.

Where a count does not divide its mesh axis: kv heads are repeated up to lcm(kv heads, model axis)
(each device then holds copies of the K/V heads its own query heads read, as vLLM replicates kv
heads when the tensor-parallel size exceeds them; the sharded Model's config says the repeated
count, and its outputs are unchanged, bit for bit); any other axis is refused by name, with the
sizes that would work. `Plan` is the resolved layout of one model: hashable, so it sits in the
loop's static spec.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxspec.errors import InvalidRequestError
from jaxspec.models import gated_deltanet, layers, quant
from jaxspec.models.params import Axes, is_axes, logical_axes

DATA, MODEL = "data", "model"

DEFAULT_RULES: Mapping[str, str | None] = {
    "batch": DATA,
    "heads": MODEL, "kv_heads": MODEL, "ffn": MODEL, "vocab": MODEL,
    "linear_heads": MODEL, "linear_key_heads": MODEL,
    "embed": None, "qkv": None, "gate_up": None, "linear_channels": None, "kv_seq": None, "head_dim": None,
}
# Axes a tensor-parallel split of which needs the fused projections apart.
_SPLITS_FUSED = ("heads", "kv_heads", "ffn")


class ShardingError(InvalidRequestError):
    """A mesh or sharding rules that cannot lay out this model (raised before anything compiles)."""


def make_mesh(data: int = 1, model: int = 1, *, devices=None) -> Mesh:
    """A ("data", "model") mesh over the first data * model devices (all processes' devices,
    process by process, under `jaxspec.distributed`). Axes are Auto: XLA propagates shardings."""
    devices = list(jax.devices() if devices is None else devices)
    for name, size in (("data", data), ("model", model)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ShardingError(f"mesh axis {name!r} needs a positive integer size; got {size!r}")
    if data * model > len(devices):
        visible = f"{len(devices)} is visible" if len(devices) == 1 else f"{len(devices)} are visible"
        hint = ""
        if devices[0].platform == "cpu":
            hint = (f"; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={data * model} (set before "
                    f"jax starts) simulates that many devices")
        raise ShardingError(f"a mesh of data={data} x model={model} needs {data * model} devices; "
                            f"{visible} ({devices[0].platform}){hint}")
    grid = np.array(devices[: data * model], dtype=object).reshape(data, model)
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def parse_mesh(text: str) -> dict[str, int]:
    """"data=2,model=4" -> {"data": 2, "model": 4} (the CLI's --mesh)."""
    sizes = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in (DATA, MODEL) or name in sizes or not value.strip().isdigit():
            raise ShardingError(f"--mesh takes data=N,model=M (either may be omitted); got {text!r}")
        sizes[name] = int(value)
    return sizes


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where each logical axis of one model lies on `mesh` (None: replicated)."""

    mesh: Mesh
    rules: tuple[tuple[str, str | None], ...]  # every logical name -> mesh axis or None
    kv_repeats: int = 1  # each kv head's copies (kv heads that did not divide the model axis)
    channels_by_key_head: bool = False  # a DeltaNet's q/k/v channels regrouped to split by key head
    counted: tuple[str, ...] = ("batch",)  # the logical axes this model has

    def mesh_axis(self, logical: str | None) -> str | None:
        return None if logical is None else dict(self.rules).get(logical)

    def spec(self, axes: Axes) -> PartitionSpec:
        return PartitionSpec(*(self.mesh_axis(name) for name in axes))

    def sharding(self, axes: Axes) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes))

    def axis_size(self, logical: str) -> int:
        axis = self.mesh_axis(logical)
        return 1 if axis is None else self.mesh.shape[axis]

    @property
    def data_size(self) -> int:  # a sharded batch is padded to a multiple of this
        return self.axis_size("batch")

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def rows(self, ndim: int) -> NamedSharding:
        """An array whose leading axis is the batch: rows over "data", the rest replicated."""
        return self.sharding(("batch",) + (None,) * (ndim - 1))

    def param_shardings(self, params: Any) -> Any:
        """A NamedSharding per params leaf (an int8 weight's scales follow its rows)."""
        return jax.tree.map(lambda axes, leaf: _leaf_sharding(self, axes, leaf), logical_axes(params), params,
                            is_leaf=is_axes)

    def constrain(self, tree: Any, axes_tree: Any) -> Any:
        """`with_sharding_constraint` of every leaf of `tree` to its axes in `axes_tree` (inside jit)."""
        def lay_out(axes, leaf):
            return leaf if axes == () else jax.lax.with_sharding_constraint(leaf, self.sharding(axes))

        return jax.tree.map(lay_out, axes_tree, tree, is_leaf=is_axes)

    def constrain_state(self, tree: Any, batch: int) -> Any:
        """A loop state's pytree (a proposer's): every cache inside laid out by its own
        `logical_axes`, every other array whose leading axis is the batch by rows."""
        def lay_out(leaf):
            if hasattr(leaf, "logical_axes"):
                return self.constrain(leaf, leaf.logical_axes())
            if isinstance(leaf, jax.Array) and leaf.ndim and leaf.shape[0] == batch:
                return jax.lax.with_sharding_constraint(leaf, self.rows(leaf.ndim))
            return leaf

        return jax.tree.map(lay_out, tree, is_leaf=lambda node: hasattr(node, "logical_axes"))

    def constrain_rows(self, tree: Any) -> Any:
        """Every array leaf of `tree` (per-row arrays: the leading axis is the batch) by rows over "data"."""
        return jax.tree.map(lambda leaf: jax.lax.with_sharding_constraint(leaf, self.rows(leaf.ndim)), tree)

    def rules_for_another_model(self) -> dict[str, str | None]:
        """The rules this plan was made from, for a draft beside the model (its own counts are
        checked afresh)."""
        return dict(self.rules)

    def __str__(self) -> str:
        shape = ", ".join(f"{name}={size}" for name, size in self.mesh.shape.items())
        split = sorted(name for name, axis in self.rules if axis is not None and self.mesh.shape[axis] > 1
                       and name in self.counted)
        repeats = f"; kv heads x{self.kv_repeats}" if self.kv_repeats > 1 else ""
        grouped = "; DeltaNet channels by key head" if self.channels_by_key_head else ""
        return f"mesh ({shape}); split: {', '.join(split) or 'nothing'}{repeats}{grouped}"


def _leaf_sharding(plan: Plan, axes: Axes, leaf: Any) -> Any:
    if isinstance(leaf, quant.Int8Weight):
        return quant.Int8Weight(values=plan.sharding(axes), scales=plan.sharding(axes[:1]))
    if isinstance(leaf, quant.Q4Weight):  # split by rows only: a q4 block never straddles devices
        rows = plan.sharding((axes[0], None))
        return quant.Q4Weight(codes=rows, scales=rows, mins=rows, in_features=leaf.in_features)
    return plan.sharding(axes)


def axis_counts(cfg: Any) -> dict[str, int]:
    """How many heads / channels / rows each logical axis of a model's params counts: what a
    mesh axis must divide (a head is never split across devices)."""
    cfg = getattr(cfg, "block", cfg)  # an MTP head: its decoder layer's shapes
    counts = {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "ffn": cfg.ffn_dim,
              "vocab": getattr(cfg, "draft_vocab_size", cfg.vocab_size)}
    if hasattr(cfg, "linear_num_value_heads"):  # the Qwen3.5 hybrid's DeltaNet layers
        counts |= {"linear_heads": cfg.linear_num_value_heads, "linear_key_heads": cfg.linear_num_key_heads}
    return counts


def _check_rules(rules: Mapping[str, str | None] | None, mesh: Mesh) -> dict[str, str | None]:
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"shard needs a jax.sharding.Mesh (jaxspec.make_mesh); got {type(mesh).__name__}")
    merged = dict(DEFAULT_RULES)
    if rules is not None:
        if not isinstance(rules, Mapping):
            raise ShardingError(f"rules must map logical axis names to mesh axes; got {rules!r:.80}")
        unknown = sorted(str(name) for name in rules if name not in DEFAULT_RULES)
        if unknown:
            raise ShardingError(f"unknown logical axis name(s) {unknown} in rules; the names are {sorted(DEFAULT_RULES)}")
        merged.update(rules)
    for logical, axis in merged.items():
        if axis is not None and axis not in mesh.shape:
            raise ShardingError(f"rule {logical!r} -> {axis!r} names no axis of the mesh {tuple(mesh.axis_names)}")
    unused = sorted(name for name, size in mesh.shape.items()
                    if size > 1 and name not in merged.values() and name not in (DATA, MODEL))
    if unused:
        raise ShardingError(
            f"mesh axis name(s) {unused} are not used by any rule; the default rules use 'data' (rows) and "
            f"'model' (heads, ffn, vocab); pass rules= to map logical axes onto other names")
    return merged


def _copies_per_entry(logical: str, count: int, size: int, counts: dict[str, int], merged: dict) -> int | None:
    """How many copies of each of `count` entries a mesh axis of `size` takes: 1 where it divides
    them; for kv heads split with the query heads, lcm(K, m) / K where m divides the query heads
    (each kv head repeated for the query heads that read it); None: it does not fit."""
    if count % size == 0:
        return 1
    if logical == "kv_heads" and counts["heads"] % size == 0 and merged.get("heads") == merged.get("kv_heads"):
        # lcm(K, m) divides the query heads N (a multiple of both), so the repeats keep GQA's
        # grouping: query head n reads copy n // (N / lcm) of original head n // (N / K).
        return math.lcm(count, size) // count
    return None


def _sizes_that_fit(axis: str, counts: dict[str, int], merged: dict) -> list[int]:
    """Every size of mesh axis `axis` at which all that the rules split there fits (whatever the
    devices visible now: a user sizing a mesh for another machine reads the same list)."""
    split_here = {name: counts[name] for name, other in merged.items() if other == axis and name in counts}
    # A size past every count but the kv heads' (which may repeat) divides nothing.
    largest = min((count for name, count in split_here.items() if name != "kv_heads"), default=max(split_here.values()))
    return [size for size in range(1, largest + 1)
            if all(_copies_per_entry(name, count, size, counts, merged) is not None
                   for name, count in split_here.items())]


def plan_for(cfg: Any, mesh: Mesh, rules: Mapping[str, str | None] | None = None, *,
             replicate_misfits: bool = False) -> Plan:
    """The layout of a model of config `cfg` on `mesh`: rules checked and every split axis's count
    checked against its mesh axis (ShardingError names a misfit and the sizes that fit; with
    `replicate_misfits`, what a draft following its target's mesh gets, a misfit is replicated)."""
    merged = _check_rules(rules, mesh)
    counts = axis_counts(cfg)
    kv_repeats = 1
    for logical, count in counts.items():
        axis = merged.get(logical)
        size = 1 if axis is None else mesh.shape[axis]
        repeats = _copies_per_entry(logical, count, size, counts, merged)
        if repeats is not None:
            kv_repeats = max(kv_repeats, repeats)
            continue
        if replicate_misfits:
            merged[logical] = None
            continue
        raise ShardingError(
            f"{count} {logical} (the model's {logical.replace('_', ' ')}) do not divide over mesh axis {axis!r} of "
            f"size {size}; the sizes of {axis!r} this model fits: {_sizes_that_fit(axis, counts, merged)}, or pass "
            f"rules={{{logical!r}: None}} to replicate it")
    by_key_head = "linear_key_heads" in counts and merged["linear_key_heads"] is not None and (
        mesh.shape[merged["linear_key_heads"]] > 1)
    # The stacked q/k/v channels split only regrouped per key head, with the key heads.
    merged["linear_channels"] = merged["linear_key_heads"] if by_key_head else None
    return Plan(mesh=_auto(mesh), rules=tuple(sorted(merged.items())), kv_repeats=kv_repeats,
                channels_by_key_head=by_key_head, counted=("batch", *counts))


def _auto(mesh: Mesh) -> Mesh:
    """The mesh with Auto axes: jaxspec's programs let XLA propagate shardings (an Explicit
    mesh, jax.make_mesh's default, would ask every op for a sharding in its type)."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def laid_out_for(cfg: Any, params: Any, plan: Plan) -> tuple[Any, Any]:
    """(config, params) as the plan lays them out, before placing: kv heads repeated, a
    DeltaNet's q/k/v channels grouped per key head. The same function of the input."""
    cfg, params = repeat_kv_heads(cfg, params, plan.kv_repeats)
    if plan.channels_by_key_head:
        params = gated_deltanet.grouped_by_key_head(params, cfg)
    return cfg, params


def repeat_kv_heads(cfg: Any, params: Any, repeats: int) -> tuple[Any, Any]:
    """(config, params) with every attention layer's kv heads repeated `repeats` times in place
    (head j becomes heads j*r .. j*r + r - 1; k/v projections and biases alike, any weight
    format): the same function of the input, with K*r kv heads."""
    if repeats == 1:
        return cfg, params
    inner = getattr(cfg, "block", cfg)  # an MTP head's decoder layer
    if "num_kv_heads" not in {field.name for field in dataclasses.fields(inner)}:
        raise ShardingError(
            f"the {inner.num_kv_heads} kv heads of this {type(inner).__name__} (every layer type's count is a multiple "
            f"of it) do not divide over the mesh, and its per-type heads are not repeated to fit; pass "
            f"rules={{'kv_heads': None}} to replicate them, or a mesh axis dividing {inner.num_kv_heads}")
    kv_rows = inner.num_kv_heads * inner.head_dim
    # Row index of each repeated row: head j's H rows, r times, head by head. [K*r*H]
    index = np.repeat(np.arange(kv_rows).reshape(-1, inner.head_dim), repeats, axis=0).reshape(-1)
    rows = functools.partial(quant.take_rows, index=index)  # [K*H, ...] -> [K*r*H, ...]

    def repeat(node):
        if isinstance(node, layers.AttentionParams):
            node = layers.unfuse_projections(node)
            return node.replace(k_proj=rows(node.k_proj), v_proj=rows(node.v_proj), k_bias=rows(node.k_bias),
                                v_bias=rows(node.v_bias))
        return node

    params = jax.tree.map(repeat, params, is_leaf=lambda node: isinstance(node, layers.AttentionParams))
    widened = dataclasses.replace(inner, num_kv_heads=inner.num_kv_heads * repeats)
    return (dataclasses.replace(cfg, block=widened) if inner is not cfg else widened), params


def unfused_where_split(params: Any, plan: Plan) -> Any:
    """Fused q/k/v and gate/up apart when a tensor-parallel split would cut across their parts."""
    if any(plan.axis_size(name) > 1 for name in _SPLITS_FUSED):
        return layers.unfuse_projections(params)
    return params


def place_params(params: Any, plan: Plan) -> Any:
    """`params` on the plan's devices (fused projections unfused where split)."""
    params = unfused_where_split(params, plan)
    return jax.device_put(params, plan.param_shardings(params))


def to_host(tree: Any) -> Any:
    """numpy copies of a pytree of arrays, gathered across processes when an array spans
    devices this process cannot address (a multi-host mesh)."""
    def fetch(leaf):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return np.asarray(leaf)

    return jax.tree.map(fetch, tree)
