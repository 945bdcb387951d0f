"""The training-time test is the drafting the heads do at inference, position for position.

`objective.unrolled` runs depth j of every chain start at once; here each (start, depth) is
rebuilt the way the engine drafts it: the head absorbs the context through its KV cache
(`eagle3.forward` / `mtp.forward` on the cached path), then runs its chain one step at a time
on its own output. The logits must agree (float32, within 1e-5 of their scale).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.models import eagle3, mtp
from jaxspec.train import objective
from jaxspec.train.config import Method, StepSpec, TrainConfig

VOCAB, DIM, BATCH, STEPS, TTT = 48, 32, 2, 9, 4
EAGLE = eagle3.Eagle3Config(dim=DIM, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=48, draft_vocab_size=40,
                            vocab_size=VOCAB, rope_theta=10000.0, rotary_dim=8, norm_eps=1e-6,
                            max_position_embeddings=64)
MTP = mtp.MtpConfig(block=ModelConfig(vocab_size=VOCAB, dim=DIM, num_layers=1, num_heads=2, num_kv_heads=1,
                                      head_dim=16, ffn_dim=48, rotary_dim=16, qk_norm=True), hidden_first=True)


def _head(method: Method):
    """(spec, params, frozen, first-depth input g [B, T, D]) of a random head."""
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    frozen = {"embed": jax.random.normal(keys[0], (VOCAB, DIM))}
    if method is Method.EAGLE3:
        cfg, params = EAGLE, eagle3.init_params(EAGLE, keys[1], scale=0.3)
        aux = tuple(jax.random.normal(k, (BATCH, STEPS, DIM)) for k in jax.random.split(keys[2], 3))
        g = eagle3.encode(params, aux)
    else:
        cfg, params = MTP, mtp.init_params(MTP, keys[1], scale=0.3)
        frozen["lm_head"] = jax.random.normal(keys[3], (VOCAB, DIM))
        g = jax.random.normal(keys[2], (BATCH, STEPS, DIM))
    spec = StepSpec(train=TrainConfig(method=method, ttt_steps=TTT), target_cfg=None, head_cfg=cfg,
                    hidden_layers=())
    return spec, params, frozen, g


@functools.partial(jax.jit, static_argnums=0)
def _forward(spec, params, frozen, tokens, g, cache):
    if spec.train.method is Method.EAGLE3:
        return eagle3.forward(params, spec.head_cfg, frozen["embed"], tokens, g, cache)
    return mtp.forward(params, spec.head_cfg, frozen["embed"], frozen["lm_head"], tokens, g, cache)


def _drafted_at_inference(spec, params, frozen, tokens_in, g) -> dict[tuple[int, int], np.ndarray]:
    """Logits [B, V] of each (start, depth): the chain drafted after position `start` as the
    engine runs it, slots 0..start absorbed from the features (one forward over the whole
    sequence, the cache then cut back to start + 1: the causal rule keeps later slots out of
    earlier ones), then one cached step per depth on the head's own output, fed the true tokens
    (a deeper draft only counts when the earlier ones matched)."""
    module = eagle3 if spec.train.method is Method.EAGLE3 else mtp
    absorbed_logits, absorbed_g, absorbed = _forward(spec, params, frozen, tokens_in, g,
                                                     module.create_cache(spec.head_cfg, BATCH, STEPS + TTT))
    drafted = {}
    for start in range(STEPS):
        cache = absorbed.set_length(jnp.full((BATCH,), start + 1, jnp.int32))
        drafted[start, 0] = np.asarray(absorbed_logits[:, start])
        g_prev = absorbed_g[:, start:start + 1]
        for depth in range(1, min(TTT, STEPS - start)):
            logits, g_prev, cache = _forward(spec, params, frozen, tokens_in[:, start + depth:start + depth + 1],
                                             g_prev, cache)
            cache = cache.advance(jnp.ones((BATCH,), jnp.int32))
            drafted[start, depth] = np.asarray(logits[:, 0])
    return drafted


@pytest.mark.parametrize("method", [Method.EAGLE3, Method.MTP])
def test_every_unrolled_depth_is_the_chain_inference_drafts(method):
    spec, params, frozen, g = _head(method)
    tokens_in = jax.random.randint(jax.random.PRNGKey(7), (BATCH, STEPS), 0, VOCAB)
    unrolled = jax.jit(functools.partial(objective.unrolled, spec, per_depth=lambda depth, logits: logits))
    trained = np.asarray(unrolled(params, frozen, tokens_in, g))  # [J, B, T, V]
    assert trained.shape[:3] == (TTT, BATCH, STEPS)
    drafted = _drafted_at_inference(spec, params, frozen, tokens_in, g)
    assert len(drafted) == sum(min(TTT, STEPS - start) for start in range(STEPS))
    for (start, depth), logits in drafted.items():
        # float32 within 1e-5 of the logits' scale (random weights make them ~10)
        np.testing.assert_allclose(trained[depth, :, start], logits, rtol=1e-5, atol=1e-5 * np.abs(logits).max(),
                                   err_msg=f"start {start}, depth {depth}")
    # The deeper depths read the head's own chain, not the context: they are not depth 0 again.
    assert np.abs(trained[1, :, :-1] - trained[0, :, 1:]).max() > 1e-2


def test_chain_attention_in_query_blocks_is_the_whole_attention():
    """The context's causal attention runs a block of queries at a time over the entries the block
    can reach; in blocks of 4 (T = 9: a short last block) it equals one block of all T, values and
    gradients, at every depth."""
    from jaxspec.models.draft_chain import DraftChain, chain_attention

    batch, heads, group, head_dim, depths = 2, 2, 3, 8, 3
    keys = jax.random.split(jax.random.PRNGKey(5), 5)
    q = jax.random.normal(keys[0], (batch, STEPS, heads, group, head_dim))
    context = [jax.random.normal(k, (batch, heads, STEPS, head_dim)) for k in keys[1:3]]
    deeper = [jax.random.normal(k, (depths, batch, heads, STEPS, head_dim)) for k in keys[3:5]]

    def loss(q, context, deeper, depth, query_block):
        chains = [DraftChain(context=c, deeper=d, depth=depth) for c, d in zip(context, deeper)]
        out = chain_attention(q, *chains, query_block=query_block)
        return jnp.sum(jnp.sin(out)), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=4)  # depth traced
    for depth in range(1, depths + 1):
        (blocked_grads, blocked), (whole_grads, whole) = (grad(q, context, deeper, jnp.int32(depth), block)
                                                          for block in (4, STEPS))
        np.testing.assert_allclose(blocked, whole, rtol=1e-5, atol=1e-6)
        for ours, theirs in zip(jax.tree.leaves(blocked_grads), jax.tree.leaves(whole_grads)):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_agreement_is_also_counted_within_each_subset_of_positions_validation_names():
    """With subsets of positions in the targets (validation adds them, aligned with the loss mask:
    "new", where a prompt lookup proposes nothing), the agreement is also counted within each; the
    loss and the overall counts are unchanged. A subset of no loss position counts nothing at any
    depth, one of every loss position counts them all: a mask read one position off would count
    some in the first and miss some in the second."""
    spec, params, frozen, _ = _head(Method.EAGLE3)
    keys = jax.random.split(jax.random.PRNGKey(11), 4)
    frozen = {**frozen, "target_to_draft": jnp.where(jnp.arange(VOCAB) < EAGLE.draft_vocab_size,
                                                     jnp.arange(VOCAB), -1)}
    loss_mask = jnp.arange(STEPS)[None, :] >= jnp.asarray([[2], [4]])  # bool[B, T]: responses after a prompt
    targets = {"tokens": jax.random.randint(keys[0], (BATCH, STEPS), 0, VOCAB),
               "features": tuple(jax.random.normal(k, (BATCH, STEPS, DIM)) for k in jax.random.split(keys[1], 3)),
               "labels": jax.random.randint(keys[2], (BATCH, STEPS), 0, VOCAB), "loss_mask": loss_mask}
    terms = jax.jit(objective._loss_terms, static_argnums=3)
    plain = terms(params, frozen, targets, spec)
    assert "new_scored" not in plain  # training steps carry no such terms
    every = terms(params, frozen, {**targets, "subsets": {"new": ~loss_mask}}, spec)  # every loss position repeats
    none = terms(params, frozen, {**targets, "subsets": {"new": loss_mask}}, spec)
    some = terms(params, frozen, {**targets, "subsets": {"new": jax.random.bernoulli(keys[3], 0.5, (BATCH, STEPS)),
                                                          "all": jnp.ones((BATCH, STEPS), bool)}}, spec)
    for counted in (every, none, some):
        for name in ("ce_sum", "count", "correct", "scored"):
            np.testing.assert_array_equal(counted[name], plain[name])
    assert np.all(plain["scored"] > 0) and np.all(every["new_scored"] == 0) and np.all(every["new_correct"] == 0)
    np.testing.assert_array_equal(none["new_scored"], plain["scored"])
    np.testing.assert_array_equal(none["new_correct"], plain["correct"])
    assert 0 < some["new_scored"][0] < plain["scored"][0]
    np.testing.assert_array_equal(some["all_scored"], plain["scored"])  # subsets are counted each on its own
    summary = objective.summarise(jax.device_get(some), step_decay=0.8)
    assert summary["new_share"] == pytest.approx(float(some["new_scored"][0] / plain["scored"][0]))
    assert len(summary["top1_new_by_step"]) == TTT
    assert summary["all_share"] == 1.0 and summary["top1_all"] == summary["top1"]
