"""Lookup-first drafting (`lookup_first=n`, jaxspec.spec.lookup_first): prompt lookup's drafts in
rows whose context repeats its last n tokens, the model drafter's elsewhere.

The selection itself against a stand-in drafter (which rows, which q) and the graft of a chain
onto a tree (what it follows, which nodes it takes); then greedy output equals plain greedy for
each drafter that can stand behind a lookup (EAGLE-3 chains and trees, MTP, the shared-KV
assistant), through the CLI too; sampled chains and trees are lossless against exact
enumeration, and a selection that keeps the head's q for the lookup's drafts fails that same
test. Requests the pairing cannot serve are refused before anything compiles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import checkpoints
from jaxspec.errors import InvalidRequestError
from jaxspec.models import eagle3
from jaxspec.spec import lookup_first
from jaxspec.spec import tree as tree_lib
from jaxspec.spec.drafters.ngram import PromptLookup
from jaxspec.spec.proposers import Context, Proposal
from tests.conftest import assert_plain_greedy
from tests.test_assistant import small as small_gemma  # noqa: F401 (fixture)
from tests.test_cli import assert_one_line_error, run, stats_lines, tiny, tiny_cache  # noqa: F401 (fixtures)
from tests.test_eagle3 import HEAD
from tests.test_spec import PROMPTS
from tests.test_spec_sampling import (SIGNIFICANCE, assert_broken_run_detected, chi_square_p_value,
                                      exact_joint, sampled_joint, small_eagle3_head)
from tests.test_spec_sampling import target as small_target  # noqa: F401 (fixture)
from tests.test_spec_tree import BUSHY, NEW_TOKENS, assert_tree_stats, eagle3_head, mtp_head  # noqa: F401

VOCAB = 12


@dataclasses.dataclass(frozen=True, kw_only=True)
class FixedDrafter:
    """A stand-in model drafter: drafts 7, 8, 9 from a fixed q every round; counts its updates."""

    num_draft: int = 3
    tree: None = None
    name: str = "fixed"
    target_hidden_layers: tuple[int, ...] = ()
    can_abstain: bool = False
    context_limit: None = None

    def draft_inputs(self, target_params, draft_model_params):
        return None

    def init(self, draft_params, prefill, capacity):
        return jnp.zeros((), jnp.int32)

    def update(self, draft_params, state, verified):
        return state + 1

    def probs(self, batch: int) -> jax.Array:  # [B, k, V]
        return jnp.broadcast_to(jax.nn.softmax(jnp.arange(VOCAB, dtype=jnp.float32)), (batch, self.num_draft, VOCAB))

    def propose(self, draft_params, state, context):
        batch = context.tokens.shape[0]
        drafts = jnp.broadcast_to(jnp.array([7, 8, 9], jnp.int32), (batch, 3))
        return Proposal(drafts=drafts, num_proposed=jnp.full((batch,), 3, jnp.int32), probs=self.probs(batch)), state


def test_rows_with_a_match_draft_the_lookup_and_the_rest_the_model():
    proposer = lookup_first.LookupFirst(lookup=PromptLookup(num_draft=3, ngram_min=2), model=FixedDrafter())
    tokens = jnp.array([[1, 2, 3, 4, 1, 2, 0, 0],  # "1 2" occurred at 0: its three followers
                        [5, 6, 7, 8, 9, 10, 0, 0],  # nothing repeats: the model's drafts
                        [3, 1, 2, 1, 2, 0, 0, 0],  # "1 2" at 1 is followed by two context tokens only
                        [4, 5, 4, 0, 0, 0, 0, 0]])  # only a 1-gram repeats: below n = 2, the model's
    context = Context(tokens=tokens, length=jnp.array([6, 6, 5, 3]))
    proposal, state = jax.jit(proposer.propose)(None, jnp.int32(5), context)
    np.testing.assert_array_equal(proposal.drafts, [[3, 4, 1], [7, 8, 9], [1, 2, 0], [7, 8, 9]])
    np.testing.assert_array_equal(proposal.num_proposed, [3, 3, 2, 3])
    model_q = FixedDrafter().probs(1)[0]
    expected_q = jnp.stack([jax.nn.one_hot(jnp.array([3, 4, 1]), VOCAB), model_q,
                            jax.nn.one_hot(jnp.array([1, 2, 0]), VOCAB), model_q])
    np.testing.assert_array_equal(proposal.probs, expected_q)  # a lookup row's q: point masses on its drafts
    assert int(state) == 5 and int(proposer.update(None, state, None)) == 6  # the model's state, its update
    assert proposer.name == "fixed+lookup" and not proposer.can_abstain


def test_a_lookup_and_a_model_of_different_k_are_refused():
    with pytest.raises(ValueError, match="chain of the model's k"):
        lookup_first.LookupFirst(lookup=PromptLookup(num_draft=2), model=FixedDrafter())


def test_a_chain_grafted_onto_a_tree_follows_it_then_takes_its_last_nodes():
    # A grown tree of 6 nodes: root children 1, 2 (verify indices); 3, 4 under 1; 5 under 3; 6 under 2.
    drafts = jnp.array([[10, 20, 11, 12, 13, 21]] * 4)
    parents = jnp.array([[0, 0, 1, 1, 3, 2]] * 4)
    chain = jnp.array([[7, 8, 9, 0], [7, 8, 9, 0], [10, 11, 9, 0], [10, 11, 13, 0]])
    grafted, grafted_parents = tree_lib.graft_chain(drafts, parents, chain, jnp.array([0, 3, 3, 3]))
    np.testing.assert_array_equal(grafted, [[10, 20, 11, 12, 13, 21],  # no chain: the tree as grown
                                            [10, 20, 11, 7, 8, 9],  # new from the root: the last 3 nodes
                                            [10, 20, 11, 12, 13, 9],  # follows 10, 11; 9 under node 3
                                            [10, 20, 11, 12, 13, 13]])  # node 5 was not surely kept: repeated
    np.testing.assert_array_equal(grafted_parents, [[0, 0, 1, 1, 3, 2], [0, 0, 1, 0, 4, 5],
                                                    [0, 0, 1, 1, 3, 3], [0, 0, 1, 1, 3, 3]])


@pytest.fixture(scope="module")
def plain(tiny_model):
    return jaxspec.generate(tiny_model, None, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def test_eagle3_chain_behind_a_lookup_equals_plain_greedy(tiny_model, plain, eagle3_head):
    kwargs = dict(max_new_tokens=NEW_TOKENS, ignore_eos=True, num_draft_tokens=3)
    alone = jaxspec.generate(tiny_model, eagle3_head, PROMPTS, **kwargs)
    hybrid = jaxspec.generate(tiny_model, eagle3_head, PROMPTS, lookup_first=2, **kwargs)
    assert_plain_greedy(tiny_model, PROMPTS, hybrid, plain)
    assert hybrid.stats.method == "eagle3" and hybrid.stats.drafter == "eagle3+lookup2"
    # The random head rarely agrees with the target; the lookup's copies of the looping
    # output do, so the lookup did draft.
    assert hybrid.stats.accepted > alone.stats.accepted


def test_eagle3_tree_behind_a_lookup_equals_plain_greedy(tiny_model, plain, eagle3_head):
    hybrid = jaxspec.generate(tiny_model, eagle3_head, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                              tree=BUSHY, lookup_first=3)
    assert_plain_greedy(tiny_model, PROMPTS, hybrid, plain)
    assert_tree_stats(hybrid.stats, BUSHY)
    assert hybrid.stats.lookup_first == 3


def test_mtp_behind_a_lookup_equals_plain_greedy(tiny_model, plain, mtp_head):
    hybrid = jaxspec.generate(tiny_model, mtp_head, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                              num_draft_tokens=4, lookup_first=1)
    assert_plain_greedy(tiny_model, PROMPTS, hybrid, plain)
    assert hybrid.stats.drafter == "mtp+lookup1" and hybrid.stats.accepted > 0


def test_the_shared_kv_assistant_behind_a_lookup_equals_plain_greedy(small_gemma):
    target, helper = small_gemma
    prompts = [[1, 2, 3, 1, 2, 4, 5, 1, 2], [7, 8, 9]]
    reference = jaxspec.generate(target, None, prompts, max_new_tokens=20, ignore_eos=True)
    hybrid = jaxspec.generate(target, helper, prompts, max_new_tokens=20, ignore_eos=True, num_draft_tokens=3,
                              lookup_first=2)
    assert_plain_greedy(target, prompts, hybrid, reference)
    assert hybrid.stats.drafter == "assistant+lookup2"


@pytest.fixture(scope="module")
def small_head():
    """An EAGLE-3 head for test_spec_sampling's 12-token target speaking 8 of its tokens (d2t)."""
    return small_eagle3_head(8)


