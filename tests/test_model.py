"""jaxspec.model: a layer-skip draft is its target's first layers, final norm and head, sharing
the target's arrays; `lm_head_of` is the projection a trunk's logits come from (its embedding
when tied). Checked through forwards, not through the params' layout."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import models
from jaxspec.model import Model, layer_skip, lm_head_of
from jaxspec.models import llama
from tests.conftest import TINY

THREE_LAYERS = dataclasses.replace(TINY, num_layers=3)
TOKENS = jnp.array([[5, 17, 3, 99], [0, 64, 64, 127]], jnp.int32)  # [B, T]


def run(model: Model, hidden_layers: tuple[int, ...]):
    """Logits [B, T, V] and the asked hiddens of `model` over TOKENS, from an empty cache."""
    cache = models.create_cache(model.config, TOKENS.shape[0], 8)
    logits, hiddens, _ = models.forward(model.params, model.config, TOKENS, cache, hidden_layers=hidden_layers)
    return logits, hiddens


@pytest.fixture(scope="module")
def target() -> Model:
    params = llama.init_params(THREE_LAYERS, jax.random.PRNGKey(3), scale=0.2)
    return Model(config=THREE_LAYERS, params=params, source="three-layer test trunk")


@pytest.mark.parametrize("exit_layer", [1, 2, np.int64(2)])
def test_layer_skip_keeps_the_first_layers_then_the_targets_norm_and_head(target, exit_layer):
    draft = layer_skip(target, exit_layer)
    assert draft.exit_layer == exit_layer and type(draft.exit_layer) is int
    assert draft.config == dataclasses.replace(target.config, num_layers=exit_layer)
    assert draft.tokenizer is target.tokenizer and "exit_layer=" in draft.source
    last = exit_layer - 1
    _, (target_stream,) = run(target, (last,))
    draft_logits, (draft_stream, draft_normed) = run(draft, (last, exit_layer))
    # The draft's last layer is the target's layer `last`, fed by the same layers before it...
    chex.assert_trees_all_equal(draft_stream, target_stream)
    # ...and its logits come from the target's own head (final norm shared: see the next test).
    chex.assert_trees_all_close(draft_logits, jnp.einsum("btd,vd->btv", draft_normed, lm_head_of(target)),
                                rtol=1e-5, atol=1e-5)


def test_layer_skip_shares_the_targets_arrays(target):
    draft = layer_skip(target, 1)
    target_leaves = {id(leaf) for leaf in jax.tree.leaves(target.params)}
    draft_leaves = jax.tree.leaves(draft.params)
    assert all(id(leaf) in target_leaves for leaf in draft_leaves), "a layer-skip draft must not copy weights"
    assert 0 < len(draft_leaves) < len(target_leaves)
    assert lm_head_of(draft) is lm_head_of(target)
    assert target.exit_layer is None and target.config.num_layers == 3  # the target is left as it was


@pytest.mark.parametrize("exit_layer", [
    0, 3, -1, 1.0, "1", None, True,  # True: a bool is an int subclass, and still no layer count
])
def test_layer_skip_refuses_an_exit_layer_outside_the_trunk(target, exit_layer):
    with pytest.raises(jaxspec.InvalidRequestError, match=r"exit_layer must be an integer in \[1, 3\)"):
        layer_skip(target, exit_layer)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_lm_head_of_is_what_the_logits_are_read_through(tied):
    config = dataclasses.replace(TINY, tie_embeddings=tied)
    model = Model(config=config, params=llama.init_params(config, jax.random.PRNGKey(4), scale=0.2))
    head = lm_head_of(model)
    chex.assert_shape(head, (config.vocab_size, config.dim))
    logits, (embedded, normed) = run(model, (-1, config.num_layers))
    chex.assert_trees_all_close(logits, jnp.einsum("btd,vd->btv", normed, head), rtol=1e-5, atol=1e-5)
    # Tied, the head's rows are the embedding the tokens entered through; untied, they are not.
    assert np.array_equal(np.asarray(head[TOKENS]), np.asarray(embedded)) == tied
