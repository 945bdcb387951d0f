"""The training objective: the EAGLE-3 training-time test as a loss, and the jitted steps.

Alignment (the inference convention of models/eagle3.py and models/mtp.py): head slot p reads
(target feature p, token p + 1) and drafts token p + 2; the label is what the *target* predicts at
position p + 1, its argmax (or its distribution over the draft vocabulary). Only positions whose
prediction lands in the response count (the loss mask); prompts are context, not targets.

The training-time test (EAGLE-3, "TTT"): the head is unrolled `ttt_steps` times over the whole
sequence at once (`unrolled`), each depth one head forward whose positions are the chain starts c.
Depth 0 reads the encoded target features causally, as the head absorbs committed positions at
inference. Depth j > 0 runs, for every start c, the j-th step of the chain drafted after position
c: the head's own g_next of depth j - 1 at the same c, the token at slot c + j, RoPE position
c + j, attending to the depth-0 context of starts <= c and to its own chain's depths 1..j
(`jaxspec.models.draft_chain`): the exact attention a depth-j draft has at inference. Tokens stay
the ground truth (a deeper draft only matters when the shallower ones were accepted). Step j's
loss is weighted `step_decay ** j`. MTP trains through the same code with its own forward, the
target's final-normed hidden as the feature and the target's vocabulary.

`train_step` and `evaluate` compile once per StepSpec; the target's arrays are arguments
(`Frozen`), never closed over. `summarise` turns the per-depth sums into the reported loss and
top-1 agreement, exactly across batches.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec.cache import KVCache
from jaxspec.models import eagle3, mtp
from jaxspec.models.draft_chain import DraftChain
from jaxspec.pallas import kv_quant
from jaxspec.train.config import Method, StepSpec, optimizer
from jaxspec.train.heads import Frozen, HeadParams, trainable_params


# ----------------------------------------------------------------------------------------------
# The loss: the unrolled head over the target's half of a batch
# ----------------------------------------------------------------------------------------------

def _shift_left(x: jax.Array) -> jax.Array:
    """x[:, p + 1] at p; the last position gets zeros (it is masked wherever it matters)."""
    return jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)


def _head_step(spec: StepSpec, params: HeadParams, frozen: Frozen, tokens: jax.Array, g: jax.Array,
               cache: KVCache, positions: jax.Array) -> tuple[jax.Array, jax.Array, KVCache]:
    """One head forward over every position of the batch: logits [B, T, Vd], g_next [B, T, D], and
    the cache (a fresh one at depth 0; the chains' `DraftChain`s at deeper steps)."""
    if spec.train.method is Method.EAGLE3:
        return eagle3.forward(params, spec.head_cfg, frozen["embed"], tokens, g, cache, positions=positions)
    return mtp.forward(params, spec.head_cfg, frozen["embed"], frozen["lm_head"], tokens, g, cache,
                       positions=positions)


def _fresh_cache(spec: StepSpec, batch: int, seq_len: int) -> KVCache:
    module = eagle3 if spec.train.method is Method.EAGLE3 else mtp
    return module.create_cache(spec.head_cfg, batch, seq_len)


def _from_depth(x: jax.Array, depth: jax.Array, max_depth: int) -> jax.Array:
    """x[:, c + depth] at c (x [B, T, ...]); zeros (False) past the end. `depth` may be traced."""
    pad = [(0, 0), (0, max_depth)] + [(0, 0)] * (x.ndim - 2)
    return jax.lax.dynamic_slice_in_dim(jnp.pad(x, pad), depth, x.shape[1], axis=1)


def agrees_with_target(logits: jax.Array, label_draft: jax.Array) -> jax.Array:
    """bool[B, T]: the head's greedy draft is the target's token. logits [B, T, Vd]; label_draft
    int32[B, T], the target's token as a draft id (-1: outside the draft vocabulary, never agrees).

    The label's logit against the largest: one max over the draft vocabulary, where an argmax is
    a paired value-index reduction, a sizeable share of a training step on XLA CPU. An exact tie
    with another logit counts as agreement, where an argmax would pick the lower id."""
    label_logit = jnp.take_along_axis(logits, jnp.maximum(label_draft, 0)[..., None], axis=-1)[..., 0]
    return (label_draft >= 0) & (label_logit >= jnp.max(logits, axis=-1))


def in_compute_dtype(params: HeadParams, frozen: Frozen, compute_dtype: str) -> tuple[HeadParams, Frozen]:
    """The weights a step multiplies by, in the run's compute dtype: with "bfloat16" the head's
    matrices and MTP's frozen lm_head (the products; quant.matmul then casts activations at each
    product and accumulates in float32, forward and backward). Norm weights (1-D) stay float32,
    and so do the activations between products, the logits and the loss. The cast is inside the
    differentiated function, so the gradient reaches the float32 master params."""
    if compute_dtype == "float32":
        return params, frozen

    def cast(leaf):
        floating = leaf is not None and jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.ndim >= 2
        return leaf.astype(jnp.bfloat16) if floating else leaf

    frozen = {**frozen, "lm_head": jax.tree.map(cast, frozen["lm_head"])} if "lm_head" in frozen else frozen
    return jax.tree.map(cast, params), frozen


def _loss_terms(params: HeadParams, frozen: Frozen, targets: dict[str, Any], spec: StepSpec) -> dict[str, jax.Array]:
    """Per unrolled step j: summed cross-entropy and its position count, and top-1 agreement with
    the target (correct, out of all response positions the step can reach). All float32[J].
    `targets` is `target_batch`'s output; where it also holds `subsets` ({name: bool[B, T]},
    aligned with the loss mask, as validation adds them: e.g. "new", the positions whose next
    token a prompt lookup does not propose), the agreement is also counted within each
    ({name}_correct, {name}_scored). A training step has none, so its program is unchanged."""
    params, frozen = in_compute_dtype(params, frozen, spec.train.compute_dtype)
    tokens = targets["tokens"]  # int32[B, T]
    features = targets["features"]

    # Head slot p pairs (feature p, token p + 1) and drafts token p + 2: the target's prediction at p + 1.
    tokens_in = _shift_left(tokens)  # [B, T]
    label_target = _shift_left(targets["labels"])  # [B, T]
    responds = _shift_left(targets["loss_mask"])  # bool[B, T]
    subsets = {name: _shift_left(mask) for name, mask in targets.get("subsets", {}).items()}  # each bool[B, T]
    label_draft = jnp.take(frozen["target_to_draft"], label_target)  # [B, T]; -1: not draftable
    if spec.train.soft_labels:
        label_probs = _shift_left(targets["label_probs"])  # [B, T, Vd]
        trainable = responds
    else:
        trainable = responds & (label_draft >= 0)

    if spec.train.method is Method.EAGLE3:
        g = eagle3.encode(params, features)  # [B, T, D]
    else:
        g = features[0]  # the target's final-normed hidden
    max_depth = spec.train.ttt_steps - 1

    def terms_at(depth, logits):
        """Depth j's loss and agreement: chain start c drafts the token the target predicts at
        slot c + j (labels and masks read j positions on; none past the end)."""
        label = _from_depth(label_draft, depth, max_depth)
        scored = _from_depth(responds, depth, max_depth)
        mask = _from_depth(trainable, depth, max_depth)
        if spec.train.soft_labels:
            ce = optax.softmax_cross_entropy(logits, _from_depth(label_probs, depth, max_depth))
        else:
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(label, 0))
        agrees = agrees_with_target(logits, label)
        terms = {"ce_sum": jnp.sum(jnp.where(mask, ce, 0.0)), "count": jnp.sum(mask).astype(jnp.float32),
                 "correct": jnp.sum(agrees & scored).astype(jnp.float32), "scored": jnp.sum(scored).astype(jnp.float32)}
        for name, subset in subsets.items():
            counted = scored & _from_depth(subset, depth, max_depth)
            terms |= {f"{name}_correct": jnp.sum(agrees & counted).astype(jnp.float32),
                      f"{name}_scored": jnp.sum(counted).astype(jnp.float32)}
        return terms

    return unrolled(spec, params, frozen, tokens_in, g, terms_at)  # each float32[J]