# n = 1: the prompt holds 1 .. 5, so rows switch between the lookup and the head from round to round.
LOSSLESS = dict(temperature=1.0)


def test_sampled_drafts_behind_a_lookup_are_lossless(small_target, small_head):
    counts, stats = sampled_joint(small_target, small_head, LOSSLESS, method="eagle3", lookup_first=1)
    p_value = chi_square_p_value(counts, exact_joint(small_target, LOSSLESS))
    assert p_value > SIGNIFICANCE, f"lookup-first speculation changed the distribution: p = {p_value:.2e}"
    assert 0 < stats.accepted <= stats.proposed


def test_sampled_trees_with_a_grafted_lookup_are_lossless(small_target, small_head):
    """Trees verify point masses sibling by sibling; a grafted chain may repeat a sibling's token."""
    counts, stats = sampled_joint(small_target, small_head, LOSSLESS, method="eagle3", lookup_first=1, tree=(2, 3, 6))
    p_value = chi_square_p_value(counts, exact_joint(small_target, LOSSLESS))
    assert p_value > SIGNIFICANCE, f"a grafted tree changed the distribution: p = {p_value:.2e}"
    assert stats.tree == "2,3,6" and stats.accepted > 0


_SELECT = lookup_first.LookupFirst.propose


def _keeps_the_heads_q(self, draft_params, state, context):
    """A plausible bug: the lookup's drafts go to the verifier with the head's q beside them."""
    proposal, new_state = _SELECT(self, draft_params, state, context)
    drafted, _ = self.model.propose(draft_params, state, context)
    return proposal.replace(probs=drafted.probs), new_state


