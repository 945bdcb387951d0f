"""MTP draft heads: parity with transformers' MtpModel and MTP assisted generation, loading both
checkpoint layouts, exact speculative decoding, bad input; and the CLI driving draft heads (MTP
and an EAGLE-3 head directory) on a target that has a tokenizer.

The reference is a tiny random Mellum (JetBrains' architecture, which transformers ships with an
MTP layer) made dense and full-attention, so its layers are Qwen3 layers (QK-norm, SwiGLU): the
target, its MTP head (`mtp.*` tree) and transformers' own `MtpModel.from_pretrained` reading it.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import checkpoints
from jaxspec.cache import KVCache
from jaxspec.models import layers, llama, mtp
from tests.conftest import TINY, max_relative_error

VOCAB = 96
MELLUM = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, layer_types=["full_attention"] * 2, mlp_layer_types=["dense"] * 2,
              num_mtp_layers=1, mtp_layer_types=["full_attention"], mtp_mlp_layer_types=["dense"],
              tie_word_embeddings=False, max_position_embeddings=256, eos_token_id=None)
SEQUENCE = [5, 17, 42, 8, 91, 33, 60, 2, 77, 14, 50, 23]
PROMPTS = [[3, 9, 27, 81, 50], [11, 4, 65, 20, 88, 7, 40, 12, 29], [70, 1, 36]]

# The trunk's and the head's forwards jitted once for the module (eager, each op compiles alone:
# ~300 compiles a test).
_llama_forward = jax.jit(llama.forward, static_argnums=1, static_argnames=("hidden_layers",))
_mtp_forward = jax.jit(mtp.forward, static_argnums=1)

# transformers' MtpModel names -> the Mellum / Qwen3-Next checkpoint layout (the `mtp.` tree)
_TO_MTP_TREE = {"layers.0.enorm.": "mtp.pre_fc_norm_embedding.", "layers.0.hnorm.": "mtp.pre_fc_norm_hidden.",
                "layers.0.eh_proj.": "mtp.fc.", "layers.0.post_norm.": "mtp.norm.",
                "layers.0.mtp_block.": "mtp.layers.0."}


def _checkpoint_name(name: str) -> str:
    for ours, theirs in _TO_MTP_TREE.items():
        if name.startswith(ours):
            return theirs + name[len(ours):]
    raise AssertionError(name)


def _word_tokenizer(directory) -> None:
    """A word-level tokenizer over the tiny vocabulary ("w0" .. "w95"), for the CLI."""
    import tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.decoder = tokenizers.decoders.WordPiece()
    tokenizer.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def mellum_dir(tmp_path_factory):
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    directory = tmp_path_factory.mktemp("mellum_mtp")
    torch.manual_seed(0)
    model = transformers.MellumForCausalLM(transformers.MellumConfig(**MELLUM)).eval()
    head = MtpModel(model, 1).eval()
    with torch.no_grad():  # weights large enough that logits are far from uniform
        for module in (model, head):
            for name, param in module.named_parameters():
                if "shared_head" in name or name.startswith("embed_tokens"):
                    continue  # the target's own, tied into the head
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.2 * torch.randn_like(param))
                else:
                    param.normal_(0.0, 1.2 / param.shape[-1] ** 0.5)
    model.save_pretrained(directory)
    weights = directory / "model.safetensors"
    tensors = load_file(weights)
    for name, value in head.state_dict().items():
        if not name.startswith(("embed_tokens", "shared_head")):
            tensors[_checkpoint_name(name)] = value.contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    _word_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def hf_models(mellum_dir):
    """The target and transformers' own reading of its MTP head from the checkpoint."""
    import transformers
    from transformers.modeling_layers import MtpModel

    model = transformers.MellumForCausalLM.from_pretrained(mellum_dir).eval()
    return model, MtpModel.from_pretrained(model).eval()


@pytest.fixture(scope="module")
def target(mellum_dir):
    return jaxspec.load(mellum_dir)


@pytest.fixture(scope="module")
def head(mellum_dir):
    return jaxspec.load_mtp(mellum_dir)


def test_mellum_trunk_matches_transformers(hf_models, target):
    import torch

    model, _ = hf_models
    assert target.config.qk_norm and target.config.rope_theta == 500000.0
    with torch.no_grad():
        expected = model(torch.tensor([SEQUENCE])).logits.numpy()
    logits, _, _ = _llama_forward(target.params, target.config, jnp.asarray([SEQUENCE]),
                                  KVCache.create(target.config, 1, 32))
    assert max_relative_error(logits, expected) <= 1e-4