def unrolled(spec: StepSpec, params: HeadParams, frozen: Frozen, tokens_in: jax.Array, g: jax.Array, per_depth):
    """The training-time test: `per_depth(depth, logits)` of every unrolled depth, stacked [J, ...].

    tokens_in int32[B, T]: the token after each position (head slot p pairs feature p with token
    p + 1); g [B, T, D]: the head's input at depth 0 (encoded target features). Depth j runs every
    chain start c at once: slot c + j's token, the head's own g_next of depth j - 1 at the same
    start, RoPE position c + j, attending to the depth-0 context of starts <= c and to its own
    chain (jaxspec.models.draft_chain), as a chain drafted after position c runs it at inference.
    Its logits [B, T, Vd] at c draft the token at slot c + j + 2."""
    batch, seq_len = tokens_in.shape
    max_depth = spec.train.ttt_steps - 1
    starts = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32)[None, :], (batch, seq_len))  # [B, T]

    # Depth 0: the head over the target's features, causally, as it absorbs committed positions.
    logits, g, cache = _head_step(spec, params, frozen, tokens_in, g, _fresh_cache(spec, batch, seq_len), starts)
    first = jax.tree.map(lambda x: x[None], per_depth(0, logits))
    if max_depth == 0:
        return first
    chains = cache.replace(keys=(DraftChain.start(kv_quant.dequantize(cache.keys[0]), max_depth),),
                           values=(DraftChain.start(kv_quant.dequantize(cache.values[0]), max_depth),))

    def depth_step(carry, depth):
        g, chains = carry
        chains = chains.replace(keys=(chains.keys[0].at_depth(depth),), values=(chains.values[0].at_depth(depth),))
        logits, g_next, chains = _head_step(spec, params, frozen, _from_depth(tokens_in, depth, max_depth), g,
                                            chains, starts + depth)
        return (g_next, chains), per_depth(depth, logits)

    _, deeper = jax.lax.scan(depth_step, (g, chains), jnp.arange(1, max_depth + 1))
    return jax.tree.map(lambda head, rest: jnp.concatenate([head, rest]), first, deeper)


