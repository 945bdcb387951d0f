"""EAGLE-3: the head against an independent PyTorch implementation of its op sequence, the
checkpoint format, the aux-layer convention, config parsing, and exact speculative decoding."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import checkpoints
from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig, RopeType, config_from_hf
from jaxspec.models import eagle3, llama
from tests.conftest import max_relative_error

# The trunk's and the head's forwards jitted once for the module (eager, each op compiles alone:
# ~100-250 compiles a test).
_llama_forward = jax.jit(llama.forward, static_argnums=1, static_argnames=("hidden_layers",))
_head_forward = jax.jit(eagle3.forward, static_argnums=1)

TARGET = ModelConfig(vocab_size=96, dim=48, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=12,
                     ffn_dim=80, rotary_dim=12, max_position_embeddings=256, eos_token_ids=(3,))
HEAD = eagle3.Eagle3Config(dim=48, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=64, draft_vocab_size=40,
                           vocab_size=96, rope_theta=50000.0, rotary_dim=8, norm_eps=1e-5,
                           max_position_embeddings=256, aux_layer_ids=(1, 2, 3))
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [9, 8, 7, 6, 5, 4, 30, 31, 32, 33, 9, 8, 7]]


@pytest.fixture(scope="module")
def target():
    return jaxspec.Model(config=TARGET, params=llama.init_params(TARGET, jax.random.PRNGKey(0), scale=0.2))


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("eagle3")
    checkpoints.save_eagle3(directory, HEAD, eagle3.init_params(HEAD, jax.random.PRNGKey(1), scale=0.2))
    return directory


@pytest.fixture(scope="module")
def head(head_dir):
    return jaxspec.load(str(head_dir))


# ------------------------------------------------------------------------------------------
# An independent PyTorch reference of the op sequence (full recompute, no cache)
# ------------------------------------------------------------------------------------------

def _t(x):
    import torch

    return torch.tensor(np.asarray(x), dtype=torch.float64)


def _rms(x, w, eps):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, theta, rotary_dim):  # x [heads, T, H]; rotate-half on the first rotary_dim
    import torch

    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = positions[:, None].double() * inv[None, :]  # [T, R/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([rot * cos + rotated * sin, rest], -1)


def torch_head_steps(p, cfg, embed, tokens, g):
    """tokens [T], g [T, D]: run the head over T positions (causal); -> logits [T, Vd], g_next [T, D]."""
    import torch

    T = len(tokens)
    e = embed[tokens]
    cat = torch.cat([_rms(e, p["input_layernorm"], cfg.norm_eps), _rms(g, p["hidden_norm"], cfg.norm_eps)], -1)
    q = (cat @ p["q_proj"].T).view(T, cfg.num_heads, cfg.head_dim).transpose(0, 1)
    k = (cat @ p["k_proj"].T).view(T, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
    v = (cat @ p["v_proj"].T).view(T, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
    positions = torch.arange(T)
    q, k = _rope(q, positions, cfg.rope_theta, cfg.rotary_dim), _rope(k, positions, cfg.rope_theta, cfg.rotary_dim)
    group = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(cfg.head_dim)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, -1) @ p["o_proj"].T
    x1 = g + attn
    z = _rms(x1, p["post_attention_layernorm"], cfg.norm_eps)
    g_next = x1 + (torch.nn.functional.silu(z @ p["gate_proj"].T) * (z @ p["up_proj"].T)) @ p["down_proj"].T
    return _rms(g_next, p["norm"], cfg.norm_eps) @ p["lm_head"].T, g_next


def test_head_matches_an_independent_torch_implementation_over_several_steps(head, target):
    """Absorb 7 positions of target features, then draft 4 tokens on the head's own g."""
    import torch

    p = {name: _t(value) for name, value in eagle3.named_leaves(head.params).items() if name != "d2t"}
    embed = _t(target.params.embed)
    rng = np.random.RandomState(0)
    features = tuple(rng.randn(1, 7, HEAD.dim).astype(np.float32) for _ in range(3))
    tokens = rng.randint(0, TARGET.vocab_size, 7)

    g0 = eagle3.encode(head.params, features)
    cache = eagle3.create_cache(HEAD, 1, 16)
    logits, g_next, cache = _head_forward(head.params, HEAD, target.params.embed, jnp.asarray([tokens]), g0, cache)
    cache = cache.advance(jnp.array([7]))
    ref_g0 = torch.cat([_t(f[0]) for f in features], -1) @ p["fc"].T
    ref_logits, ref_g = torch_head_steps(p, HEAD, embed, torch.tensor(tokens), ref_g0)
    assert max_relative_error(logits[0], ref_logits.numpy()) <= 1e-4

    all_tokens, all_g = list(tokens), ref_g0
    token, g = int(jnp.argmax(logits[0, -1])), g_next[:, -1]
    for step in range(4):
        step_logits, g_next, cache = _head_forward(head.params, HEAD, target.params.embed,
                                                   jnp.asarray([[token]]), g[:, None], cache)
        cache = cache.advance(jnp.array([1]))
        # The reference recomputes everything: the new position pairs the previous g_next with `token`.
        all_tokens.append(token)
        all_g = torch.cat([all_g, ref_g[-1:]], 0)
        ref_logits, ref_g = torch_head_steps(p, HEAD, embed, torch.tensor(all_tokens), all_g)
        error = max_relative_error(step_logits[0, 0], ref_logits[-1].numpy())
        assert error <= 1e-4, f"draft step {step}: relative error {error:.2e}"
        token, g = int(jnp.argmax(step_logits[0, 0])), g_next[:, 0]


