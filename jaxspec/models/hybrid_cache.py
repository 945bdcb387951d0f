"""The Qwen3.5 hybrid cache: attention KV and a ring of committed Gated DeltaNet states.

Contract: a `jaxspec.cache.Cache` (rollback by length, docs/design.md) for a trunk that
mixes full-attention layers with Gated DeltaNet layers (`jaxspec.models.qwen35`). It stores the
attention layers' K/V and each DeltaNet layer's conv window and recurrent state, commits what a
forward left pending, and refuses (`StateRollbackError`) any length it cannot serve. It reads
its config through `HybridCacheConfig` (`qwen35.Qwen35Config` has it), so it never imports the
trunk; the forward builds the pending records (`RecordedSteps`, `ChunkedSteps`) from what
`gated_deltanet.gated_delta_net` returns and reads the committed state with `current_state`.

Rollback of recurrent state. Attention layers roll back by length as everywhere. A DeltaNet
layer's state cannot be "un-written", so:
  * a forward leaves the per-position states in the cache as `pending`: with T <=
    `Qwen35Config.recorded_steps` (decode, verify) the recurrent form records the state after
    every position, [B, T, E, X, Y]; a longer forward (prefill) uses the chunked parallel form
    and records the state at each chunk start plus the per-position k, v, decay and beta;
  * `advance(n)` / `set_length(L)` then select, per row, the state after L tokens: an index into
    the recorded states (no replay forward), or for a chunked forward the one partial chunk
    up to L recomputed from its start state with positions past L made identity updates
    (decay 0, beta 0), which is how right-padded prompts end up with their own last state;
  * committed states live in a small ring, `rollback_states` (R) per layer and row,
    slot = length % R, so `set_length` may also go back up to R - 1 positions behind the
    furthest committed length with no forward in between (the draft-model and layer-skip
    proposers roll their draft back each round, a finished row by all k + 1 positions it wrote:
    R >= k + 2, which jaxspec.spec.methods sizes from the request). A rollback past what the
    ring holds cannot be served by an index and raises `StateRollbackError` (eagerly, or from
    inside a jitted program through a callback that only runs when it fails).
    After a chunked forward only the selected state is committed: the ring then starts there.
Recording every state costs E*X*Y*4 bytes per position and DeltaNet layer (48 MiB per position
per row at Qwen3.5-9B's shapes; bench/hybrid.py); a small `recorded_steps` makes longer forwards
record the chunked way instead (~1.5 MiB per position there), the commit then recomputing the
selected state from the chunk start: the same numbers, for a matmul-sized recompute per commit.
A target can use recorded_steps=0; a draft that rolls back needs its T = 2 catch-up recorded (>= 2).

Letters (beside `jaxspec.config.ModelConfig`'s): E value heads (the state's heads), J key heads,
X key head dim, Y value head dim, C conv channels (2*J*X + E*Y), W conv kernel, R rollback states.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.cache import KVFormat, StateRollbackError, kv_axes
from jaxspec.models.gated_deltanet import chunk_end_state, conv_windows, heads_first
from jaxspec.pallas import kv_quant
from jaxspec.pallas.kv_quant import Packed


class HybridCacheConfig(Protocol):
    """What the hybrid cache reads from its trunk's config (`qwen35.Qwen35Config` has it)."""

    num_kv_heads: int  # K
    head_dim: int  # H
    linear_num_value_heads: int  # E
    linear_key_head_dim: int  # X
    linear_value_head_dim: int  # Y
    linear_conv_kernel: int  # W
    rollback_states: int  # R

    @property
    def conv_dim(self) -> int: ...  # C = 2*J*X + E*Y

    @property
    def attention_layers(self) -> tuple[int, ...]: ...  # indices of the full-attention layers

    @property
    def linear_layers(self) -> tuple[int, ...]: ...  # indices of the DeltaNet layers


# Cache axes: the ring and state shard over batch and the DeltaNet's value heads.
SSM_AXES = ("batch", None, "linear_heads", None, None)
CONV_AXES = ("batch", None, None, "linear_channels")