def _weighted_loss(terms: dict[str, jax.Array], step_decay: float) -> jax.Array:
    weights = step_decay ** jnp.arange(terms["ce_sum"].shape[0], dtype=jnp.float32)
    return jnp.sum(weights * terms["ce_sum"] / jnp.maximum(terms["count"], 1.0))


# ----------------------------------------------------------------------------------------------
# Steps (jitted once per static spec; the target's params are arguments, never closed over)
# ----------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("params", "opt_state"))
def train_step(params: HeadParams, opt_state: Any, frozen: Frozen, targets: dict[str, Any], *, spec: StepSpec):
    """One optimizer step on the weighted loss of a batch: (params, opt_state, metrics), the
    metrics being loss, grad_norm and the per-depth terms. `params` and `opt_state` are donated."""

    def loss_of(trainable):
        terms = _loss_terms(trainable, frozen, targets, spec)
        return _weighted_loss(terms, spec.train.step_decay), terms

    (loss, terms), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    updates, opt_state = optimizer(spec.train).update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **terms}


@functools.partial(jax.jit, static_argnames=("spec",))
def _eval_step(params: HeadParams, frozen: Frozen, targets: dict[str, Any], *, spec: StepSpec):
    return _loss_terms(params, frozen, targets, spec)


def summarise(terms: dict[str, np.ndarray], step_decay: float) -> dict[str, Any]:
    """loss (the training objective), top1 (the first draft's agreement with the target) and
    top1_by_step (agreement at each unrolled depth); for each subset of positions counted apart
    (`_loss_terms`), top1_{name}, top1_{name}_by_step and {name}_share (its part of the positions)."""
    weights = step_decay ** np.arange(len(terms["ce_sum"]))
    loss = float(np.sum(weights * terms["ce_sum"] / np.maximum(terms["count"], 1.0)))
    top1 = terms["correct"] / np.maximum(terms["scored"], 1.0)
    summary = {"loss": loss, "top1": float(top1[0]), "top1_by_step": [float(t) for t in top1]}
    for name in [key[: -len("_scored")] for key in terms if key.endswith("_scored") and key != "scored"]:
        within = terms[f"{name}_correct"] / np.maximum(terms[f"{name}_scored"], 1.0)
        summary |= {f"top1_{name}": float(within[0]), f"top1_{name}_by_step": [float(t) for t in within],
                    f"{name}_share": float(terms[f"{name}_scored"][0] / max(float(terms["scored"][0]), 1.0))}
    return summary


def evaluate(params: HeadParams, frozen: Frozen, batches: Sequence[tuple[np.ndarray, int]], targets_for,
             spec: StepSpec) -> dict[str, Any]:
    """Loss and top-1 agreement over `batches` ((row indices, width) each, as
    `data.length_batches` makes them: -1 an empty row), summed exactly across batches.
    `targets_for(indices, width)` gives the target's half of a batch (see `target_source`)."""
    totals: dict[str, np.ndarray] | None = None
    for indices, width in batches:
        targets = targets_for(np.asarray(indices), width)
        terms = jax.device_get(_eval_step(trainable_params(params), frozen, targets, spec=spec))
        totals = terms if totals is None else {name: totals[name] + terms[name] for name in totals}
    return summarise(totals, spec.train.step_decay)
