"""bench/head_agreement.py's counts, against the drafting path itself: a head's teacher-forced
agreement at a slot is what the EAGLE-3 proposer drafts after absorbing that prefix, compared with
the target's greedy token after it; the scored and new-text positions are the row's assistant
tokens and those a 3-gram lookup does not propose, counted here by hand. And the prompt sample
takes the sources in turn."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import checkpoints
from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.models import eagle3, llama
from jaxspec.spec.drafters.eagle3 import Eagle3
from jaxspec.train.data import Dataset
from tests.conftest import load_bench_script

# The target's forward jitted once (eager, each op compiles alone: ~300 compiles for the test).
_forward = jax.jit(llama.forward, static_argnums=1, static_argnames=("hidden_layers",))

TARGET = ModelConfig(vocab_size=96, dim=48, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=12,
                     ffn_dim=80, rotary_dim=12, max_position_embeddings=256, eos_token_ids=(3,))
HEAD = eagle3.Eagle3Config(dim=48, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=64, draft_vocab_size=40,
                           vocab_size=96, rope_theta=50000.0, rotary_dim=8, norm_eps=1e-5,
                           max_position_embeddings=256, aux_layer_ids=(1, 2, 3))
WIDTH = 64  # the bench pads rows to a multiple of 64


@pytest.fixture(scope="module")
def script():
    return load_bench_script("head_agreement")


@pytest.fixture(scope="module")
def heads_script():
    return load_bench_script("heads")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = jaxspec.Model(config=TARGET, params=llama.init_params(TARGET, jax.random.PRNGKey(0), scale=0.2))
    directory = tmp_path_factory.mktemp("head")
    checkpoints.save_eagle3(directory, HEAD, eagle3.init_params(HEAD, jax.random.PRNGKey(1), scale=0.2))
    return target, jaxspec.load(str(directory))


def _rows() -> Dataset:
    """Two rows: a one-turn answer that falls into a loop and ends inside it (a lookup proposes
    its last 15 tokens, so reading the lookup one position off changes the count), and a two-turn
    conversation whose user turn sits between the answers."""
    rng = np.random.default_rng(0)
    first = [5, 6, 7, 8, 9] + [20, 21, 22, 23, 24, 25] * 4
    second = rng.integers(4, 96, 40).tolist()
    tokens = np.zeros((2, 40), np.int32)
    tokens[0, : len(first)], tokens[1] = first, second
    assistant = np.zeros((2, 40), bool)
    assistant[0, 5: len(first)] = True
    assistant[1, 6:18] = assistant[1, 25:40] = True  # turns 1 and 2; tokens 18-24 the user's
    return Dataset(tokens, np.asarray([len(first), 40], np.int32), np.asarray([5, 6], np.int32), assistant)


def _lookup_proposes(row: list[int], q: int) -> bool:
    """A 3-gram lookup over row[:q] proposes row[q]: the token after the last earlier occurrence
    of row[q-3:q]."""
    if q < 3:
        return False
    context = row[q - 3: q]
    for start in range(q - 4, -1, -1):
        if row[start: start + 3] == context:
            return row[start + 3] == row[q]
    return False


def test_agreement_counts_are_the_proposers_drafts_after_each_prefix(script, models):
    target, head = models
    data = _rows()
    counts = script.agreement_by_row(target, head, data, batch_size=1)
    positions = script.depth0_positions(target, head, data, batch_size=1)

    aux = HEAD.resolved_aux_layers(TARGET.num_layers)
    proposer = Eagle3(num_draft=1, config=HEAD, aux_layer_ids=aux)
    draft_params = {"head": head.params, "embed": target.params.embed}
    absorb = jax.jit(proposer._absorb)
    expected = np.zeros_like(counts)
    confidence = []
    for r in range(len(data)):
        row = data.tokens[r, : data.lengths[r]].tolist()
        padded = jnp.asarray([row + [0] * (WIDTH - len(row))])
        logits, features, _ = _forward(target.params, TARGET, padded, KVCache.create(TARGET, 1, WIDTH),
                                       hidden_layers=eagle3.target_hidden_layers(aux))
        greedy = np.asarray(jnp.argmax(logits[0], axis=-1))  # [W]: the target's token after each prefix
        probs = np.asarray(jax.nn.softmax(logits[0], axis=-1))  # [W, V]
        shifted = jnp.concatenate([padded[:, 1:], jnp.zeros((1, 1), jnp.int32)], axis=1)
        for q in range(2, len(row)):  # the draft of token q, after absorbing the prefix row[:q]
            if not data.assistant[r, q]:
                continue
            state = absorb(draft_params, eagle3.create_cache(HEAD, 1, WIDTH), shifted, features, jnp.array([q - 1]))
            drafted = int(proposer._to_target(draft_params, jnp.argmax(state.next_logits, axis=-1))[0])
            agrees = drafted == int(greedy[q - 1])
            new = not _lookup_proposes(row, q)
            expected[r] += [agrees, 1, agrees and new, new]
            confidence.append(probs[q - 1, greedy[q - 1]])
    np.testing.assert_array_equal(counts, expected)
    np.testing.assert_allclose(positions.confidence, confidence, rtol=1e-5)
    assert expected[:, 1].tolist() == [int(data.assistant[0].sum()), int(data.assistant[1].sum())]
    assert expected[0, 3] == expected[0, 1] - 15  # the loop's last 15 tokens are a lookup's
    assert expected[:, 0].sum() > 0  # some drafts agree: the counts compare more than zeros


def test_agreement_by_confidence_bins_the_slots_and_splits_lookup_from_new_text(script):
    # 6 slots: confidences in bins 0-0.5 (2), 0.5-0.9 (1), 0.9-0.99 (0) and 0.99-1 (3, 1.0 included).
    positions = script.Depth0Positions(row=np.zeros(6, int),
                                       agrees=np.array([True, False, True, True, False, True]),
                                       new=np.array([True, True, False, False, True, True]),
                                       confidence=np.array([0.1, 0.49999, 0.5, 0.995, 1.0, 0.99]))
    bins = script.agreement_by_confidence(positions)
    assert [(b["low"], b["high"]) for b in bins] == [(0.0, 0.5), (0.5, 0.9), (0.9, 0.99), (0.99, 1.0)]
    assert [b["share"] for b in bins] == pytest.approx([2 / 6, 1 / 6, 0, 3 / 6])
    assert [b["agreement"] for b in bins] == pytest.approx([0.5, 1.0, None, 2 / 3])
    assert bins[3]["lookup_share"] == pytest.approx(1 / 6) and bins[3]["lookup_agreement"] == 1.0
    assert bins[3]["new_agreement"] == pytest.approx(0.5)
    assert bins[1]["new_agreement"] is None and bins[2]["agreement"] is None
    counts = script.row_counts(script.Depth0Positions(row=np.array([0, 1, 1]), agrees=np.array([True, True, False]),
                                                      new=np.array([False, True, True]),
                                                      confidence=np.ones(3)), 3)
    np.testing.assert_array_equal(counts, [[1, 1, 0, 0], [1, 2, 1, 2], [0, 0, 0, 0]])


def test_prompts_are_drawn_from_each_source_in_turn(script):
    sources = ["magpie"] * 10 + ["math"] * 3 + ["topic"] * 1
    rows = np.arange(14)
    chosen = script.sample_by_source(rows, sources, 6, seed=0)
    assert len(set(chosen)) == 6
    assert sorted(sources[i] for i in chosen[:3]) == ["magpie", "math", "topic"]
    assert [sources[i] for i in chosen].count("topic") == 1  # a source that runs out is skipped
    assert chosen == script.sample_by_source(rows, sources, 6, seed=0)
    assert chosen != script.sample_by_source(rows, sources, 6, seed=1)
    assert len(script.sample_by_source(rows, sources, 99, seed=0)) == 14


def test_undraftable_share_counts_the_tokens_outside_the_draft_vocabulary(heads_script):
    """bench/heads.py's ceiling: a token counts when no draft id maps to it (d2t), for every row."""
    params = eagle3.init_params(HEAD, jax.random.PRNGKey(4))
    draftable = set(np.asarray(eagle3.to_target_ids(params, jnp.arange(HEAD.draft_vocab_size))).tolist())
    outside = [t for t in range(HEAD.vocab_size) if t not in draftable]
    inside = sorted(draftable)
    rows = [[inside[0], outside[0], inside[1]], [outside[1], outside[2]]]  # 3 of 5 outside
    head = jaxspec.Model(config=HEAD, params=params)
    assert heads_script.undraftable_share(head, rows) == pytest.approx(3 / 5)
    assert heads_script.undraftable_share(head, [inside]) == 0.0
    assert heads_script.undraftable_share(jaxspec.Model(config=HEAD, params=params.replace(d2t=None)), rows) is None
