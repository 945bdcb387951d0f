"""The self-consistent toy the head-training test modules share (each module wraps
`distilled_toy` in its own module-scoped `toy` fixture).

A target whose next token is a fixed function of the current one, (t + 1) mod 64. A head trained
on that target's own answers must learn the rule, so it should draft nearly every token: tau close
to k + 1, and speculative output == plain greedy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec import train
from jaxspec.config import ModelConfig
from jaxspec.models import llama

# TINY's shapes, no EOS: every answer runs to its full length.
TOY = ModelConfig(vocab_size=128, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=96,
                  rotary_dim=16, max_position_embeddings=256)
CYCLE = 64  # the toy's next token is (t + 1) mod CYCLE, whatever the context
ANSWER = 20
SEQ_LEN = 24


def successor_target() -> jaxspec.Model:
    """Attention and MLP outputs zeroed, so the residual stream is the token's embedding; the
    lm_head row of (t + 1) mod 64 is t's embedding, so greedy decoding counts up modulo 64.
    Drawn with numpy: jax.random would compile for longer than the whole training run."""
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda key: llama.init_params(TOY, key), jax.random.PRNGKey(0))
    params = jax.tree.map(lambda leaf: (0.2 * rng.standard_normal(leaf.shape)).astype(np.float32), shapes)
    ones = np.ones(TOY.dim, np.float32)
    layers = tuple(
        dataclasses.replace(
            layer, attn_norm=ones, mlp_norm=ones,
            attention=dataclasses.replace(layer.attention, o_proj=np.zeros_like(layer.attention.o_proj)),
            mlp=dataclasses.replace(layer.mlp, down_proj=np.zeros_like(layer.mlp.down_proj)))
        for layer in params.layers)
    embed = rng.standard_normal((TOY.vocab_size, TOY.dim)).astype(np.float32)
    successor = (np.arange(TOY.vocab_size) + 1) % CYCLE
    lm_head = np.zeros_like(embed)
    np.add.at(lm_head, successor, embed)
    params = dataclasses.replace(params, layers=layers, final_norm=ones, embed=embed, lm_head=lm_head)
    return jaxspec.Model(config=TOY, params=jax.tree.map(jnp.asarray, params))


def distilled_toy():
    """(target, prompts, the target's greedy answers as Examples, those packed into a Dataset)."""
    target = successor_target()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TOY.vocab_size, rng.integers(3, 9)).tolist() for _ in range(40)]
    examples = train.self_distill(target, prompts, ANSWER, batch_size=len(prompts))
    return target, prompts, examples, train.pack(examples, SEQ_LEN)