def test_head_weights_are_what_transformers_reads(hf_models, head):
    """Our reading of the `mtp.` tree and MtpModel.from_pretrained's agree tensor for tensor."""
    _, hf_head = hf_models
    state = {name: value.numpy() for name, value in hf_head.state_dict().items()}
    layer = "layers.0."
    ours = mtp.named_leaves(head.params, head.config)
    for name in ("enorm", "hnorm", "eh_proj", "post_norm"):
        np.testing.assert_array_equal(np.asarray(ours[name]), state[f"{layer}{name}.weight"])
    block = {name.removeprefix("block."): value for name, value in ours.items() if name.startswith("block.")}
    assert block  # attention, QK-norm and MLP, each compared below
    for key, value in block.items():
        np.testing.assert_array_equal(np.asarray(value), state[f"{layer}mtp_block.{llama.HF_NAMES[key]}"])
    assert head.config.num_checkpoint_layers == 1 and not head.config.hidden_first


def test_head_logits_match_mtp_model_over_chained_steps(hf_models, target, head):
    """Teacher-forced pairs (h_p, token p + 1) over a sequence, then two steps chained on the
    head's own output: draft logits within 1e-4 of transformers' MtpModel, the same tokens."""
    import torch
    from transformers.cache_utils import MtpCache

    model, hf_head = hf_models
    n = len(SEQUENCE)
    ids = torch.tensor([SEQUENCE])
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
        cache = MtpCache(config=model.config.get_mtp_config())
        out = hf_head.forward_layer(0, hidden[:, :-1], torch.arange(1, n)[None], cache, input_ids=ids[:, 1:])
        expected = [hf_head._project_to_logits(out)[0].numpy()]
        h, token = out[:, -1:], expected[0][-1].argmax()
        for step in range(2):  # chained: the head's own output and its own draft
            h = hf_head.forward_layer(0, h, torch.tensor([[n + step]]), cache, input_ids=torch.tensor([[token]]))
            expected.append(hf_head._project_to_logits(h)[0].numpy())
            token = expected[-1][-1].argmax()

    cfg = target.config
    _, (features,), _ = _llama_forward(target.params, cfg, jnp.asarray([SEQUENCE]), KVCache.create(cfg, 1, 32),
                                       hidden_layers=(cfg.num_layers,))
    np.testing.assert_allclose(features, hidden.numpy(), rtol=1e-4, atol=1e-5)
    embed, lm_head = target.params.embed, target.params.lm_head
    cache = mtp.create_cache(head.config, 1, 32)
    logits, g, cache = _mtp_forward(head.params, head.config, embed, lm_head, jnp.asarray([SEQUENCE[1:]]),
                                    features[:, :-1], cache)
    ours = [logits[0]]
    cache = cache.advance(jnp.array([n - 1]))
    g, token = g[:, -1:], int(jnp.argmax(logits[0, -1]))
    for _ in range(2):
        logits, g, cache = _mtp_forward(head.params, head.config, embed, lm_head, jnp.array([[token]]), g, cache)
        cache = cache.advance(jnp.array([1]))
        ours.append(logits[0])
        token = int(jnp.argmax(logits[0, -1]))
    for mine, theirs in zip(ours, expected):
        assert max_relative_error(mine, theirs) <= 1e-4
        np.testing.assert_array_equal(np.argmax(mine, -1), np.argmax(theirs, -1))


def test_transformers_mtp_generation_proposes_what_jaxspec_proposes(hf_models, target, head, monkeypatch):
    """transformers' own MTP assisted generation (MTPCandidateGenerator, one draft per round):
    its output is plain greedy, each candidate is the argmax our head gives at that position, and
    jaxspec's MTP run at k = 1 accepts exactly as many drafts."""
    import torch
    from transformers.generation import candidate_generator

    model, _ = hf_models
    proposals = []  # (context length, candidate)
    original = candidate_generator.MTPCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        candidates, logits = original(self, input_ids, *args, **kwargs)
        if candidates.shape[1] > input_ids.shape[1]:
            proposals.append((input_ids.shape[1], int(candidates[0, -1])))
        return candidates, logits

    monkeypatch.setattr(candidate_generator.MTPCandidateGenerator, "get_candidates", recording)
    prompt = PROMPTS[1]
    with torch.no_grad():
        hf_out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=16, min_new_tokens=16, do_sample=False, use_mtp=True)
    hf_tokens = hf_out[0, len(prompt):].tolist()
    plain = jaxspec.generate(target, prompt=prompt, max_new_tokens=16, ignore_eos=True)
    assert hf_tokens == plain.tokens[0]
    assert proposals

    sequence = prompt + plain.tokens[0]
    cfg = target.config
    _, (features,), _ = _llama_forward(target.params, cfg, jnp.asarray([sequence]), KVCache.create(cfg, 1, 64),
                                       hidden_layers=(cfg.num_layers,))
    logits, _, _ = _mtp_forward(head.params, head.config, target.params.embed, target.params.lm_head,
                                jnp.asarray([sequence[1:]]), features[:, :-1], mtp.create_cache(head.config, 1, 64))
    teacher_forced = np.asarray(jnp.argmax(logits[0], -1))  # [n - 1]: the draft for token p + 2
    for length, candidate in proposals:
        assert candidate == teacher_forced[length - 2], length
    hf_accepted = sum(candidate == sequence[length] for length, candidate in proposals if length < len(sequence))

    spec = jaxspec.generate(target, head, prompt, max_new_tokens=16, ignore_eos=True, num_draft_tokens=1)
    assert spec.tokens == plain.tokens and spec.stats.method == "mtp"
    assert spec.stats.accepted == hf_accepted


