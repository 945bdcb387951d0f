"""Gemma 4's shared-KV assistant (`method="assistant"`): HF parity, exactness, lossless sampling.

Parity: a tiny random transformers Gemma 4 target and `Gemma4AssistantForCausalLM` (both head
kinds: the plain tied head and the centroid-masked one), saved and loaded by jaxspec. For several
accepted prefixes (longer than the sliding window), the assistant's draft tokens, logits and
post-projected hidden states over k teacher-forced steps equal transformers' forward fed exactly
what its `SinglePositionMultiTokenCandidateGenerator` feeds it: the target's shared K/V of the
prefix, the target embedding of the last token beside the target's last hidden state, a
constant position. Then speculation with the assistant equals plain greedy (chains, trees,
quantized K/V) and its sampled drafts are lossless against exact enumeration, and a loop that
feeds it a stale hidden state is caught by the same statistical test.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.api import Model
from jaxspec.checkpoints import load_checkpoint
from jaxspec.errors import InvalidRequestError, UnsupportedModelError
from jaxspec.models import assistant, create_cache, forward, gemma
from jaxspec.spec import loop
from tests.conftest import GEMMA_CONFIGS, TINY, max_relative_error
from tests.test_gemma import BLOCK_KV_GEMMA, perturb_hf
from tests.test_spec_sampling import (SIGNIFICANCE, _rejection_without_residual, assert_broken_run_detected,
                                      chi_square_p_value, exact_joint, sampled_joint)

S, F = "sliding_attention", "full_attention"
TARGET = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5, layer_types=[S, F, S, S, F],
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16, attention_k_eq_v=True,
              num_global_key_value_heads=1, sliding_window=5, hidden_size_per_layer_input=8,
              vocab_size_per_layer_input=128, num_kv_shared_layers=2, final_logit_softcapping=30.0)
ASSISTANT_TEXT = dict(vocab_size=128, hidden_size=24, intermediate_size=48, num_hidden_layers=3,
                      layer_types=[S, S, F], num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                      global_head_dim=16, attention_k_eq_v=True, num_global_key_value_heads=1, sliding_window=5,
                      hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=3)


@pytest.fixture(scope="module", params=["tied-head", "centroid-head"])
def pair(request, tmp_path_factory):
    """(HF target, HF assistant, jaxspec target Model, jaxspec assistant Model)."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)  # the initial weights too: the same models every run
    target = Gemma4ForCausalLM(Gemma4TextConfig(**TARGET)).eval()
    perturb_hf(target, 0, scale=0.1)
    centroids = request.param == "centroid-head"
    helper = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(
        text_config=Gemma4TextConfig(**ASSISTANT_TEXT), backbone_hidden_size=32, use_ordered_embeddings=centroids,
        num_centroids=8, centroid_intermediate_top_k=2)).eval()
    perturb_hf(helper, 1, scale=0.1)
    target_dir, helper_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("assistant")
    target.save_pretrained(target_dir, safe_serialization=True)
    helper.save_pretrained(helper_dir, safe_serialization=True)
    checkpoint = load_checkpoint(target_dir)
    ours = Model(config=checkpoint.config, params=checkpoint.params)
    return target, helper, ours, jaxspec.load(helper_dir)


def _hf_drafts(target, helper, prefix: list[int], pending: int, steps: int):
    """transformers' candidate generator, one round: the target over `prefix` (its K/V and last
    hidden state), then `steps` assistant steps from `pending` at position len(prefix)."""
    import torch

    with torch.no_grad():
        out = target.model(torch.tensor([prefix]), return_shared_kv_states=True)
        hidden = out.last_hidden_state[:, -1:]
        token = torch.tensor([[pending]])
        embed = target.get_input_embeddings()
        tokens, logits, hiddens = [], [], []
        for _ in range(steps):
            result = helper(inputs_embeds=torch.cat([embed(token), hidden], dim=-1),
                            position_ids=torch.tensor([[len(prefix)]]),
                            attention_mask=torch.ones(1, len(prefix) + 1, dtype=torch.long),
                            shared_kv_states=out.shared_kv_states, use_cache=False)
            token, hidden = result.logits.argmax(-1), result.last_hidden_state
            tokens.append(int(token))
            logits.append(result.logits[0, 0].numpy())
            hiddens.append(hidden[0, 0].numpy())
    return tokens, np.stack(logits), np.stack(hiddens)


