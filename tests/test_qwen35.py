"""The Qwen3.5 hybrid trunk: delta-rule forms, HF parity, exactness (the cache: test_hybrid_cache.py).

Parity is against transformers' `qwen3_5` text model on small random checkpoints written here
(every weight drawn at random, so a swapped tensor cannot hide behind ones or zeros). The
speculative tests compare against the plain loop on the same hybrid, with a proposer whose
drafts are made right or wrong on purpose, so rounds that reject at the first draft, rounds that
accept part and rounds that accept everything all happen and the committed recurrent state is
checked by the tokens that follow.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxspec
from jaxspec.checkpoints import load_checkpoint
from jaxspec.config import RopeScaling, RopeType
from jaxspec.errors import CheckpointError, UnsupportedModelError
from jaxspec.models import qwen35
from jaxspec.models.qwen35 import LayerType, Qwen35Cache, Qwen35Config
from jaxspec.sampling import SamplingParams, distribution, spec_for
from jaxspec.spec import loop
from jaxspec.spec.proposers import Proposal
from tests.conftest import assert_same_greedy, max_relative_error
from tests.test_spec_sampling import PROMPT, SIGNIFICANCE, chi_square_p_value, sampled_joint

LIN, FULL = LayerType.LINEAR_ATTENTION, LayerType.FULL_ATTENTION

forward = jax.jit(qwen35.forward, static_argnums=1, static_argnames=("delta_rule", "hidden_layers"))


def step_fn(cfg):
    @jax.jit
    def step(params, cache, token):  # one token per row, committed
        logits, _, cache = qwen35.forward(params, cfg, token[:, None], cache)
        return logits[:, 0], cache.advance(jnp.ones_like(cache.length))
    return step


# ----------------------------------------------------------------------------------------------
# Parity with transformers
# ----------------------------------------------------------------------------------------------

HF_COMMON = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=12,
                 max_position_embeddings=256, rms_norm_eps=1e-5, linear_conv_kernel_dim=4)
HF_CASES = {
    # HF's default pattern (three DeltaNet layers, then attention), Qwen3.5's partial RoPE (1/4),
    # two value heads per key head, tied embeddings.
    "interval4-tied-rope0.25": dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                                    tie_word_embeddings=True,
                                    rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                         partial_rotary_factor=0.25)),
    # Attention first, then DeltaNet; half-width RoPE, one value head per key head, untied.
    "attention-first-untied-rope0.5": dict(num_hidden_layers=3, layer_types=["full_attention", "linear_attention",
                                                                           "linear_attention"],
                                           linear_num_key_heads=2, linear_num_value_heads=2,
                                           tie_word_embeddings=False,
                                           rope_parameters=dict(rope_type="default", rope_theta=50000.0,
                                                                partial_rotary_factor=0.5)),
}


def _randomize(model, seed: int) -> None:
    """Every weight of the torch `model` random, in ranges a trained Qwen3.5 has (decay rates A in (0.05, 2))."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(0.05, 2.0, generator=generator).log())
            elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
            elif "norm" in name:  # zero-centred RMSNorms: the multiplier is 1 + w
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
            elif "conv1d" in name:
                param.copy_(0.4 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.12 * torch.randn(param.shape, generator=generator))


def write_hf(directory: pathlib.Path, case: str, dtype: str = "float32", seed=0):
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**HF_COMMON, **HF_CASES[case])).eval()
    _randomize(hf_model, seed)
    hf_model = hf_model.to(getattr(torch, dtype))
    hf_model.save_pretrained(directory, safe_serialization=True)
    return hf_model