@pytest.mark.parametrize("k", [1, 4])  # one draft, and the head chained on its own hidden
def test_mtp_speculation_equals_plain_greedy(target, head, k):
    plain = jaxspec.generate(target, prompt=PROMPTS, max_new_tokens=24, ignore_eos=True)
    spec = jaxspec.generate(target, head, PROMPTS, max_new_tokens=24, ignore_eos=True, num_draft_tokens=k)
    assert spec.tokens == plain.tokens
    assert spec.stats.method == "mtp" and spec.stats.proposed > 0
    if k > 1:
        single = jaxspec.generate(target, head, PROMPTS[2], max_new_tokens=24, ignore_eos=True, num_draft_tokens=k)
        assert single.tokens[0] == plain.tokens[2]


def test_random_head_on_a_llama_target(tiny_model):
    """A head built from a config (no checkpoint) on a Llama target: exact, method inferred."""
    cfg = mtp.MtpConfig(block=tiny_model.config)
    head = jaxspec.Model(config=cfg, params=mtp.init_params(cfg, jax.random.PRNGKey(3)))
    plain = jaxspec.generate(tiny_model, prompt=PROMPTS[:2], max_new_tokens=16, ignore_eos=True)
    spec = jaxspec.generate(tiny_model, head, PROMPTS[:2], max_new_tokens=16, ignore_eos=True, num_draft_tokens=3)
    assert spec.tokens == plain.tokens
    assert spec.stats.method == "mtp"


def test_deepseek_layout_reads_the_same_head(mellum_dir, head, tmp_path):
    """`model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm,<block>}` (DeepSeek-V3, GLM)."""
    from safetensors.numpy import load_file, save_file

    copy = tmp_path / "deepseek_layout"
    shutil.copytree(mellum_dir, copy)
    tensors = load_file(copy / "model.safetensors")
    renamed = {}
    for name, value in tensors.items():
        for theirs, ours in (("mtp.pre_fc_norm_embedding.", "enorm."), ("mtp.pre_fc_norm_hidden.", "hnorm."),
                             ("mtp.fc.", "eh_proj."), ("mtp.norm.", "shared_head.norm."), ("mtp.layers.0.", "")):
            if name.startswith(theirs):
                name = "model.layers.2." + ours + name[len(theirs):]
                break
        renamed[name] = value
    save_file(renamed, copy / "model.safetensors")
    cfg, params = checkpoints.load_mtp(copy)
    assert cfg == head.config
    jax.tree.map(np.testing.assert_array_equal, layers.fuse_projections(params), head.params)


def _edit(mellum_dir, tmp_path, *, config=None, tensors=None):
    from safetensors.numpy import load_file, save_file

    copy = tmp_path / "edited"
    shutil.copytree(mellum_dir, copy)
    if config:
        hf = json.loads((copy / "config.json").read_text())
        config(hf)
        (copy / "config.json").write_text(json.dumps(hf))
    if tensors:
        state = load_file(copy / "model.safetensors")
        tensors(state)
        save_file(state, copy / "model.safetensors")
    return copy