_target_forward = jax.jit(forward, static_argnums=1, static_argnames=("hidden_layers",))
_assistant_forward = jax.jit(assistant.forward, static_argnums=(1, 2))


def _our_drafts(ours, helper_model, prefix: list[int], pending: int, steps: int, forced_hidden=None):
    """Our `steps` assistant steps; with `forced_hidden` (transformers' hidden outputs), each step
    after the first reads transformers' hidden instead of our own (teacher forcing)."""
    cfg = ours.config
    cache = create_cache(cfg, 1, 32)
    _, (hiddens,), cache = _target_forward(ours.params, cfg, jnp.asarray([prefix], jnp.int32), cache,
                                           hidden_layers=(cfg.num_layers,))
    cache = cache.advance(jnp.asarray([len(prefix)], jnp.int32))
    token, hidden = jnp.asarray([[pending]], jnp.int32), hiddens[:, -1:]
    tokens, logits, projected = [], [], []
    for _ in range(steps):
        step_logits, hidden = _assistant_forward(helper_model.params, helper_model.config, cfg, ours.params.embed,
                                                 token, hidden, cache)
        token = jnp.argmax(step_logits, axis=-1).astype(jnp.int32)
        tokens.append(int(token[0, 0]))
        logits.append(np.asarray(step_logits[0, 0]))
        projected.append(np.asarray(hidden[0, 0]))
        if forced_hidden is not None:
            hidden = jnp.asarray(forced_hidden[len(projected) - 1])[None, None]
    return tokens, np.stack(logits), np.stack(projected)


@pytest.mark.parametrize("length", [3, 9, 13])  # shorter than the window of 5, past it, and well past
def test_drafts_logits_and_hidden_states_match_transformers(pair, length):
    target, helper, ours, helper_model = pair
    rng = np.random.default_rng(length)
    prefix, pending = rng.integers(0, 128, length).tolist(), int(rng.integers(0, 128))
    hf_tokens, hf_logits, hf_hidden = _hf_drafts(target, helper, prefix, pending, 4)
    tokens, logits, _ = _our_drafts(ours, helper_model, prefix, pending, 4)
    assert tokens == hf_tokens
    assert max_relative_error(logits, hf_logits) < 1e-4
    # The hidden state is the next step's input: free-running, each implementation's float32
    # rounding compounds through it (centroid-head at 13: 1.7e-4 after 4 steps, where
    # transformers' own float32 run is 7.8e-5 from its float64 one). Teacher-forced, every step
    # is compared on the same input.
    _, forced_logits, hidden = _our_drafts(ours, helper_model, prefix, pending, 4, forced_hidden=hf_hidden)
    assert max_relative_error(forced_logits, hf_logits) < 1e-4
    for step in range(4):
        assert max_relative_error(hidden[step], hf_hidden[step]) < 1e-4, step


@pytest.mark.parametrize("pair", ["centroid-head"], indirect=True)
def test_centroid_head_scores_only_the_chosen_clusters(pair):
    _, _, ours, helper_model = pair
    cfg = helper_model.config
    assert cfg.num_centroids is not None
    _, logits, _ = _our_drafts(ours, helper_model, [1, 2, 3, 4, 5, 6], 7, 1)
    floor = logits[0].min()
    assert (logits[0] > floor).sum() == cfg.centroid_top_k * cfg.vocab_size // cfg.num_centroids


# ----------------------------------------------------------------------------------------------
# In the loop
# ----------------------------------------------------------------------------------------------