@pytest.fixture(scope="module", params=sorted(HF_CASES))
def hf_case(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = write_hf(directory, request.param, seed=len(request.param))
    ckpt = load_checkpoint(directory)
    return hf_model, jaxspec.Model(config=ckpt.config, params=ckpt.params)


def hf_logits(hf_model, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor(np.asarray(tokens))).logits.float().numpy()


def test_config_reads_the_layer_pattern_and_rope_width(hf_case):
    hf_model, model = hf_case
    cfg = model.config
    assert [t.value for t in cfg.layer_types] == hf_model.config.layer_types
    assert cfg.rotary_dim == int(cfg.head_dim * hf_model.config.rope_parameters["partial_rotary_factor"])
    assert cfg.tie_embeddings == hf_model.config.tie_word_embeddings
    assert (model.params.lm_head is not None) != cfg.tie_embeddings


def prefill(model, tokens, cache):
    """The 80-token chunked forward every parity and cache test shares (one program per case)."""
    layers = (-1, 0, model.config.num_layers - 2)
    return forward(model.params, model.config, jnp.asarray(tokens, jnp.int32), cache, hidden_layers=layers)


def test_chunked_prefill_logits_and_hidden_states_match_transformers(hf_case):
    """80 tokens: the chunked form over two chunks (64 + 16), batch 2."""
    import torch

    hf_model, model = hf_case
    tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 80))
    logits, hiddens, _ = prefill(model, tokens, Qwen35Cache.create(model.config, 2, 96))
    error = max_relative_error(logits, hf_logits(hf_model, tokens))
    assert error <= 1e-4, f"max relative logits error {error:.2e}"
    with torch.no_grad():
        reference = hf_model(torch.tensor(tokens), output_hidden_states=True).hidden_states
    for ours, layer in zip(hiddens, (-1, 0, model.config.num_layers - 2)):
        assert max_relative_error(ours, reference[layer + 1].numpy()) <= 1e-4, layer


def test_step_by_step_decode_and_32_greedy_tokens_match_transformers(hf_case):
    """Token-at-a-time (the recurrent form, T = 1): the prompt, then 32 greedy tokens; logits at
    every step against HF's full-sequence forward, tokens against HF's own greedy generate."""
    import torch

    hf_model, model = hf_case
    cfg = model.config
    prompt = np.random.RandomState(2).randint(0, cfg.vocab_size, (11,)).tolist()
    with torch.no_grad():
        reference = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    step = step_fn(cfg)
    cache = Qwen35Cache.create(cfg, 1, 64)
    ours, step_logits = [], []
    token = prompt[0]
    for position in range(len(prompt) + 32 - 1):
        logits, cache = step(model.params, cache, jnp.asarray([token], jnp.int32))
        step_logits.append(np.asarray(logits[0]))
        if position + 1 < len(prompt):
            token = prompt[position + 1]
        else:
            token = int(np.argmax(step_logits[-1]))
            ours.append(token)
    full = hf_logits(hf_model, [prompt + reference])[0]
    error = max_relative_error(np.stack(step_logits), full[: len(step_logits)])
    assert error <= 1e-4, f"max relative logits error {error:.2e}"
    assert_same_greedy(ours, reference, lambda i: full[len(prompt) - 1 + i])


def test_yarn_scaled_rope_matches_transformers(tmp_path):
    """The attention layers run the shared RoPE with `cfg.rope_scaling`: the same weights under a
    yarn-scaled HF config (scaled frequencies over the half-width rotation, and the attention
    factor on cos and sin) give HF's logits, which differ from the unscaled model's."""
    import transformers

    case = "attention-first-untied-rope0.5"
    hf_model = write_hf(tmp_path, case, seed=9)
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=50000.0,
                partial_rotary_factor=0.5)
    scaled_model = transformers.Qwen3_5ForCausalLM(
        transformers.Qwen3_5TextConfig(**HF_COMMON, **{**HF_CASES[case], "rope_parameters": yarn})).eval()
    scaled_model.load_state_dict(hf_model.state_dict())
    ckpt = load_checkpoint(tmp_path)
    cfg = dataclasses.replace(ckpt.config, rope_scaling=RopeScaling(rope_type=RopeType.YARN, factor=4.0,
                                                                    original_max_position_embeddings=32))
    tokens = np.random.RandomState(9).randint(0, cfg.vocab_size, (1, 40))
    logits, _, _ = forward(ckpt.params, cfg, jnp.asarray(tokens, jnp.int32), Qwen35Cache.create(cfg, 1, 48))
    error = max_relative_error(logits, hf_logits(scaled_model, tokens))
    assert error <= 1e-4, f"max relative logits error {error:.2e}"
    assert max_relative_error(logits, hf_logits(hf_model, tokens)) > 1e-3