def test_a_selection_that_keeps_the_heads_q_fails_the_same_test(small_target, small_head, monkeypatch):
    exact = exact_joint(small_target, LOSSLESS)
    monkeypatch.setattr(lookup_first.LookupFirst, "propose", _keeps_the_heads_q)
    monkeypatch.setattr("tests.test_spec_sampling.SEEDS", 1)
    assert_broken_run_detected(
        lambda: sampled_joint(small_target, small_head, LOSSLESS, method="eagle3", lookup_first=1), exact)


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="ngram", lookup_first=2), "already is prompt lookup"),
    (dict(method="layer_skip", lookup_first=2), "KV cache follows its own drafts"),
    (dict(method="plain", lookup_first=2), "no drafter"),
    (dict(lookup_first=0), "lookup_first must be an n-gram order"),
    (dict(lookup_first=17), "lookup_first must be an n-gram order"),
    (dict(lookup_first="2"), "lookup_first must be an n-gram order"),
])
def test_requests_lookup_first_cannot_serve_are_refused(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        jaxspec.GenerateOptions(**kwargs)


def test_a_draft_model_behind_a_lookup_is_refused_when_inferred(tiny_model):
    """The method inferred from draft_params is checked too, before anything compiles."""
    with pytest.raises(InvalidRequestError, match="KV cache follows its own drafts"):
        jaxspec.generate(tiny_model, tiny_model, PROMPTS[0], max_new_tokens=4, lookup_first=2)


def test_the_cli_drafts_lookup_first_and_says_so(tiny, tiny_cache, tmp_path, capsys):
    """--lookup-first reaches the request: the CLI prints generate()'s text and a stats line
    naming the drafter as eagle3+lookup2."""
    model = jaxspec.load(str(tiny["gguf"]))
    cfg = dataclasses.replace(HEAD, dim=model.config.dim, vocab_size=model.config.vocab_size,
                              aux_layer_ids=(0, 1, 1))
    checkpoints.save_eagle3(tmp_path, cfg, eagle3.init_params(cfg, jax.random.PRNGKey(4), scale=0.2))
    prompt = "tok1tok2tok1tok2"
    expected = jaxspec.generate(model, jaxspec.load(str(tmp_path)), prompt, max_new_tokens=12, lookup_first=2,
                                chat=False)  # the CLI's --no-chat
    code, out, err = run(capsys, "generate", prompt, "--no-chat", "--max-new-tokens", "12", "--model",
                         str(tiny["gguf"]), "--draft", str(tmp_path), "--lookup-first", "2")
    assert code == 0, err
    assert out == expected.text[0]
    [line] = stats_lines(err)
    assert "eagle3+lookup2 k=4: tau " in line


def test_the_cli_names_the_flag(capsys):
    code, out, err = run(capsys, "generate", "hi", "--method", "ngram", "--lookup-first", "2")
    assert_one_line_error(code, out, err, "--lookup-first", "--method ngram")