@struct.dataclass
class RecordedSteps:
    """What a recurrent-form forward (T <= cfg.recorded_steps) leaves for the commit."""

    conv_inputs: tuple[jax.Array, ...]  # per DeltaNet layer [B, T, C]: the conv's new inputs
    states: tuple[jax.Array, ...]  # per DeltaNet layer [B, T, E, X, Y]: the state after each position

    @property
    def steps(self) -> int:
        return self.conv_inputs[0].shape[1]


@struct.dataclass
class ChunkedSteps:
    """What a chunked-form forward leaves: chunk-start states and the per-position inputs."""

    conv_inputs: tuple[jax.Array, ...]  # per DeltaNet layer [B, T, C]
    # per DeltaNet layer [B, T'/c - 1, E, X, Y]: the state at the start of chunks 1, 2, ... (chunk
    # 0 starts from the committed state, which the ring holds: not copied, so a one-chunk forward
    # such as a verify records per-position inputs only)
    chunk_states: tuple[jax.Array, ...]
    keys: tuple[jax.Array, ...]  # [B, T', E, X]: normalised keys, T' = T padded to whole chunks
    values: tuple[jax.Array, ...]  # [B, T', E, Y]
    decay: tuple[jax.Array, ...]  # [B, T', E]: log decay g (0 on padding)
    beta: tuple[jax.Array, ...]  # [B, T', E]: write strength (0 on padding)

    @property
    def steps(self) -> int:
        return self.conv_inputs[0].shape[1]

    @property
    def chunk_size(self) -> int:
        return self.keys[0].shape[1] // (self.chunk_states[0].shape[1] + 1)


