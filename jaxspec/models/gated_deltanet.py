"""Gated DeltaNet (Yang et al. 2024), the linear-attention layer of the Qwen3.5 hybrid.

Contract: the gated delta rule in two forms that compute the same numbers,
  * `recurrent_delta_rule`, step by step, the reference (it is the rule as written, and is
    checked against transformers' `torch_recurrent_gated_delta_rule`), recording the state after
    every position, which is what rollback by index needs for short forwards;
  * `chunked_delta_rule`, the chunked parallel (WY/UT) form for long forwards, recording only the
    state at each chunk start (`chunk_end_state` recomputes any position within a chunk);
and `gated_delta_net`, the whole layer: q/k/v projection, a short causal depthwise conv1d
(`conv_windows` gives the conv window after any number of new inputs), the rule, and an RMSNorm
gated by silu(z). Everything is a pure function; the hybrid cache (jaxspec.models.hybrid_cache)
owns the ring of committed states, and `qwen35.forward` decides which form a forward runs.

Letters (beside `jaxspec.config.ModelConfig`'s): E value heads (the state's heads), J key heads,
X key head dim, Y value head dim, C conv channels (2*J*X + E*Y), W conv kernel, c chunk size. The
state is [B, E, X, Y]; the rule reads inputs as [B, T, E, ...].
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.models.layers import rms_norm
from jaxspec.models.params import param
from jaxspec.models.quant import matmul, take_rows


@struct.dataclass
class DeltaNetParams:
    """A Gated DeltaNet mixer's weights (`gated_delta_net`), `[out, in]` as HF stores them.

    The q/k/v channel axis C of `qkv_proj` and `conv_weight` (and of the conv state the cache
    keeps) is stacked [q (J*X); k (J*X); v (E*Y)] as checkpoints store it, or, with
    `channels_by_key_head`, grouped per key head: J blocks of [q_j (X), k_j (X), v of value heads
    j*r .. j*r + r - 1 (r*Y)], r = E / J (`by_key_head`). A split of the grouped axis into whole
    blocks keeps each device's q, k and v heads together, so `jaxspec.shard` regroups it when
    the key heads are split (the conv is per channel: any order computes the same).
    """

    qkv_proj: jax.Array = param(axes=("linear_channels", "embed"), linear=True)  # [C, D]
    z_proj: jax.Array = param(axes=("linear_heads", "embed"), linear=True)  # [E*Y, D]: the output gate
    b_proj: jax.Array = param(axes=("linear_heads", "embed"), linear=True)  # [E, D]: beta
    a_proj: jax.Array = param(axes=("linear_heads", "embed"), linear=True)  # [E, D]: decay input
    conv_weight: jax.Array = param(axes=("linear_channels", None))  # [C, W]: depthwise causal conv
    A_log: jax.Array = param(axes=("linear_heads",))  # [E]
    dt_bias: jax.Array = param(axes=("linear_heads",))  # [E]
    out_norm: jax.Array = param(axes=(None,))  # [Y]: every value head shares it
    out_proj: jax.Array = param(axes=("embed", "linear_heads"), linear=True)  # [D, E*Y]
    channels_by_key_head: bool = struct.field(pytree_node=False, default=False)  # C's order (above)


def key_head_channel_order(cfg: "DeltaNetConfig") -> np.ndarray:
    """int[C]: the stacked channel each grouped channel takes (DeltaNetParams' docstring)."""
    J, E, X, Y = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    per_key = E // J * Y  # the value channels of one key head's value heads
    blocks = [np.concatenate([np.arange(j * X, (j + 1) * X),  # q_j
                              J * X + np.arange(j * X, (j + 1) * X),  # k_j
                              2 * J * X + np.arange(j * per_key, (j + 1) * per_key)])  # v_j
              for j in range(J)]
    return np.concatenate(blocks)


def grouped_by_key_head(params: Any, cfg: "DeltaNetConfig") -> Any:
    """A params tree with every DeltaNet mixer's q/k/v channels grouped per key head (`by_key_head`)."""
    def group(node):
        return by_key_head(node, cfg) if isinstance(node, DeltaNetParams) else node

    return jax.tree.map(group, params, is_leaf=lambda node: isinstance(node, DeltaNetParams))


def by_key_head(weights: DeltaNetParams, cfg: "DeltaNetConfig") -> DeltaNetParams:
    """`weights` with the q/k/v channels grouped per key head (rows permuted; any weight format)."""
    if weights.channels_by_key_head:
        return weights
    order = key_head_channel_order(cfg)
    return weights.replace(qkv_proj=take_rows(weights.qkv_proj, order), conv_weight=take_rows(weights.conv_weight, order),
                           channels_by_key_head=True)


class DeltaNetConfig(Protocol):
    """What a Gated DeltaNet layer reads from its trunk's config (`qwen35.Qwen35Config` has it)."""

    linear_num_key_heads: int  # J
    linear_num_value_heads: int  # E
    linear_key_head_dim: int  # X
    linear_value_head_dim: int  # Y
    linear_conv_kernel: int  # W
    norm_eps: float

    @property
    def key_dim(self) -> int: ...  # J*X

    @property
    def conv_dim(self) -> int: ...  # C = 2*J*X + E*Y

CHUNK_SIZE = 64  # the chunked form's chunk (HF's and FLA's default)
L2NORM_EPS = 1e-6  # q/k L2 normalisation inside the delta rule (FLA's constant, not rms_norm_eps)


class DeltaRule(enum.Enum):
    """Which form of the delta rule a forward runs; None in `qwen35.forward` picks by T."""

    RECURRENT = "recurrent"  # step by step; records the state after every position
    CHUNKED = "chunked"  # chunked parallel (WY/UT transform); records chunk-start states


# ----------------------------------------------------------------------------------------------
# The conv window
# ----------------------------------------------------------------------------------------------


def conv_windows(window: jax.Array, inputs: jax.Array, counts: jax.Array) -> jax.Array:
    """The conv window after `counts` [B, M] of the new inputs: [B, M, W-1, C].

    window [B, W-1, C] is the window before them, inputs [B, T, C] the new conv inputs; count 0
    is `window` itself, count T the window after all of them.
    """
    span = window.shape[1]
    sequence = jnp.concatenate([window, inputs], axis=1)  # [B, W-1+T, C]
    at = counts[:, :, None] + jnp.arange(span)[None, None, :]  # [B, M, W-1]
    return jnp.take_along_axis(sequence[:, None], at[..., None], axis=2)

# ----------------------------------------------------------------------------------------------
# The delta rule: recurrent and chunked forms
# ----------------------------------------------------------------------------------------------


def heads_first(x: jax.Array) -> jax.Array:  # [B, T, E, ...] -> [B, E, T, ...]
    return jnp.swapaxes(x, 1, 2)


def recurrent_delta_rule(query, key, value, decay, beta, state):
    """The gated delta rule step by step, recording the state after every position.

    query, key [B, T, E, X] (normalised, query scaled); value [B, T, E, Y]; decay, beta [B, T, E];
    state [B, E, X, Y]. Per position: S <- S * exp(g); S <- S + k (beta (v - S^T k))^T; o = S^T q.
    Returns outputs [B, T, E, Y] and the states [B, T, E, X, Y].
    """
    def step(state, inputs):
        q, k, v, g, b = inputs
        state = state * jnp.exp(g)[..., None, None]
        memory = jnp.einsum("BEXY,BEX->BEY", state, k)  # what the state already predicts for k
        delta = (v - memory) * b[..., None]
        state = state + k[..., :, None] * delta[..., None, :]
        return state, (jnp.einsum("BEXY,BEX->BEY", state, q), state)

    if key.shape[1] <= 2:  # decode and the draft's catch-up: a loop would only add overhead
        outs, states = [], []
        for t in range(key.shape[1]):
            state, (out, _) = step(state, (query[:, t], key[:, t], value[:, t], decay[:, t], beta[:, t]))
            outs.append(out)
            states.append(state)
        return jnp.stack(outs, axis=1), jnp.stack(states, axis=1)
    time_major = [jnp.swapaxes(x, 0, 1) for x in (query, key, value, decay, beta)]
    # A scan, not an unrolled loop: unrolling 16 steps costs seconds of XLA compile per layer.
    _, (outs, states) = jax.lax.scan(step, state, time_major)
    return jnp.swapaxes(outs, 0, 1), jnp.swapaxes(states, 0, 1)


def _chunk_terms(key, decay, beta):
    """Within-chunk quantities. key [B, E, c, X]; decay, beta [B, E, c].

    Returns the cumulative log decay G [B, E, c], the pairwise decays exp(G_i - G_j) for j <= i
    (0 above the diagonal) [B, E, c, c], and the strictly lower part A of the UT system I + A,
    A_ij = beta_i (k_i . k_j) exp(G_i - G_j) for j < i.
    """
    size = key.shape[2]
    cumulative = jnp.cumsum(decay, axis=-1)
    causal = jnp.tril(jnp.ones((size, size), bool))
    difference = cumulative[..., :, None] - cumulative[..., None, :]
    pairwise = jnp.where(causal, jnp.exp(jnp.where(causal, difference, 0.0)), 0.0)
    lower = jnp.einsum("BEiX,BEjX->BEij", key * beta[..., None], key) * pairwise
    lower = jnp.where(jnp.tril(jnp.ones((size, size), bool), -1), lower, 0.0)
    return cumulative, pairwise, lower


def unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """(I + A)^-1 for a strictly lower triangular A [..., c, c], by doubling.

    N = -A is nilpotent (N^c = 0), so (I - N)^-1 = I + N + ... + N^(c-1)
    = (I + N)(I + N^2)(I + N^4)...: 2 log2(c) matmuls. The same numbers as a triangular solve
    (tested), but a handful of dots for XLA: a triangular solve inside the chunk scan cost seconds
    of CPU compile per layer.
    """
    size = lower.shape[-1]
    eye = jnp.eye(size, dtype=lower.dtype)
    power = -lower
    inverse = eye + power
    for _ in range(max(size - 1, 1).bit_length() - 1):
        power = power @ power
        inverse = inverse + inverse @ power
    return inverse


def _chunk_step(state, query, key, value, decay, beta):
    """One chunk of the chunked form: (outputs [B, E, c, Y] or None, state after the chunk).

    The UT transform turns the chunk's c sequential rank-one updates into matmuls with
    T = (I + A)^-1: u = T (beta v) and w = T (beta k e^G); the new values the state has not yet
    predicted are u - w S, and S' = S e^{G_c} + (k e^{G_c - G})^T (u - w S).
    """
    cumulative, pairwise, lower = _chunk_terms(key, decay, beta)
    transform = unit_lower_inverse(lower)
    new_values = transform @ (value * beta[..., None])
    key_cumdecay = transform @ (key * (beta * jnp.exp(cumulative))[..., None])
    corrected = new_values - jnp.einsum("BEcX,BEXY->BEcY", key_cumdecay, state)
    total = cumulative[..., -1:]  # [B, E, 1]
    out = None
    if query is not None:
        attention = jnp.einsum("BEiX,BEjX->BEij", query, key) * pairwise
        out = (jnp.einsum("BEcX,BEXY->BEcY", query * jnp.exp(cumulative)[..., None], state)
               + jnp.einsum("BEij,BEjY->BEiY", attention, corrected))
    state = (state * jnp.exp(total)[..., None]
             + jnp.einsum("BEcX,BEcY->BEXY", key * jnp.exp(total - cumulative)[..., None], corrected))
    return out, state


def chunk_end_state(state, key, value, decay, beta):
    """The state [B, E, X, Y] after one chunk from `state`: key [B, E, c, X], value [B, E, c, Y],
    decay, beta [B, E, c] (heads first). A position made an identity update (decay 0, beta 0)
    leaves the state as it was, so this also gives the state part-way through a chunk."""
    return _chunk_step(state, None, key, value, decay, beta)[1]


def chunked_delta_rule(query, key, value, decay, beta, state, chunk_size: int = CHUNK_SIZE):
    """The gated delta rule in chunks of `chunk_size` (same inputs as `recurrent_delta_rule`).

    T is padded to whole chunks with identity updates (decay 0, beta 0). Returns outputs
    [B, T, E, Y], the state at each chunk start [B, T'/c, E, X, Y] and the final state.
    """
    batch, steps, heads = key.shape[:3]
    size = min(chunk_size, steps)
    pad = -steps % size
    padded = [jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (query, key, value, decay, beta)]
    chunks = (steps + pad) // size

    def by_chunk(x):  # [B, T', E, ...] -> [n, B, E, c, ...]
        x = x.reshape(batch, chunks, size, *x.shape[2:])
        return jnp.moveaxis(jnp.swapaxes(x, 2, 3), 1, 0)

    def scan_chunk(state, inputs):
        out, next_state = _chunk_step(state, *inputs)
        return next_state, (out, state)

    final, (outs, starts) = jax.lax.scan(scan_chunk, state, [by_chunk(x) for x in padded])
    outs = jnp.moveaxis(outs, 0, 1).swapaxes(2, 3).reshape(batch, chunks * size, heads, -1)[:, :steps]
    return outs, jnp.moveaxis(starts, 0, 1), final


# ----------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------


def _l2_normalise(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def gated_delta_net(weights: DeltaNetParams, cfg: DeltaNetConfig, h: jax.Array, conv_window: jax.Array, state: jax.Array,
                    batch: int, steps: int, rule: DeltaRule) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A Gated DeltaNet layer over T new tokens per row. h: [D, B*T] (normed).

    conv_window [B, W-1, C] and state [B, E, X, Y]
    are the committed ones at each row's length.
    Returns the output [D, B*T] and what the commit needs, keyed by the fields of the cache's
    record (`hybrid_cache.RecordedSteps` for the recurrent form, `hybrid_cache.ChunkedSteps` for
    the chunked).
    """
    J, E, X, Y = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    mixed = (matmul(weights.qkv_proj, h)).reshape(cfg.conv_dim, batch, steps).transpose(1, 2, 0)  # [B, T, C]

    # Depthwise causal conv over [window, new inputs]: out[t] = sum_w weight[:, w] * seq[t + w].
    kernel = cfg.linear_conv_kernel
    sequence = jnp.concatenate([conv_window, mixed], axis=1)  # [B, W-1+T, C]
    conv = sum(weights.conv_weight[:, w] * sequence[:, w: w + steps] for w in range(kernel))
    conv = jax.nn.silu(conv)
    if weights.channels_by_key_head:  # J blocks of [q_j, k_j, v_j]
        blocks = conv.reshape(batch, steps, J, 2 * X + E // J * Y)
        query, key = blocks[..., :X], blocks[..., X: 2 * X]
        value = blocks[..., 2 * X:].reshape(batch, steps, E, Y)  # key head j's value heads are j*r .. j*r + r - 1
    else:
        query = conv[..., : cfg.key_dim].reshape(batch, steps, J, X)
        key = conv[..., cfg.key_dim: 2 * cfg.key_dim].reshape(batch, steps, J, X)
        value = conv[..., 2 * cfg.key_dim:].reshape(batch, steps, E, Y)
    # Each key head serves E / J consecutive value heads.
    query = jnp.repeat(_l2_normalise(query) * (X ** -0.5), E // J, axis=2)
    key = jnp.repeat(_l2_normalise(key), E // J, axis=2)

    def per_head(projection):  # [E, B*T] -> [B, T, E]
        return projection.reshape(E, batch, steps).transpose(1, 2, 0)

    beta = jax.nn.sigmoid(per_head(matmul(weights.b_proj, h)))
    decay = -jnp.exp(weights.A_log) * jax.nn.softplus(per_head(matmul(weights.a_proj, h)) + weights.dt_bias)

    if rule is DeltaRule.RECURRENT:
        out, states = recurrent_delta_rule(query, key, value, decay, beta, state)
        pending = dict(conv_inputs=mixed, states=states)
    else:
        out, chunk_states, _ = chunked_delta_rule(query, key, value, decay, beta, state)
        size = min(CHUNK_SIZE, steps)
        pad = [(0, 0), (0, -steps % size)]
        pending = dict(conv_inputs=mixed, chunk_states=chunk_states[:, 1:],
                       keys=jnp.pad(key, pad + [(0, 0)] * 2), values=jnp.pad(value, pad + [(0, 0)] * 2),
                       decay=jnp.pad(decay, pad + [(0, 0)]), beta=jnp.pad(beta, pad + [(0, 0)]))

    # Gated RMSNorm per value head: norm(out) * weight * silu(z).
    z = (matmul(weights.z_proj, h)).reshape(E, Y, batch, steps).transpose(2, 3, 0, 1)  # [B, T, E, Y]
    out = rms_norm(out, weights.out_norm, cfg.norm_eps, axis=-1) * jax.nn.silu(z)
    out = out.reshape(batch * steps, E * Y).T  # [E*Y, B*T]
    return matmul(weights.out_proj, out), pending