def test_checkpoint_round_trip_and_d2t(head_dir, head):
    params = eagle3.init_params(HEAD, jax.random.PRNGKey(1), scale=0.2)
    loaded = eagle3.named_leaves(head.params)
    for name, value in eagle3.named_leaves(params).items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(value), err_msg=name)
    assert head.config == HEAD
    ids = eagle3.to_target_ids(head.params, jnp.arange(HEAD.draft_vocab_size))
    assert len(set(np.asarray(ids).tolist())) == HEAD.draft_vocab_size
    assert 0 <= int(ids.min()) and int(ids.max()) < HEAD.vocab_size


# ------------------------------------------------------------------------------------------
# Which target layers: the convention
# ------------------------------------------------------------------------------------------

def test_aux_ids_are_the_streams_entering_those_layers(tmp_path):
    """aux id i == HF's hidden_states[i] (the input of layer i) == our hidden_layers i - 1."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ckpt = checkpoints.load_checkpoint(tmp_path)
    tokens = np.random.RandomState(0).randint(0, 64, (1, 9))
    aux = (0, 2, 4)
    _, ours, _ = _llama_forward(ckpt.params, ckpt.config, jnp.asarray(tokens), KVCache.create(ckpt.config, 1, 16),
                                hidden_layers=eagle3.target_hidden_layers(aux))
    with torch.no_grad():
        reference = hf(torch.tensor(tokens), output_hidden_states=True).hidden_states
    for feature, layer in zip(ours, aux):
        assert max_relative_error(feature, reference[layer].numpy()) <= 1e-5


def test_default_aux_layers_and_declared_ids_win():
    undeclared = dataclasses.replace(HEAD, aux_layer_ids=None)
    assert undeclared.resolved_aux_layers(32) == (2, 16, 29)  # the seed's (1, 15, 28) as layer outputs
    assert eagle3.target_hidden_layers((2, 16, 29)) == (1, 15, 28)
    assert HEAD.resolved_aux_layers(32) == (1, 2, 3)


# ------------------------------------------------------------------------------------------
# Config parsing: one RoPE-width derivation for trunk and head (the seed's config tests)
# ------------------------------------------------------------------------------------------

BASE_HF = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96,
           "vocab_size": 128, "draft_vocab_size": 32, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0}


@pytest.mark.parametrize("extra, expected", [
    ({"partial_rotary_factor": 0.25}, 8),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}, 16),
    ({}, 32),
    ({"rotary_dim": 12, "partial_rotary_factor": 0.25}, 12),
    ({"partial_rotary_factor": 0.0}, 32),
    ({"partial_rotary_factor": 2.0}, 32),
])
def test_rope_width_is_resolved_identically_for_head_and_trunk(extra, expected):
    hf = {**BASE_HF, **extra}
    assert eagle3.config_from_hf(hf).rotary_dim == expected
    assert config_from_hf(hf).rotary_dim == expected


def test_rope_scaling_of_a_head_reaches_its_attention():
    """A Llama 3.1 head declares llama3 scaling as its target does; its attention runs with it."""
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    cfg = eagle3.config_from_hf({**BASE_HF, "rope_scaling": scaling})
    assert cfg.rope_scaling == config_from_hf({**BASE_HF, "rope_scaling": scaling}).rope_scaling
    assert cfg.attention_config.rope_scaling is cfg.rope_scaling
    assert cfg.rope_scaling.rope_type is RopeType.LLAMA3


def test_eagle_config_declares_aux_layers():
    hf = {**BASE_HF, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    assert eagle3.config_from_hf(hf).aux_layer_ids == (1, 15, 28)
    assert eagle3.config_from_hf(BASE_HF).aux_layer_ids is None


# ------------------------------------------------------------------------------------------
# Exactness in the loop
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 4])  # one draft, and a chain past the head's first depth
def test_eagle3_speculation_equals_plain_greedy(target, head, k):
    plain = jaxspec.generate(target, None, PROMPTS, max_new_tokens=24, ignore_eos=True)
    spec = jaxspec.generate(target, head, PROMPTS, max_new_tokens=24, ignore_eos=True, num_draft_tokens=k)
    assert spec.tokens == plain.tokens
    assert spec.stats.method == "eagle3" and spec.stats.proposed == k * spec.stats.rounds
    single = jaxspec.generate(target, head, PROMPTS[2], max_new_tokens=24, ignore_eos=True, num_draft_tokens=k)
    assert single.tokens[0] == plain.tokens[2]


def test_eagle3_speculation_under_bf16_weights_equals_plain_greedy(target, head):
    """bf16 weights: the head loaded in "auto" runs in its target's format, so every product of
    the trunk and the head, the fc whose output leaves transposed included, is a bf16 product
    (quant._bf16_product); forwards padded to TOKEN_LANES keep a step and a verify alike."""
    bf16 = jaxspec.convert_weights(target, "bf16")
    plain = jaxspec.generate(bf16, None, PROMPTS, max_new_tokens=24, ignore_eos=True)
    spec = jaxspec.generate(bf16, head, PROMPTS, max_new_tokens=24, ignore_eos=True, num_draft_tokens=3)
    assert spec.tokens == plain.tokens
    assert spec.stats.method == "eagle3" and spec.stats.proposed == 3 * spec.stats.rounds


def test_eagle3_head_state_tracks_the_committed_sequence(target, head):
    """The persistent draft KV must equal a from-scratch absorb of the same committed sequence:
    after generation, re-absorbing (feature p, token p + 1) for the whole sequence gives the same
    next-token logits as the incremental state."""
    from jaxspec.spec import proposers
    from jaxspec.spec.drafters.eagle3 import Eagle3

    result = jaxspec.generate(target, head, PROMPTS[0], max_new_tokens=12, ignore_eos=True, num_draft_tokens=3)
    sequence = PROMPTS[0] + result.tokens[0]
    aux = HEAD.resolved_aux_layers(TARGET.num_layers)
    _, features, _ = _llama_forward(target.params, TARGET, jnp.asarray([sequence[:-1]]),
                                    KVCache.create(TARGET, 1, 64), hidden_layers=eagle3.target_hidden_layers(aux))
    proposer = Eagle3(num_draft=3, config=HEAD, aux_layer_ids=aux)
    draft_params = {"head": head.params, "embed": target.params.embed}
    n = len(sequence) - 1
    absorb = jax.jit(proposer._absorb)
    state = absorb(draft_params, eagle3.create_cache(HEAD, 1, 64), jnp.asarray([sequence[1:]]),
                             features, jnp.array([n]))
    # Reproduce the incremental path: prefill then rounds, exactly as the loop runs it.
    prefill = proposers.Prefill(prompt=jnp.asarray([PROMPTS[0]]), prompt_length=jnp.array([len(PROMPTS[0])]),
                                first_token=jnp.array([result.tokens[0][0]]),
                                hiddens=tuple(f[:, :len(PROMPTS[0])] for f in features))
    incremental = jax.jit(proposer.init, static_argnums=2)(draft_params, prefill, 64)
    update = jax.jit(proposer.update)
    position = len(PROMPTS[0])
    while position < n:
        take = min(4, n - position)
        committed = jnp.asarray([sequence[position + 1: position + 1 + take] + [0] * (4 - take)])
        hiddens = tuple(jnp.pad(f[:, position: position + take], ((0, 0), (0, 4 - take), (0, 0))) for f in features)
        verified = proposers.Verified(accepted=jnp.array([take - 1]), committed=committed,
                                      num_committed=jnp.array([take]), hiddens=hiddens,
                                      path=jnp.arange(4)[None])
        incremental = update(draft_params, incremental, verified)
        position += take
    assert int(incremental.cache.length[0]) == int(state.cache.length[0]) == n
    assert max_relative_error(incremental.next_logits, state.next_logits) <= 1e-5


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------

def test_head_with_another_hidden_size_is_refused(target, tmp_path):
    other = dataclasses.replace(HEAD, dim=32)
    checkpoints.save_eagle3(tmp_path, other, eagle3.init_params(other, jax.random.PRNGKey(2)))
    with pytest.raises(jaxspec.InvalidRequestError, match="hidden_size"):
        jaxspec.generate(target, jaxspec.load(str(tmp_path)), [1, 2, 3])


def test_aux_layer_ids_out_of_range_are_refused(target, tmp_path):
    other = dataclasses.replace(HEAD, aux_layer_ids=(1, 2, 9))
    checkpoints.save_eagle3(tmp_path, other, eagle3.init_params(other, jax.random.PRNGKey(2)))
    with pytest.raises(jaxspec.InvalidRequestError, match=r"aux layer ids \(1, 2, 9\)"):
        jaxspec.generate(target, jaxspec.load(str(tmp_path)), [1, 2, 3])


def test_d2t_outside_the_target_vocabulary_is_refused(tmp_path):
    params = eagle3.init_params(HEAD, jax.random.PRNGKey(2))
    params = dataclasses.replace(params, d2t=params.d2t.at[3].set(500))
    checkpoints.save_eagle3(tmp_path, HEAD, params)
    with pytest.raises(jaxspec.CheckpointError, match="draft id 3"):
        jaxspec.load(str(tmp_path))


def test_missing_tensor_and_wrong_dtype_are_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    checkpoints.save_eagle3(tmp_path, HEAD, eagle3.init_params(HEAD, jax.random.PRNGKey(2)))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "midlayer.hidden_norm.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(jaxspec.CheckpointError, match="midlayer.hidden_norm.weight"):
        jaxspec.load(str(tmp_path))
    tensors["d2t"] = tensors["d2t"].astype(np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(jaxspec.CheckpointError, match="'d2t' has dtype F32"):
        jaxspec.load(str(tmp_path))
