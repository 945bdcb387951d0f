"""Trunk parity against HF transformers (PyTorch) on small random checkpoints written here.

Each case writes a checkpoint with `save_pretrained` (safetensors), loads it through jaxspec's
own loader, and compares float32 logits (max relative error <= 1e-4) and 32 greedy tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.cache import KVCache
from jaxspec.checkpoints import load_checkpoint
from jaxspec.config import ModelConfig, RopeType, resolve_rotary_dim
from jaxspec.models import llama
from tests.conftest import assert_same_greedy, max_relative_error

# One jit of the forward for the module (eager, each op compiles alone: ~30 compiles a layer).
_forward = jax.jit(llama.forward, static_argnums=1, static_argnames=("hidden_layers",))

COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.08, rms_norm_eps=1e-5)

# case -> (transformers config class, model class, config fields beside COMMON)
CASES = {
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "llama-tied-llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=512,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    # YaRN over a short original context, so the ramp covers several dims and the attention
    # factor (0.1 ln 4 + 1 on cos and sin) is far from 1.
    "llama-yarn-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=256,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64))),
    "smollm2-like-gqa3": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
        rope_theta=100000.0)),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3-qknorm": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=24)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None, head_dim=16)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    import torch
    import transformers

    config_name, model_name, extra = CASES[request.param]
    torch.manual_seed(hash(request.param) % 1000)
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    hf_model = getattr(transformers, model_name)(config).eval()
    directory = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(directory, safe_serialization=True)
    ckpt = load_checkpoint(directory)
    return hf_model, jaxspec.Model(config=ckpt.config, params=ckpt.params)


def _hf_logits(hf_model, tokens):
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor(tokens)).logits.numpy()


def test_logits_match_transformers(case):
    hf_model, model = case
    scaling = hf_model.config.rope_parameters.get("rope_type", "default")
    assert (model.config.rope_scaling is None) == (scaling == "default")
    if model.config.rope_scaling is not None:
        assert model.config.rope_scaling.rope_type is RopeType(scaling)
    tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 24))
    logits, _, _ = _forward(model.params, model.config, jnp.asarray(tokens, jnp.int32),
                            KVCache.create(model.config, 2, 32))
    error = max_relative_error(logits, _hf_logits(hf_model, tokens))
    assert error <= 1e-4, f"max relative logits error {error:.2e}"


def test_hidden_states_match_transformers(case):
    import torch

    hf_model, model = case
    tokens = np.random.RandomState(1).randint(0, model.config.vocab_size, (1, 10))
    layers = (0, model.config.num_layers - 2)
    _, hiddens, _ = _forward(model.params, model.config, jnp.asarray(tokens, jnp.int32),
                             KVCache.create(model.config, 1, 16), hidden_layers=layers)
    with torch.no_grad():
        reference = hf_model(torch.tensor(tokens), output_hidden_states=True).hidden_states
    for ours, layer in zip(hiddens, layers):
        assert max_relative_error(ours, reference[layer + 1].numpy()) <= 1e-4


def test_32_greedy_tokens_match_transformers(case):
    import torch

    hf_model, model = case
    prompt = np.random.RandomState(2).randint(0, model.config.vocab_size, (11,)).tolist()
    with torch.no_grad():
        # An explicit all-ones mask: HF would otherwise mask every pad-id token in the prompt.
        reference = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=32, min_new_tokens=32,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    ours = jaxspec.generate(model, None, prompt, max_new_tokens=32, ignore_eos=True).tokens[0]
    reference = reference.tolist()

    def reference_logits_at(step):
        return _hf_logits(hf_model, [prompt + reference[:step]])[0, -1]

    assert_same_greedy(ours, reference, reference_logits_at)


def test_partial_rotary_matches_transformers_phi3(tmp_path):
    """Partial RoPE (rotate the first half of each head, pass the rest) against HF's Phi-3,
    the Llama-shaped HF model that implements it. Phi-3 fuses qkv and gate/up; split them here."""
    import torch
    import transformers

    torch.manual_seed(3)
    hf_config = transformers.Phi3Config(**{**COMMON, "num_key_value_heads": 2}, partial_rotary_factor=0.5,
                                        pad_token_id=0, tie_word_embeddings=False, rope_theta=10000.0)
    hf_model = transformers.Phi3ForCausalLM(hf_config).eval()
    sd = {k: jnp.asarray(v.numpy()) for k, v in hf_model.state_dict().items()}
    N, K, D = hf_config.num_attention_heads, hf_config.num_key_value_heads, hf_config.hidden_size
    H = D // N
    F = hf_config.intermediate_size
    cfg = ModelConfig(vocab_size=hf_config.vocab_size, dim=D, num_layers=hf_config.num_hidden_layers,
                      num_heads=N, num_kv_heads=K, head_dim=H, ffn_dim=F, rope_theta=10000.0,
                      rotary_dim=resolve_rotary_dim(hf_config.to_dict(), H), norm_eps=hf_config.rms_norm_eps,
                      max_position_embeddings=256)
    assert cfg.rotary_dim == H // 2
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv, gate_up = sd[p + "self_attn.qkv_proj.weight"], sd[p + "mlp.gate_up_proj.weight"]
        layers.append({
            "attn_norm": sd[p + "input_layernorm.weight"], "q_proj": qkv[: N * H],
            "k_proj": qkv[N * H: (N + K) * H], "v_proj": qkv[(N + K) * H:],
            "o_proj": sd[p + "self_attn.o_proj.weight"], "mlp_norm": sd[p + "post_attention_layernorm.weight"],
            "gate_proj": gate_up[:F], "up_proj": gate_up[F:], "down_proj": sd[p + "mlp.down_proj.weight"],
        })
    top = {"embed": sd["model.embed_tokens.weight"], "final_norm": sd["model.norm.weight"],
           "lm_head": sd["lm_head.weight"]}
    params = llama.params_from(cfg, lambda name, index: top[name] if index is None else layers[index][name])
    tokens = np.random.RandomState(4).randint(0, cfg.vocab_size, (2, 20))
    logits, _, _ = _forward(params, cfg, jnp.asarray(tokens, jnp.int32), KVCache.create(cfg, 2, 32))
    error = max_relative_error(logits, _hf_logits(hf_model, tokens))
    assert error <= 1e-4, f"max relative logits error {error:.2e}"
    # A full-width RoPE would be wrong here: the test must be able to fail.
    wrong = dataclasses.replace(cfg, rotary_dim=H)
    wrong_logits, _, _ = _forward(params, wrong, jnp.asarray(tokens, jnp.int32), KVCache.create(cfg, 2, 32))
    assert max_relative_error(wrong_logits, _hf_logits(hf_model, tokens)) > 1e-3