def test_bf16_checkpoint_and_multimodal_layout_load(tmp_path):
    """bf16 safetensors load exactly (to float32, norms + 1); a `qwen3_5` (vision-language) dir
    with the text trunk under model.language_model.* loads the same params."""
    case = "interval4-tied-rope0.25"
    hf_model = write_hf(tmp_path / "bf16", case, dtype="bfloat16", seed=5)
    ckpt = load_checkpoint(tmp_path / "bf16")
    state = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
    np.testing.assert_array_equal(ckpt.params.embed, state["model.embed_tokens.weight"])
    np.testing.assert_array_equal(ckpt.params.final_norm, 1.0 + state["model.norm.weight"])
    delta_net = ckpt.params.layers[0].delta_net
    np.testing.assert_array_equal(delta_net.A_log, state["model.layers.0.linear_attn.A_log"])
    np.testing.assert_array_equal(delta_net.conv_weight, state["model.layers.0.linear_attn.conv1d.weight"][:, 0])
    np.testing.assert_array_equal(delta_net.out_norm, state["model.layers.0.linear_attn.norm.weight"])
    np.testing.assert_array_equal(ckpt.params.layers[3].attention.q_norm,
                                  1.0 + state["model.layers.3.self_attn.q_norm.weight"])

    multimodal = tmp_path / "vl"
    multimodal.mkdir()
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = np.zeros((2, 2), np.float32)  # ignored
    save_file(renamed, multimodal / "model.safetensors")
    text_config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config = {"model_type": "qwen3_5", "tie_word_embeddings": text_config["tie_word_embeddings"],
              "text_config": {**text_config, "model_type": "qwen3_5_text"}, "vision_config": {"depth": 1}}
    (multimodal / "config.json").write_text(json.dumps(config))
    vl = load_checkpoint(multimodal)
    assert vl.config == ckpt.config
    jax.tree.map(np.testing.assert_array_equal, vl.params, ckpt.params)


# ----------------------------------------------------------------------------------------------
# Speculative decoding on the hybrid: exact under greedy
# ----------------------------------------------------------------------------------------------

SPEC_CFG = Qwen35Config(vocab_size=128, dim=64, num_layers=2, layer_types=(LIN, FULL), ffn_dim=96, num_heads=4,
                        num_kv_heads=2, head_dim=16, rotary_dim=4, rope_theta=10000.0, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                        max_position_embeddings=256)
# Ragged lengths 13, 6 and 16 with repeats for prompt lookup (bucket 16: generate's prefill runs
# the recurrent form; the scripted test below pads to 32, the chunked form).
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [40, 41, 42, 40, 41, 42],
    [9, 8, 7, 6, 5, 4, 30, 31, 9, 8, 7, 6, 5, 4, 30, 31],
]


NEW_TOKENS = 30


@pytest.fixture(scope="module")
def hybrid():
    return jaxspec.Model(config=SPEC_CFG, params=qwen35.init_params(SPEC_CFG, jax.random.PRNGKey(0), 0.25))


@pytest.fixture(scope="module")
def reference(hybrid):
    """Each prompt's greedy continuation decoded token by token by the trunk alone (no loop):
    all rows in lockstep, each feeding its prompt and then its own argmax."""
    step = step_fn(SPEC_CFG)
    cache = Qwen35Cache.create(SPEC_CFG, len(PROMPTS), 64)
    sequences = [list(prompt) for prompt in PROMPTS]
    for position in range(max(map(len, PROMPTS)) + NEW_TOKENS - 1):
        tokens = [seq[min(position, len(seq) - 1)] for seq in sequences]
        logits, cache = step(hybrid.params, cache, jnp.asarray(tokens, jnp.int32))
        for row, seq in enumerate(sequences):
            if position == len(seq) - 1 and len(seq) < len(PROMPTS[row]) + NEW_TOKENS:
                seq.append(int(jnp.argmax(logits[row])))
    return [seq[len(prompt):] for seq, prompt in zip(sequences, PROMPTS)]


def _assert_exact(model, prompts, result, reference):
    def logits_at(prompt, generated):
        def at(step):
            sequence = jnp.asarray([prompt + generated[:step]], jnp.int32)
            logits, _, _ = forward(model.params, model.config, sequence, Qwen35Cache.create(model.config, 1, 96))
            return logits[0, -1]
        return at

    for row, prompt in enumerate(prompts):
        assert_same_greedy(result.tokens[row], reference[row], logits_at(prompt, reference[row]))
    assert result.finish_reason == ["length"] * len(prompts)