PROMPTS = [[5, 9, 17, 33, 2, 5, 9, 17], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


def test_greedy_with_the_assistant_equals_plain(pair):
    _, _, ours, helper_model = pair
    kwargs = dict(max_new_tokens=20, ignore_eos=True)
    plain = jaxspec.generate(ours, None, PROMPTS, **kwargs)
    chain = jaxspec.generate(ours, helper_model, PROMPTS, num_draft_tokens=3, **kwargs)
    tree = jaxspec.generate(ours, helper_model, PROMPTS, tree=jaxspec.DraftTree(depth=3, top_k=2, num_nodes=5),
                            **kwargs)
    assert chain.stats.method == "assistant" and chain.tokens == plain.tokens and tree.tokens == plain.tokens
    assert chain.stats.proposed > 0 and tree.stats.proposed > 0


def _self_assistant(target_cfg: gemma.GemmaConfig, seed: int, **changes) -> Model:
    """A random assistant for `target_cfg` (its kv heads and widths per layer type)."""
    text = dataclasses.replace(target_cfg, dim=24, num_layers=2, layer_types=target_cfg.layer_types[:2],
                               per_layer_dim=0, per_layer_vocab=0, num_kv_shared_layers=0, final_logit_softcap=None,
                               **changes)
    cfg = assistant.AssistantConfig(text=text, backbone_dim=target_cfg.dim)
    return Model(config=cfg, params=assistant.init_params(cfg, jax.random.PRNGKey(seed), scale=0.3))


def test_quantized_kv_is_read_through_the_same_attend_path():
    cfg = BLOCK_KV_GEMMA
    target = Model(config=cfg, params=gemma.init_params(cfg, jax.random.PRNGKey(5), scale=0.3))
    helper = _self_assistant(cfg, 6)
    kwargs = dict(max_new_tokens=16, ignore_eos=True, kv_format="q8_0")
    prompts = [[token % cfg.vocab_size for token in prompt] for prompt in PROMPTS]
    plain = jaxspec.generate(target, None, prompts, **kwargs)
    spec = jaxspec.generate(target, helper, prompts, method="assistant", **kwargs)
    assert spec.tokens == plain.tokens and spec.stats.proposed > 0


# A 12-token vocabulary: the joint of three tokens is enumerated exactly (tests/test_spec_sampling.py).
SMALL = dataclasses.replace(GEMMA_CONFIGS["gemma4-shared-per-layer"], vocab_size=12, per_layer_vocab=12,
                            max_position_embeddings=64)


@pytest.fixture(scope="module")
def small():
    target = Model(config=SMALL, params=gemma.init_params(SMALL, jax.random.PRNGKey(0), scale=0.5))
    return target, _self_assistant(SMALL, 1)


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=5)],
                         ids=["t1.0", "t0.7-topk5"])
def test_sampled_assistant_drafts_are_lossless(small, settings):
    target, helper = small
    counts, stats = sampled_joint(target, helper, settings, method="assistant")
    p_value = chi_square_p_value(counts, exact_joint(target, settings))
    assert p_value > SIGNIFICANCE, f"assistant speculation changed the distribution: p = {p_value:.2e}"
    assert 0 < stats.accepted <= stats.proposed


def test_a_broken_verifier_fails_the_same_test(small, monkeypatch):
    """The test has the power to see a loss: a verifier that redraws from p instead of the
    residual after a rejection fails it with the assistant's drafts."""
    target, helper = small
    settings = dict(temperature=1.0)
    monkeypatch.setattr(loop, "rejection_sample", _rejection_without_residual)
    assert_broken_run_detected(lambda: sampled_joint(target, helper, settings, method="assistant"),
                               exact_joint(target, settings))


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


