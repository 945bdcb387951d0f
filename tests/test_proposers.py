"""Proposers (jaxspec.spec.proposers) on their own: prompt lookup by hand, and the draft inputs
each proposer builds for the jitted program."""

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec import generate, prepare
from jaxspec.models import eagle3, llama, mtp
from jaxspec.spec import loop
from jaxspec.spec.drafters.draft_model import DraftModel
from jaxspec.spec.drafters.eagle3 import Eagle3
from jaxspec.spec.drafters.mtp import Mtp
from jaxspec.spec.drafters.ngram import PromptLookup
from jaxspec.spec.proposers import Context
from tests.conftest import TINY


def test_prompt_lookup_proposes_the_continuation_of_the_latest_match():
    # Context "1 2 3 9 1 2 3 7 5 1 2 3": the suffix "1 2 3" last occurred at index 4, followed by 7 5.
    history = jnp.array([[1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3, 0, 0, 0, 0]])
    context = Context(tokens=history, length=jnp.array([12]))
    proposal, _ = PromptLookup(num_draft=4, ngram_max=3, ngram_min=1).propose(None, None, context)
    # Proposals stop at the end of the context: 7 5 1 2 (four follow index 7).
    assert proposal.drafts.tolist() == [[7, 5, 1, 2]] and proposal.num_proposed.tolist() == [4]
    assert proposal.probs is None  # point masses
    short = Context(tokens=history, length=jnp.array([9]))  # "... 1 2 3 7 5": suffix "5" never seen before
    none, _ = PromptLookup(num_draft=4).propose(None, None, short)
    assert none.num_proposed.tolist() == [0]
    # With ngram_max=1 the suffix "3" (at 11) matches index 6 most recently: proposes 7 5 1 2.
    one_gram, _ = PromptLookup(num_draft=2, ngram_max=1).propose(None, None, context)
    assert one_gram.drafts.tolist() == [[7, 5]] and one_gram.num_proposed.tolist() == [2]



def test_each_proposer_builds_its_own_draft_inputs(tiny_model):
    untied_params = tiny_model.params
    assert untied_params.lm_head is not None
    tied_params = dataclasses.replace(untied_params, lm_head=None)  # a tied trunk has no lm_head
    draft = llama.init_params(dataclasses.replace(TINY, num_layers=1), jax.random.PRNGKey(1))
    assert PromptLookup(num_draft=2).draft_inputs(untied_params, None) is None
    assert DraftModel(num_draft=2, config=TINY).draft_inputs(untied_params, draft) is draft
    head_cfg = eagle3.Eagle3Config(dim=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=96, draft_vocab_size=96,
                                   vocab_size=128, rope_theta=10000.0, rotary_dim=16, norm_eps=1e-6,
                                   max_position_embeddings=256)
    inputs = Eagle3(num_draft=2, config=head_cfg, aux_layer_ids=(0, 1, 1)).draft_inputs(untied_params, draft)
    assert inputs["head"] is draft and inputs["embed"] is untied_params.embed
    mtp_cfg = mtp.MtpConfig(block=dataclasses.replace(TINY, num_layers=1))
    untied = Mtp(num_draft=2, config=mtp_cfg, target_layers=2).draft_inputs(untied_params, draft)
    assert untied["lm_head"] is untied_params.lm_head and untied["embed"] is untied_params.embed
    tied = Mtp(num_draft=2, config=mtp_cfg, target_layers=2).draft_inputs(tied_params, draft)
    assert tied["lm_head"] is tied_params.embed


def test_draft_model_proposes_its_own_argmax_chain(tiny_model):
    """A draft equal to the target, primed on a prompt, drafts the target's greedy continuation."""
    prompt = [5, 6, 7, 8]
    continuation = generate(tiny_model, None, prompt, max_new_tokens=4, ignore_eos=True).tokens[0]
    prepared = prepare(tiny_model, tiny_model, prompt, num_draft_tokens=3, max_new_tokens=4, ignore_eos=True)
    proposer = prepared.speculation.proposer
    state = loop.prefill_jit(tiny_model.params, tiny_model.params, prepared.request, spec=prepared.spec)
    proposal, _ = jax.jit(proposer.propose)(tiny_model.params, state.proposer_state, state.context)
    assert proposal.drafts.tolist() == [continuation[1:4]] and proposal.num_proposed.tolist() == [3]