@pytest.mark.parametrize(
    "config, tensors, error, message",
    [
        (None, lambda s: s.pop("mtp.fc.weight"), jaxspec.CheckpointError, "holds none of"),
        (None, lambda s: s.pop("mtp.layers.0.self_attn.k_norm.weight"), jaxspec.CheckpointError,
         "lacks MTP tensor 'mtp.layers.0.self_attn.k_norm.weight'"),
        (None, lambda s: s.update({"mtp.norm.weight": np.ones(64, np.int32)}), jaxspec.CheckpointError,
         "'mtp.norm.weight' in .* is stored as I32; a weight is a float type"),
        (None, lambda s: s.update({"mtp.fc.weight": np.zeros((64, 64), np.float32)}), jaxspec.CheckpointError,
         r"'mtp.fc.weight' has shape \(64, 64\), the config implies \(64, 128\)"),
        (lambda hf: hf.update(mtp_mlp_layer_types=["sparse"]), None, jaxspec.UnsupportedModelError,
         "dense MTP blocks only"),
        (lambda hf: hf.pop("num_nextn_predict_layers"), None, jaxspec.InvalidRequestError, "carries no MTP head"),
    ],
)
def test_bad_mtp_checkpoints(mellum_dir, tmp_path, config, tensors, error, message):
    with pytest.raises(error, match=message):
        jaxspec.load_mtp(_edit(mellum_dir, tmp_path, config=config, tensors=tensors))


def test_sliding_window_head_refuses_contexts_past_its_window(mellum_dir, tmp_path, target):
    edited = _edit(mellum_dir, tmp_path, config=lambda hf: hf.update(mtp_layer_types=["sliding_attention"],
                                                                     sliding_window=24))
    head = jaxspec.load_mtp(edited)
    assert head.config.block.max_position_embeddings == 24
    assert head.config.block.rope_theta == 10000.0  # the sliding layers' own RoPE
    for lookup_first in (None, 2):  # the bound is the head's, also with a prompt lookup in front of it
        with pytest.raises(jaxspec.InvalidRequestError, match="exceeds the MTP head's context of 24"):
            jaxspec.generate(target, head, PROMPTS[0], max_new_tokens=20, lookup_first=lookup_first)


def test_mtp_head_of_another_model_is_refused(target):
    cfg = mtp.MtpConfig(block=TINY)  # hidden size 64 vs TINY's
    head = jaxspec.Model(config=cfg, params=mtp.init_params(cfg, jax.random.PRNGKey(0)))
    message = "hidden_size" if TINY.dim != target.config.dim else "vocabulary"
    with pytest.raises(jaxspec.InvalidRequestError, match=f"the MTP head's {message}"):
        jaxspec.generate(target, head, PROMPTS[0], max_new_tokens=4)
    with pytest.raises(jaxspec.InvalidRequestError, match="needs draft_params: an MTP head"):
        jaxspec.generate(target, target, PROMPTS[0], method="mtp", max_new_tokens=4)


def test_cli_mtp_uses_the_models_own_head(mellum_dir, target, capsys):
    """`--method mtp` without --draft: the head the model's own checkpoint carries (the API's
    default for method='mtp'); the streamed text is plain greedy's."""
    from jaxspec import cli

    prompt = " ".join(f"w{i}" for i in PROMPTS[1])
    assert cli.main(["generate", prompt, "--model", str(mellum_dir), "--method", "mtp", "-k", "2",
                     "--max-new-tokens", "6", "--no-chat"]) == 0
    out, err = capsys.readouterr()
    assert "mtp k=2: tau" in err
    plain = jaxspec.generate(target, prompt=prompt, max_new_tokens=6, chat=False)
    assert plain.text[0].strip() and out.strip() == plain.text[0].strip()


def test_cli_eagle3_head_directory(mellum_dir, target, tmp_path, capsys):
    """`--draft HEAD_DIR` with an EAGLE-3 checkpoint: the method is inferred from the directory,
    the output is plain greedy's (this target has a tokenizer, so the CLI path runs whole)."""
    from jaxspec import cli
    from jaxspec.models import eagle3

    cfg = eagle3.Eagle3Config(dim=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=128, draft_vocab_size=64,
                              vocab_size=VOCAB, rope_theta=10000.0, rotary_dim=16, norm_eps=1e-6,
                              max_position_embeddings=256, aux_layer_ids=(0, 1, 1))
    checkpoints.save_eagle3(tmp_path / "head", cfg, eagle3.init_params(cfg, jax.random.PRNGKey(5)))
    prompt = " ".join(f"w{i}" for i in PROMPTS[0])
    assert cli.main(["generate", prompt, "--model", str(mellum_dir), "--draft", str(tmp_path / "head"), "-k", "3",
                     "--max-new-tokens", "6", "--no-chat"]) == 0
    out, err = capsys.readouterr()
    assert "eagle3 k=3: tau" in err
    plain = jaxspec.generate(target, prompt=prompt, max_new_tokens=6, chat=False)
    assert plain.text[0].strip() and out.strip() == plain.text[0].strip()