def test_mismatched_assistants_are_refused_before_compile(small):
    target, helper = small
    wider = dataclasses.replace(helper.config, backbone_dim=24)
    with pytest.raises(UnsupportedModelError, match="backbone_hidden_size \\(24\\)"):
        jaxspec.generate(target, Model(config=wider, params=helper.params), [[1, 2]], method="assistant")
    heads = _self_assistant(SMALL, 2, full=dataclasses.replace(SMALL.full, head_dim=8, rotary_dim=8))
    with pytest.raises(UnsupportedModelError, match="full_attention layers read 1 kv heads of width 8"):
        jaxspec.generate(target, heads, [[1, 2]], method="assistant")
    kv = _self_assistant(SMALL, 2, sliding=dataclasses.replace(SMALL.sliding, num_kv_heads=2))
    with pytest.raises(UnsupportedModelError, match="sliding_attention layers read 2 kv heads"):
        jaxspec.generate(target, kv, [[1, 2]], method="assistant")
    llama_target = Model(config=dataclasses.replace(TINY, vocab_size=12), params=None)
    with pytest.raises(UnsupportedModelError, match="Gemma 4 target; the target is ModelConfig"):
        jaxspec.generate(llama_target, helper, [[1, 2]], method="assistant")
    gemma3 = dataclasses.replace(SMALL, generation=3, per_layer_dim=0, per_layer_vocab=0, num_kv_shared_layers=0)
    with pytest.raises(UnsupportedModelError, match="the target is a Gemma 3"):
        jaxspec.generate(Model(config=gemma3, params=None), helper, [[1, 2]], method="assistant")
    with pytest.raises(InvalidRequestError, match="needs draft_params: a Gemma 4 assistant"):
        jaxspec.generate(target, None, [[1, 2]], method="assistant")
    for method in ("draft", "layer_skip"):  # a draft model's methods: refused by name, not a TypeError in the trace
        with pytest.raises(InvalidRequestError, match=r"needs a draft model; .*\(use method='assistant'\)"):
            jaxspec.generate(target, helper, [[1, 2]], method=method, max_new_tokens=4)


@pytest.mark.parametrize("change, message", [
    (dict(text_config=dict(ASSISTANT_TEXT, num_kv_shared_layers=2)), "every layer of a Gemma 4 assistant shares"),
    (dict(text_config=dict(ASSISTANT_TEXT, hidden_size_per_layer_input=4)), "hidden_size_per_layer_input"),
    (dict(text_config=dict(ASSISTANT_TEXT, enable_moe_block=True)), "enable_moe_block"),
    (dict(use_ordered_embeddings=True, num_centroids=5), "num_centroids=5 must divide"),
    (dict(text_config=None), "text_config"),
])
def test_bad_assistant_configs_are_named(change, message):
    hf = dict(model_type="gemma4_assistant", text_config=dict(ASSISTANT_TEXT, model_type="gemma4_text"),
              backbone_hidden_size=32)
    hf.update(change)
    if isinstance(hf["text_config"], dict):
        hf["text_config"].setdefault("model_type", "gemma4_text")
    with pytest.raises(UnsupportedModelError, match=message):
        assistant.config_from_hf(hf)


@pytest.mark.parametrize("tree", [None, (3, 2, 6)], ids=["chain", "tree"])
def test_assistant_drafts_under_a_grammar_equal_plain(tree):
    """A Gemma 4 target with a byte-level tokenizer: the assistant draws each draft from its logits
    masked by the state its own drafts reach; speculative output equals plain under the grammar."""
    from tests.test_constrained import MIXED, PROMPTS as GRAMMAR_PROMPTS, PIECES, SPECIALS, byte_level_tokenizer

    tokenizer = byte_level_tokenizer(SPECIALS + [chr(c) for c in range(32, 127)] + PIECES, frozenset(SPECIALS), "</s>")
    cfg = dataclasses.replace(GEMMA_CONFIGS["gemma4-shared-per-layer"], vocab_size=128, per_layer_vocab=128,
                              max_position_embeddings=128, eos_token_ids=(3,))
    target = Model(config=cfg, params=gemma.init_params(cfg, jax.random.PRNGKey(8), scale=0.3), tokenizer=tokenizer)
    helper = _self_assistant(cfg, 9)
    plain = jaxspec.generate(target, None, GRAMMAR_PROMPTS, max_new_tokens=40, **MIXED)
    spec = jaxspec.generate(target, helper, GRAMMAR_PROMPTS, max_new_tokens=40, tree=tree, **MIXED)
    assert spec.tokens == plain.tokens and spec.finish_reason == plain.finish_reason
    assert spec.stats.accepted > 0