@struct.dataclass
class Qwen35Cache:
    """KV buffers for the attention layers, a ring of committed states for the DeltaNet layers:
    a `jaxspec.cache.Cache` whose max_rollback is rollback_states - 1.

    The state after `l` committed tokens lives in ring slot l % R; the ring holds every length
    in [oldest, length]. `pending` is what the last forward recorded, consumed by the next
    `set_length` / `advance` (it is None between a commit and the next forward, so the cache
    keeps one shape across the loop's rounds).
    """

    keys: tuple[Packed, ...]  # per attention layer [B, K, S, H] (a pytree for a block format)
    values: tuple[Packed, ...]  # per attention layer [B, K, S, H]
    conv: tuple[jax.Array, ...]  # per DeltaNet layer [B, R, W-1, C]: the conv's last W-1 inputs
    ssm: tuple[jax.Array, ...]  # per DeltaNet layer [B, R, E, X, Y]: the recurrent state
    length: jax.Array  # int32[B]: tokens committed per row
    oldest: jax.Array  # int32[B]: the shortest length whose DeltaNet state the ring still holds
    pending: RecordedSteps | ChunkedSteps | None = None
    max_length: int = struct.field(pytree_node=False, default=0)  # S

    @classmethod
    def create(cls, cfg: HybridCacheConfig, batch: int, capacity: int, dtype=jnp.float32, *,
               kv_format: KVFormat | str | tuple[str, str] | None = None) -> "Qwen35Cache":
        """Zeroed buffers. `kv_format` stores the attention layers' K/V as `KVCache` does (float32
        by default, bf16, q8_0 / q5_1); the DeltaNet states are always float32."""
        kv_format = KVFormat.parse(kv_format if kv_format is not None else
                                   ("bf16" if jnp.dtype(dtype) == jnp.bfloat16 else "f32"))
        kv_format.check(cfg)
        kv_shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        R = cfg.rollback_states
        conv_shape = (batch, R, max(cfg.linear_conv_kernel - 1, 0), cfg.conv_dim)
        ssm_shape = (batch, R, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        attention, linear = cfg.attention_layers, cfg.linear_layers
        return cls(
            keys=tuple(kv_quant.zeros(kv_shape, kv_format.keys) for _ in attention),
            values=tuple(kv_quant.zeros(kv_shape, kv_format.values) for _ in attention),
            conv=tuple(jnp.zeros(conv_shape, jnp.float32) for _ in linear),
            ssm=tuple(jnp.zeros(ssm_shape, jnp.float32) for _ in linear),
            length=jnp.zeros((batch,), jnp.int32),
            oldest=jnp.zeros((batch,), jnp.int32),
            max_length=capacity,
        )

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    def logical_axes(self) -> "Qwen35Cache":
        """This cache (between rounds: nothing pending) with every array replaced by its logical
        axes (what jaxspec.sharding lays out)."""
        return self.replace(keys=kv_axes(self.keys), values=kv_axes(self.values),
                            conv=tuple(CONV_AXES for _ in self.conv), ssm=tuple(SSM_AXES for _ in self.ssm),
                            length=("batch",), oldest=("batch",), pending=None)

    @property
    def capacity(self) -> int:  # S
        return self.max_length

    @property
    def rollback_states(self) -> int:  # R
        return self.ssm[0].shape[1] if self.ssm else 1

    @property
    def max_rollback(self) -> int:
        """Positions `set_length` can go back behind the furthest commit with no forward between
        (the `jaxspec.cache.Cache` contract): the ring holds R states, the current one included."""
        return self.rollback_states - 1

    def current_state(self, index: int) -> tuple[jax.Array, jax.Array]:
        """DeltaNet layer `index`'s (conv window [B, W-1, C], state [B, E, X, Y]) at `length`."""
        return _ring_read(self.conv[index], self.length), _ring_read(self.ssm[index], self.length)

    def advance(self, accepted: jax.Array) -> "Qwen35Cache":
        """Commit `accepted[b]` more of the positions the last forward wrote at each row's offset."""
        return self.set_length(self.length + accepted)

    def set_length(self, length: jax.Array) -> "Qwen35Cache":
        """Commit or roll back to `length[b]` tokens per row.

        From the last forward's pending positions (length .. length + T), or back to any length
        the ring holds ([oldest, length]); anything else raises StateRollbackError (see
        `_check_restorable` for what is checked inside a jitted program).
        """
        target = jnp.broadcast_to(jnp.asarray(length, jnp.int32), self.length.shape)
        base, R = self.length, self.rollback_states
        steps = 0 if self.pending is None else self.pending.steps
        from_pending = (target > base) & (target <= base + steps)
        restorable = (target >= self.oldest) & (target <= base)
        ok = from_pending | restorable
        # Under jit the host is told only of a pure rollback (no pending forward): that is where a
        # ring too small for a drafter's k shows (a branch whose host callback runs only on
        # failure). Any length the cache cannot serve also poisons that row's state with NaN, so
        # a caller's bad commit shows in its outputs rather than as plausible numbers.
        _check_restorable(ok, target, base, self.oldest, steps, R, on_device=self.pending is None)
        conv, ssm, oldest = self.conv, self.ssm, self.oldest
        if self.pending is not None and self.ssm:
            if isinstance(self.pending, RecordedSteps):
                conv, ssm = _commit_recorded(self, self.pending, target, from_pending)
                oldest = jnp.where(from_pending, jnp.maximum(oldest, target - R + 1), oldest)
            else:
                # One state is committed: the ring stays contiguous only if it is the next one.
                conv, ssm = _commit_chunked(self, self.pending, target, from_pending)
                extends = target == base + 1
                oldest = jnp.where(from_pending, jnp.where(extends, jnp.maximum(oldest, target - R + 1), target), oldest)
        unservable = jnp.where(ok, R, target % R)  # R: out of range, nothing written
        rows = jnp.arange(self.batch)
        ssm = tuple(ring.at[rows, unservable].set(jnp.nan, mode="drop") for ring in ssm)
        return self.replace(conv=conv, ssm=ssm, length=target, oldest=jnp.minimum(oldest, target), pending=None)


def _ring_read(ring: jax.Array, length: jax.Array) -> jax.Array:
    """ring [B, R, ...] -> the entry for `length` int32[B]: [B, ...]."""
    return ring[jnp.arange(ring.shape[0]), length % ring.shape[1]]


def _commit_recorded(cache: Qwen35Cache, pending: RecordedSteps, target, from_pending):
    """Write the states for lengths base+1 .. target (the last R of them) into the ring."""
    base, R = cache.length, cache.rollback_states
    steps = pending.steps
    offsets = jnp.arange(steps)[None, :]  # [1, T]: the state after base + t + 1 tokens
    count = (target - base)[:, None]
    keep = from_pending[:, None] & (offsets < count) & (offsets >= count - R)
    slots = jnp.where(keep, (base[:, None] + offsets + 1) % R, R)  # R: out of range, dropped
    rows = jnp.arange(cache.batch)[:, None]
    conv, ssm = [], []
    for index, (conv_ring, ssm_ring) in enumerate(zip(cache.conv, cache.ssm)):
        windows = conv_windows(_ring_read(conv_ring, base), pending.conv_inputs[index],
                               jnp.broadcast_to(offsets + 1, keep.shape))
        conv.append(conv_ring.at[rows, slots].set(windows, mode="drop"))
        ssm.append(ssm_ring.at[rows, slots].set(pending.states[index], mode="drop"))
    return tuple(conv), tuple(ssm)


def _commit_chunked(cache: Qwen35Cache, pending: ChunkedSteps, target, from_pending):
    """Recompute each row's state after `target` tokens from its chunk's start; write that one."""
    base, R = cache.length, cache.rollback_states
    batch, size = cache.batch, pending.chunk_size
    last = jnp.maximum(target - base - 1, 0)  # [B]: the last position taken, within the forward
    chunk = last // size  # [B]
    within = jnp.arange(size)[None, :] <= (last - chunk * size)[:, None]  # [B, c]: positions kept
    at = (chunk * size)[:, None] + jnp.arange(size)[None, :]  # [B, c]
    slots = jnp.where(from_pending, target % R, R)
    rows = jnp.arange(batch)
    conv, ssm = [], []
    for index, (conv_ring, ssm_ring) in enumerate(zip(cache.conv, cache.ssm)):
        def gather(x):
            return jnp.take_along_axis(x, at.reshape(batch, size, *([1] * (x.ndim - 2))), axis=1)
        start = _ring_read(ssm_ring, base)  # [B, E, X, Y]: chunk 0's start
        if pending.chunk_states[index].shape[1]:
            later = pending.chunk_states[index][rows, jnp.maximum(chunk - 1, 0)]
            start = jnp.where((chunk > 0)[:, None, None, None], later, start)
        decay = jnp.where(within[..., None], gather(pending.decay[index]), 0.0)
        beta = jnp.where(within[..., None], gather(pending.beta[index]), 0.0)
        state = chunk_end_state(start, heads_first(gather(pending.keys[index])),
                                heads_first(gather(pending.values[index])),
                                decay.transpose(0, 2, 1), beta.transpose(0, 2, 1))
        window = conv_windows(_ring_read(conv_ring, base), pending.conv_inputs[index],
                              (target - base)[:, None])[:, 0]
        conv.append(conv_ring.at[rows, slots].set(window, mode="drop"))
        ssm.append(ssm_ring.at[rows, slots].set(state, mode="drop"))
    return tuple(conv), tuple(ssm)


def _raise_rollback(ok, target, length, oldest, steps, history):
    ok = np.asarray(ok)
    if ok.all():
        return
    row = int(np.flatnonzero(~ok)[0])
    target, length, oldest = int(np.asarray(target)[row]), int(np.asarray(length)[row]), int(np.asarray(oldest)[row])
    reachable = f"[{oldest}, {length}]" + (f" or ({length}, {length + int(steps)}] from the last forward"
                                            if int(steps) else "")
    raise StateRollbackError(
        f"row {row}: cannot set a hybrid cache to length {target}; its DeltaNet state is kept for "
        f"lengths {reachable} only. Qwen35Config.rollback_states={int(history)} bounds a rollback to "
        f"{int(history) - 1} positions behind the furthest commit (a draft drafting k tokens per "
        "round needs rollback_states >= k + 2), and a chunked forward (a prefill, or any T > "
        "recorded_steps) commits one state, so a rolled-back draft needs recorded_steps >= 2")


def _check_restorable(ok, target, length, oldest, steps: int, history: int, *, on_device: bool) -> None:
    """Raise StateRollbackError where `ok` is False: now if concrete, else (with `on_device`)
    from inside the program."""
    if not any(isinstance(x, jax.core.Tracer) for x in (ok, target, length, oldest)):
        _raise_rollback(ok, target, length, oldest, steps, history)
        return
    if not on_device:
        return
    # Under jit: a host callback in the failing branch only, so a healthy program never syncs.
    jax.lax.cond(
        jnp.all(ok),
        lambda *args: None,
        lambda *args: jax.debug.callback(functools.partial(_raise_rollback, steps=steps, history=history), *args),
        ok, target, length, oldest,
    )