def test_plain_loop_equals_token_by_token_greedy(hybrid, reference):
    result = jaxspec.generate(hybrid, None, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    _assert_exact(hybrid, PROMPTS, result, reference)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("method", ["ngram", "layer_skip"])
def test_speculative_greedy_equals_plain_greedy_ragged(hybrid, reference, method, k):
    result = jaxspec.generate(hybrid, prompt=PROMPTS, method=method, num_draft_tokens=k,
                              max_new_tokens=NEW_TOKENS, ignore_eos=True)
    _assert_exact(hybrid, PROMPTS, result, reference)
    stats = result.stats
    assert stats.method == method and 0 <= stats.accepted <= stats.proposed <= k * stats.rounds
    if method == "layer_skip":  # the draft (one DeltaNet layer) drafts every round
        assert stats.proposed == k * stats.rounds


def _hybrid_draft(method: str):
    """Random drafts for the hybrid: a separate Llama-family model of the same vocabulary, an
    EAGLE-3 head reading hybrid layers' streams (the embedding output, then after the DeltaNet
    layer twice: aux ids are input-of-layer), and an MTP head reading the final-normed stream."""
    from jaxspec.models import eagle3, llama, mtp
    from tests.conftest import TINY

    key = jax.random.PRNGKey(7)
    if method == "draft":
        return jaxspec.Model(config=TINY, params=llama.init_params(TINY, key, 0.2))
    if method == "eagle3":
        cfg = eagle3.Eagle3Config(dim=SPEC_CFG.dim, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=96,
                                  draft_vocab_size=96, vocab_size=SPEC_CFG.vocab_size, rope_theta=10000.0,
                                  rotary_dim=16, norm_eps=1e-6, max_position_embeddings=256, aux_layer_ids=(0, 1, 1))
        return jaxspec.Model(config=cfg, params=eagle3.init_params(cfg, key))
    block = dataclasses.replace(TINY, dim=SPEC_CFG.dim, num_layers=1, vocab_size=SPEC_CFG.vocab_size)
    cfg = mtp.MtpConfig(block=block)
    return jaxspec.Model(config=cfg, params=mtp.init_params(cfg, key))


@pytest.mark.parametrize("method", ["draft", "eagle3", "mtp"])
def test_draft_models_and_heads_on_the_hybrid_equal_plain_greedy(hybrid, reference, method):
    result = jaxspec.generate(hybrid, _hybrid_draft(method), PROMPTS, num_draft_tokens=3,
                              max_new_tokens=NEW_TOKENS, ignore_eos=True)
    _assert_exact(hybrid, PROMPTS, result, reference)
    assert result.stats.method == method and result.stats.proposed == 3 * result.stats.rounds


@pytest.mark.parametrize("method, k, recorded_steps", [("ngram", 4, 16), ("layer_skip", 1, 16), ("layer_skip", 4, 2)])
def test_speculative_greedy_equals_plain_greedy_batch_of_one(hybrid, reference, method, k, recorded_steps):
    """recorded_steps=2: the target's T = 5 verify records per-position inputs only (the commit
    recomputes), while the layer-skip draft's T <= 2 forwards record every state, as its
    rollback needs."""
    model = jaxspec.Model(config=dataclasses.replace(SPEC_CFG, recorded_steps=recorded_steps), params=hybrid.params)
    result = jaxspec.generate(model, prompt=PROMPTS[0], method=method, num_draft_tokens=k,
                              max_new_tokens=NEW_TOKENS, ignore_eos=True)
    _assert_exact(hybrid, PROMPTS[:1], result, reference)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScriptedDrafts:
    """Drafts the true greedy continuation (from `draft_params`: each row's prompt + plain greedy
    output), corrupted by a fixed schedule over rounds: all right (the round accepts all k), the
    first one wrong (rejects at once), the first two right, then wrong (accepts 2 of k)."""

    num_draft: int
    name: str = "scripted"
    target_hidden_layers: tuple[int, ...] = ()
    tree: None = None
    can_abstain: bool = False
    context_limit: None = None
    schedule: tuple[int, ...] = (4, 0, 2)  # drafts right per round, cycled

    def init(self, draft_params, *args, **kwargs):  # works with either init signature
        return jnp.zeros((draft_params.shape[0],), jnp.int32)

    def update(self, draft_params, state, *args, **kwargs):
        return state + 1

    def propose(self, draft_params, round_index, context):
        k = self.num_draft
        at = jnp.clip(context.length[:, None] + jnp.arange(k)[None, :], 0, draft_params.shape[1] - 1)
        truth = jnp.take_along_axis(draft_params, at, axis=1)
        right = jnp.asarray(self.schedule, jnp.int32)[round_index % len(self.schedule)]
        drafts = jnp.where(jnp.arange(k)[None, :] < right[:, None], truth, (truth + 1) % SPEC_CFG.vocab_size)
        proposal = Proposal(drafts=drafts, num_proposed=jnp.full_like(right, k))
        return proposal, round_index


def test_rounds_rejecting_first_partial_and_all_keep_the_exact_state(hybrid, reference):
    batch, k, new = len(PROMPTS), 4, NEW_TOKENS
    capacity = 64
    truth = np.zeros((batch, capacity), np.int32)
    prompt = np.zeros((batch, 32), np.int32)
    for row, ids in enumerate(PROMPTS):
        full = ids + reference[row]
        truth[row, :len(full)] = full
        prompt[row, :len(ids)] = ids
    # recorded_steps=0: every verify records per-position inputs and the commit recomputes the
    # accepted state (the default, recording every state, runs in the tests above).
    cfg = dataclasses.replace(SPEC_CFG, recorded_steps=0)
    spec = loop.LoopSpec(cfg=cfg, capacity=capacity, sampler=spec_for(temperature=0.0),
                         proposer=ScriptedDrafts(num_draft=k))
    request = loop.Request(prompt=jnp.asarray(prompt), prompt_length=jnp.asarray([len(p) for p in PROMPTS], jnp.int32),
                           max_new_tokens=jnp.full((batch,), new, jnp.int32),
                           sampling=SamplingParams.create(batch, temperature=0.0), key=jax.random.PRNGKey(0))
    draft_params = jnp.asarray(truth)
    state = loop.decode_jit(hybrid.params, draft_params, loop.prefill_jit(hybrid.params, draft_params, request, spec=spec),
                            request, spec=spec)
    tokens = np.asarray(state.tokens)
    for row, ids in enumerate(PROMPTS):
        assert tokens[row, len(ids): len(ids) + new].tolist() == reference[row]
    stats = jax.device_get(state.stats)
    # Rounds accept as scripted (4, then 0, then 2, cycled), except each row's last round, whose
    # drafts run past the known continuation.
    schedule = np.asarray(ScriptedDrafts(num_draft=k).schedule)
    for row in range(batch):
        scripted = schedule[np.arange(stats.rounds[row] - 1) % len(schedule)]
        assert len(scripted) >= 6  # every kind of round happened, twice
        assert scripted.sum() <= stats.accepted[row] <= scripted.sum() + k
        assert 0 <= stats.multi_token_rounds[row] - np.count_nonzero(scripted) <= 1


# ----------------------------------------------------------------------------------------------
# Speculative sampling on the hybrid: lossless
# ----------------------------------------------------------------------------------------------

SMALL_HYBRID = Qwen35Config(vocab_size=12, dim=32, num_layers=2, layer_types=(LIN, FULL), ffn_dim=48, num_heads=2,
                            num_kv_heads=1, head_dim=16, rotary_dim=4, rope_theta=10000.0, linear_num_key_heads=1,
                            linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                            max_position_embeddings=64, rollback_states=3)  # k = 2 drafts: R = k + 1


@pytest.fixture(scope="module")
def small_hybrid():
    return jaxspec.Model(config=SMALL_HYBRID, params=qwen35.init_params(SMALL_HYBRID, jax.random.PRNGKey(0), 0.5))


def exact_joint(model, settings) -> np.ndarray:
    """p(t1, t2, t3 | PROMPT) under the processed distribution, by enumeration: [V, V, V].

    Every continuation in one forward: sequences right-padded to PROMPT + 2, logits taken at
    each one's last token (the trunk is causal, so padding after it changes nothing).
    """
    V = model.config.vocab_size
    spec = spec_for(**settings)
    sequences = [PROMPT] + [PROMPT + [a] for a in range(V)] + [PROMPT + [a, b] for a in range(V) for b in range(V)]
    width = len(PROMPT) + 2
    tokens = np.zeros((len(sequences), width), np.int32)
    seen = np.zeros((len(sequences), V), bool)
    for i, sequence in enumerate(sequences):
        tokens[i, : len(sequence)] = sequence
        seen[i, sequence] = True
    last = jnp.asarray([[len(s) - 1] for s in sequences], jnp.int32)
    logits, _, _ = forward(model.params, model.config, jnp.asarray(tokens),
                           Qwen35Cache.create(model.config, len(sequences), 16), logit_indices=last)
    params = SamplingParams.create(len(sequences), **settings)
    probs = np.asarray(distribution(logits[:, 0], params, spec, jnp.asarray(seen)), np.float64)
    p1, p2, p3 = probs[0], probs[1: 1 + V], probs[1 + V:].reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def test_speculative_sampling_on_the_hybrid_is_lossless(small_hybrid):
    """Layer-skip on the hybrid: drafts sampled from a one-DeltaNet-layer draft whose state is
    rolled back every round, verified by rejection sampling; 20k samples against enumeration."""
    settings = dict(temperature=0.9)
    counts, stats = sampled_joint(small_hybrid, None, settings, method="layer_skip", exit_layer=1)
    p_value = chi_square_p_value(counts, exact_joint(small_hybrid, settings))
    assert p_value > SIGNIFICANCE, f"speculative samples differ from the target's distribution: p = {p_value:.2e}"
    assert stats.rounds > 0 and 0 < stats.accepted <= stats.proposed


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------

TEXT_CONFIG = dict(model_type="qwen3_5_text", vocab_size=64, hidden_size=32, intermediate_size=48,
                   num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                   linear_value_head_dim=8)


def test_config_defaults_follow_transformers():
    import transformers

    cfg = qwen35.config_from_hf(TEXT_CONFIG)
    reference = transformers.Qwen3_5TextConfig(**{k: v for k, v in TEXT_CONFIG.items() if k != "model_type"})
    assert [t.value for t in cfg.layer_types] == reference.layer_types
    assert cfg.rotary_dim == int(16 * reference.rope_parameters["partial_rotary_factor"]) == 4
    assert cfg.linear_conv_kernel == reference.linear_conv_kernel_dim


@pytest.mark.parametrize("change, field", [
    (dict(layer_types=["linear_attention", "full_attention"]), "layer_types"),
    (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), r"layer_types\[3\]"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(num_experts=8), "num_experts"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0)), "rope_type"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(linear_num_key_heads=None), "linear_num_key_heads"),
])
def test_bad_configs_name_the_field(change, field):
    config = {**TEXT_CONFIG, **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(UnsupportedModelError, match=field):
        qwen35.config_from_hf(config)


def test_vision_language_config_needs_its_text_config():
    with pytest.raises(UnsupportedModelError, match="text_config"):
        qwen35.config_from_hf({"model_type": "qwen3_5"})


def test_config_dataclass_checks_the_layer_pattern():
    with pytest.raises(UnsupportedModelError, match="layer_types has 1 entries but num_layers is 2"):
        dataclasses.replace(SPEC_CFG, layer_types=(LIN,))
    with pytest.raises(UnsupportedModelError, match="rollback_states"):
        dataclasses.replace(SPEC_CFG, rollback_states=0)
    # A layer-skip draft is the same config with fewer layers: the pattern is cut to fit.
    assert dataclasses.replace(SPEC_CFG, num_layers=1).layer_types == (LIN,)


@pytest.mark.parametrize("missing, message", [
    ("model.layers.1.linear_attn.A_log", "'model.layers.1.linear_attn.A_log' .layer 1 is linear_attention"),
    ("model.layers.0.linear_attn.conv1d.weight", "conv1d.weight"),
    ("model.layers.3.self_attn.q_norm.weight", "q_norm.weight' .layer 3 is full_attention"),
])
def test_missing_tensors_are_named(tmp_path, missing, message):
    write_hf(tmp_path, "interval4-tied-rope0.25")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors[missing]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path)


def test_kv_formats_apply_to_the_attention_layers():
    cache = Qwen35Cache.create(SPEC_CFG, 1, 8, kv_format="bf16")
    assert cache.keys[0].dtype == jnp.bfloat16 and cache.ssm[0].dtype == jnp.float32
    with pytest.raises(UnsupportedModelError, match="head"):  # a block format must tile H = 16
        Qwen35Cache.create(SPEC_CFG, 1, 8, kv_format="q8_0")


def test_params_that_do_not_fit_the_pattern_are_refused(hybrid):
    swapped = dataclasses.replace(SPEC_CFG, layer_types=(FULL, LIN))
    with pytest.raises(UnsupportedModelError, match=r"layer 0 is a DeltaNetLayer, but layer_types\[0\]='full_attention'"):
        qwen35.forward(hybrid.params, swapped, jnp.zeros((1, 1), jnp.int32), Qwen35Cache.create(swapped, 1, 8))
