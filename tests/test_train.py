"""Head training (jaxspec.train): data, draft vocabulary, the unrolled loss, checkpoints, resume.

The main proof is a self-consistent toy: a target whose next token is a fixed function of the
current one, (t + 1) mod 64. A head trained on that target's own answers must learn the rule, so
it should draft nearly every token: tau close to k + 1, and speculative output == plain greedy.
One EAGLE-3 run is shared by the module (a jit compile costs more than the training itself).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import cli, train
from jaxspec.config import ModelConfig
from jaxspec.models import eagle3, llama

# TINY's shapes, no EOS: every answer runs to its full length.
TOY = ModelConfig(vocab_size=128, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=96,
                  rotary_dim=16, max_position_embeddings=256)
CYCLE = 64  # the toy's next token is (t + 1) mod CYCLE, whatever the context
ANSWER = 20
SEQ_LEN = 24
EAGLE3_RUN = train.TrainConfig(steps=60, batch_size=8, learning_rate=1e-2, warmup_steps=5, draft_vocab_size=96,
                               val_fraction=0.2, eval_every=60, save_every=1000)


def successor_target() -> jaxspec.Model:
    """Attention and MLP outputs zeroed, so the residual stream is the token's embedding; the
    lm_head row of (t + 1) mod 64 is t's embedding, so greedy decoding counts up modulo 64.
    Drawn with numpy: jax.random would compile for longer than the whole training run."""
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda key: llama.init_params(TOY, key), jax.random.PRNGKey(0))
    params = jax.tree.map(lambda leaf: (0.2 * rng.standard_normal(leaf.shape)).astype(np.float32), shapes)
    ones = np.ones(TOY.dim, np.float32)
    layers = tuple(
        dataclasses.replace(
            layer, attn_norm=ones, mlp_norm=ones,
            attention=dataclasses.replace(layer.attention, o_proj=np.zeros_like(layer.attention.o_proj)),
            mlp=dataclasses.replace(layer.mlp, down_proj=np.zeros_like(layer.mlp.down_proj)))
        for layer in params.layers)
    embed = rng.standard_normal((TOY.vocab_size, TOY.dim)).astype(np.float32)
    successor = (np.arange(TOY.vocab_size) + 1) % CYCLE
    lm_head = np.zeros_like(embed)
    np.add.at(lm_head, successor, embed)
    params = dataclasses.replace(params, layers=layers, final_norm=ones, embed=embed, lm_head=lm_head)
    return jaxspec.Model(config=TOY, params=jax.tree.map(jnp.asarray, params))


@pytest.fixture(scope="module")
def toy():
    target = successor_target()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TOY.vocab_size, rng.integers(3, 9)).tolist() for _ in range(40)]
    examples = train.self_distill(target, prompts, ANSWER, batch_size=len(prompts))
    return target, prompts, examples, train.pack(examples, SEQ_LEN)


@pytest.fixture(scope="module")
def eagle3_run(toy, tmp_path_factory):
    target, _, _, data = toy
    out = tmp_path_factory.mktemp("eagle3_run")
    return train.train(target, data, out, EAGLE3_RUN, progress=False), out


# ------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------

def test_self_distill_answers_with_the_targets_greedy_tokens(toy):
    _, prompts, examples, data = toy
    for prompt, example in zip(prompts, examples):
        assert example.tokens[: example.prompt_length] == tuple(prompt)
        answer = example.tokens[example.prompt_length:]
        assert len(answer) == ANSWER
        expected = [(prompt[-1] + 1 + i) % CYCLE for i in range(ANSWER)]
        assert list(answer) == expected
    assert data.tokens.shape == (len(prompts), SEQ_LEN)
    assert data.lengths.tolist() == [min(len(p) + ANSWER, SEQ_LEN) for p in prompts]


def test_pack_and_response_mask():
    examples = [train.Example(tokens=(5, 6, 7, 8, 9), prompt_length=2),  # fits
                train.Example(tokens=(1, 2, 3, 4, 5, 6, 7), prompt_length=3),  # truncated to 6
                train.Example(tokens=(1, 2, 3, 4, 5, 6, 7), prompt_length=6)]  # prompt fills it: dropped
    data = train.pack(examples, 6)
    np.testing.assert_array_equal(data.tokens, [[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(data.lengths, [5, 6])
    # Position t counts when its next token is an answer token: prompt_length - 1 <= t < length - 1.
    mask = train.response_mask(jnp.asarray(data.lengths), jnp.asarray(data.prompt_lengths), 6)
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0]])
    with pytest.raises(jaxspec.InvalidRequestError, match="no example has a response token"):
        train.pack(examples[2:], 6)


def test_target_batch_features_labels_and_mask(toy):
    """The toy's every layer passes the embedding through, and its argmax is the successor."""
    target, _, _, data = toy
    head_cfg = train.eagle3_config_for(TOY, 96)
    assert head_cfg.aux_layer_ids == (0, 1, 1)  # (2, L // 2, L - 3) does not fit L = 2
    layers = eagle3.target_hidden_layers(head_cfg.aux_layer_ids)
    batch = data.batch(list(range(8)))  # the training batch shape: the compiled program is reused
    out = train.target_batch(target.params, TOY, layers, batch)
    embedded = np.asarray(target.params.embed)[np.asarray(batch["tokens"])]
    for feature in out["features"]:
        np.testing.assert_allclose(feature, embedded, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out["labels"], (np.asarray(batch["tokens"]) + 1) % CYCLE)
    expected_mask = train.response_mask(batch["lengths"], batch["prompt_lengths"], SEQ_LEN)
    np.testing.assert_array_equal(out["loss_mask"], expected_mask)


def test_feature_cache_holds_the_targets_half_and_is_built_once(toy, tmp_path):
    """Chunks of the target's features (float16) and argmax labels, equal to a fresh target pass;
    complete chunks are reused, a missing one is rebuilt alone, other layers rebuild all."""
    target, _, _, data = toy
    layers = eagle3.target_hidden_layers((0, 1, 1))
    directory = tmp_path / "features"
    cache = train.cache_features(target, data, layers, directory, batch_size=8, chunk_rows=16)
    assert len(cache.features) == 3 and cache.features[2].shape == (len(data) - 32, 3, SEQ_LEN, TOY.dim)
    assert cache.features[0].dtype == np.float16 and cache.labels[0].dtype == np.int32
    rows = np.asarray([0, 17, 39, 5, -1, 33, 12, 20])  # across chunks, one empty row
    fresh = train.target_batch(target.params, TOY, layers, data.batch(rows))
    features, labels = cache.rows(rows)
    for i, feature in enumerate(fresh["features"]):
        # float16 keeps 11 significant bits: relative error <= 2^-11 of each value.
        np.testing.assert_allclose(features[:, i], np.where(rows[:, None, None] < 0, 0, feature), rtol=2 ** -11, atol=1e-6)
    np.testing.assert_array_equal(labels, np.where(rows[:, None] < 0, 0, fresh["labels"]))

    stamps = {p.name: p.stat().st_mtime_ns for p in directory.glob("*.npy")}
    (directory / "labels_00001.npy").unlink()  # an interrupted build
    again = train.cache_features(target, data, layers, directory, batch_size=8, chunk_rows=16)
    after = {p.name: p.stat().st_mtime_ns for p in directory.glob("*.npy")}
    assert {name for name in stamps if after[name] != stamps[name]} <= {"features_00001.npy", "labels_00001.npy"}
    assert after["features_00000.npy"] == stamps["features_00000.npy"]
    np.testing.assert_array_equal(again.rows(rows)[1], labels)
    stamps = {p.name: p.stat().st_mtime_ns for p in directory.glob("*.npy")}
    subset = train.cache_features(target, data, layers[:1], directory, batch_size=8, chunk_rows=32)
    assert stamps == {p.name: p.stat().st_mtime_ns for p in directory.glob("*.npy")}  # read out of the cache
    np.testing.assert_array_equal(subset.rows(rows, layers[:1])[0], features[:, :1])
    other = train.cache_features(target, data, (TOY.num_layers,), directory, batch_size=8, chunk_rows=16)
    assert other.layers == (TOY.num_layers,) and other.features[0].shape[1] == 1  # rebuilt, not misread
    with pytest.raises(jaxspec.InvalidRequestError, match="multiple of batch_size"):
        train.cache_features(target, data, layers, directory, batch_size=8, chunk_rows=12)


def test_self_instruct_needs_a_tokenizer_and_cache_excludes_soft_labels(toy):
    target, _, _, _ = toy
    with pytest.raises(jaxspec.InvalidRequestError, match="needs a tokenizer"):
        train.self_instruct_examples(target, 4, 0)
    with pytest.raises(jaxspec.InvalidRequestError, match="soft_labels needs"):
        train.TrainConfig(soft_labels=True)
    assert not train.TrainConfig(soft_labels=True, cache_features=False).cache_features


def test_batch_order_depends_only_on_seed_and_step():
    first = [train.batch_indices(3, step, 4, 10).tolist() for step in range(5)]
    assert first == [train.batch_indices(3, step, 4, 10).tolist() for step in range(5)]
    epoch = sorted(first[0] + first[1] + first[2][:2])  # 10 rows: one epoch covers each once
    assert epoch == list(range(10))
    assert first != [train.batch_indices(4, step, 4, 10).tolist() for step in range(5)]


def test_draft_vocab_picks_the_most_frequent_answer_tokens():
    # Answers (after the 2-token prompts): 7 x3, 2 x2, 9 x1; prompt tokens 4 x2, 5 x1.
    data = train.pack([train.Example(tokens=(4, 5, 7, 7, 2, 9), prompt_length=2),
                       train.Example(tokens=(4, 4, 7, 2), prompt_length=2)], 8)
    vocab = train.draft_vocab(data, vocab_size=12, draft_vocab_size=4)
    # 7, 2, 9 from the answers, then 4 (the commonest prompt token); ascending target ids.
    np.testing.assert_array_equal(vocab.target_ids, [2, 4, 7, 9])
    np.testing.assert_array_equal(vocab.d2t, [2, 3, 5, 6])
    np.testing.assert_array_equal(np.flatnonzero(vocab.t2d), [2, 4, 7, 9])
    np.testing.assert_array_equal(vocab.target_to_draft[[2, 4, 7, 9, 0, 5]], [0, 1, 2, 3, -1, -1])
    d2t = jnp.asarray(vocab.d2t, jnp.int32)
    head = eagle3.params_from(lambda name: d2t if name == "d2t" else None)  # the map reads d2t alone
    mapped = eagle3.to_target_ids(head, jnp.arange(4))
    np.testing.assert_array_equal(mapped, vocab.target_ids)
    # More draft slots than seen tokens: the lowest unused ids fill in.
    np.testing.assert_array_equal(train.draft_vocab(data, 12, 7).target_ids, [0, 1, 2, 4, 5, 7, 9])
    with pytest.raises(jaxspec.InvalidRequestError, match="draft_vocab_size must be an integer in"):
        train.draft_vocab(data, 12, 13)


def test_read_prompts_jsonl(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "hello"}\n\n{"text": "world", "id": 3}\n{"prompt": [5, 6, 7]}\n')
    assert train.read_prompts_jsonl(good) == ["hello", "world", [5, 6, 7]]
    cases = [('{"prompt": "a"}\n{"prompt": "b",}\n', r"bad.jsonl:2: not valid JSON"),
             ('{"prompt": "a"}\n["b"]\n', r"bad.jsonl:2: expected a JSON object"),
             ('{"question": "a"}\n', r'bad.jsonl:1: the object has no "prompt" or "text" field'),
             ('{"prompt": "  "}\n', r"bad.jsonl:1: .* must be a non-empty string"),
             ('\n\n', r"holds no prompts")]
    for content, message in cases:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(content)
        with pytest.raises(jaxspec.InvalidRequestError, match=message):
            train.read_prompts_jsonl(bad)
    with pytest.raises(jaxspec.InvalidRequestError, match="prompt file not found"):
        train.read_prompts_jsonl(tmp_path / "missing.jsonl")


def test_cli_train_head_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    # Checked before any model loads, so a missing model is never reached.
    assert cli.main(["train-head", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "o"),
                     "--prompts", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prompts.jsonl:2: not valid JSON" in err
    assert cli.main(["train-head", "--out", str(tmp_path / "o"), "--steps", "0"]) == 2
    assert "steps must be an integer >= 1" in capsys.readouterr().err
    assert cli.main(["train-head", "--out", str(tmp_path / "o"), "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert cli.main(["train-head", "--out", str(tmp_path / "o"), "--prompts", str(bad), "--data", "d.npz"]) == 2
    assert "--prompts and --data both" in capsys.readouterr().err
    assert cli.main(["train-head", "--out", str(tmp_path / "o"), "--data", str(tmp_path / "none.npz")]) == 2
    assert "not a readable training data file" in capsys.readouterr().err


def test_train_config_rejects_bad_settings():
    for bad, message in [({"batch_size": 0}, "batch_size must be"), ({"learning_rate": -1.0}, "learning_rate must be"),
                         ({"step_decay": 1.5}, "step_decay must be"), ({"method": "medusa"}, "medusa")]:
        with pytest.raises((jaxspec.InvalidRequestError, ValueError), match=message):
            train.TrainConfig(**bad)
    assert train.TrainConfig.from_dict(EAGLE3_RUN.to_dict()) == EAGLE3_RUN


# ------------------------------------------------------------------------------------------
# EAGLE-3: training, the written head, resume
# ------------------------------------------------------------------------------------------

def test_training_lowers_the_loss_and_learns_the_targets_rule(eagle3_run):
    result, _ = eagle3_run
    first, last = result.history[0], result.history[-1]
    assert result.step == EAGLE3_RUN.steps and len(result.history) == EAGLE3_RUN.steps
    assert last["loss"] < 0.05 * first["loss"], (first, last)
    assert last["top1"] > 0.9
    assert result.validation["top1"] > 0.8
    assert all(t > 0.6 for t in result.validation["top1_by_step"])  # deeper unrolled drafts too


def test_written_head_loads_and_drafts_exactly_with_high_acceptance(toy, eagle3_run):
    target, prompts, examples, _ = toy
    result, out = eagle3_run
    head = jaxspec.load(str(out))
    assert head.config == result.head.config and head.config.draft_vocab_size == 96
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), head.params, result.head.params)
    spec = jaxspec.generate(target, head, prompts, max_new_tokens=ANSWER, ignore_eos=True, num_draft_tokens=3)
    # The distilled answers are the target's plain greedy output.
    assert spec.tokens == [list(e.tokens[e.prompt_length:]) for e in examples]
    assert spec.stats.tau > 3.0, spec.stats  # k + 1 = 4 is the ceiling; a random head gets ~1
    stats = train.measure_tau(target, head, prompts, num_draft_tokens=3, max_new_tokens=ANSWER, ignore_eos=True)
    assert stats.tau == spec.stats.tau


def test_resume_continues_the_same_run(toy, eagle3_run, tmp_path):
    target, _, _, data = toy
    uninterrupted, _ = eagle3_run
    partial = train.train(target, data, tmp_path, EAGLE3_RUN, stop_after=25, progress=False)
    assert partial.step == 25 and partial.head_path is None and not (tmp_path / "config.json").exists()
    with pytest.raises(jaxspec.InvalidRequestError, match="already holds a training run"):
        train.train(target, data, tmp_path, EAGLE3_RUN, progress=False)
    other = train.TrainConfig(**{**EAGLE3_RUN.to_dict(), "learning_rate": 1e-4})
    with pytest.raises(jaxspec.InvalidRequestError, match=r"different settings \['learning_rate'\]"):
        train.train(target, data, tmp_path, other, resume=True, progress=False)
    saved_cfg, saved_data = train.saved_run(tmp_path)
    assert saved_cfg == EAGLE3_RUN and saved_data.fingerprint() == data.fingerprint()

    resumed = train.train(target, saved_data, tmp_path, saved_cfg, resume=True, progress=False)
    assert resumed.step == EAGLE3_RUN.steps and resumed.head_path == tmp_path
    assert [h["step"] for h in resumed.history] == list(range(26, EAGLE3_RUN.steps + 1))
    np.testing.assert_allclose([h["loss"] for h in resumed.history],
                               [h["loss"] for h in uninterrupted.history[25:]], rtol=1e-4, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 resumed.head.params, uninterrupted.head.params)


def test_train_head_reuses_distilled_data_and_a_shared_feature_cache(toy, eagle3_run, tmp_path):
    """`data=` skips self-distillation (another run's train_data.npz) and `feature_dir=` reads the
    first run's cache: same data, same settings, so the same head, with no target pass."""
    target, _, _, data = toy
    first, first_dir = eagle3_run
    saved = train.Dataset.load(first_dir / train.DATA_FILE)
    stamps = {p.name: p.stat().st_mtime_ns for p in (first_dir / train.FEATURE_DIR).glob("*.npy")}
    result, stats = train.train_head(target, tmp_path, EAGLE3_RUN, data=saved, tau_prompts=0,
                                     feature_dir=first_dir / train.FEATURE_DIR, head_dtype="bfloat16", progress=False)
    assert stats is None and result.head_path == tmp_path and not (tmp_path / train.FEATURE_DIR).exists()
    assert stamps == {p.name: p.stat().st_mtime_ns for p in (first_dir / train.FEATURE_DIR).glob("*.npy")}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), result.head.params, first.head.params)
    head = jaxspec.load(str(tmp_path))  # written in bfloat16: the same weights, rounded
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2 ** -8, atol=1e-30), head.params, first.head.params)
    with pytest.raises(jaxspec.InvalidRequestError, match="head_dtype must be one of"):
        train.train_head(target, tmp_path / "x", EAGLE3_RUN, data=saved, head_dtype="float16")


# ------------------------------------------------------------------------------------------
# MTP: the same loop with the MTP forward
# ------------------------------------------------------------------------------------------

def test_mtp_head_trains_and_round_trips(toy, tmp_path):
    """The MTP path shares the loop; its drafting in the decode loop is proven in test_mtp.py
    (measured here would cost one more compile of the whole decode program)."""
    target, _, _, data = toy
    cfg = train.TrainConfig(method="mtp", steps=40, batch_size=8, learning_rate=3e-3, warmup_steps=5,
                            val_fraction=0.0, save_every=1000)
    result = train.train(target, data, tmp_path, cfg, progress=False)
    first, last = result.history[0], result.history[-1]
    assert last["loss"] < 0.1 * first["loss"], (first, last)
    assert last["top1"] > 0.9
    assert result.validation is None  # no held-out split asked for
    head = jaxspec.load(str(result.head_path))
    assert head.config == result.head.config and head.config.block.num_layers == 1
    jax.tree.map(np.testing.assert_array_equal, head.params, result.head.params)
    assert jaxspec.load_mtp(str(result.head_path)).config == head.config  # what --method mtp --draft DIR reads
    # A damaged head names what is wrong.
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(result.head_path / "model.safetensors"))
    for damage, message in [(lambda t: t.pop("eh_proj"), "lacks MTP head tensor 'eh_proj'"),
                            (lambda t: t.update(enorm=t["enorm"][:-1]), "'enorm' has shape"),
                            (lambda t: t.update({"block.q_proj": t["block.q_proj"].astype(np.int32)}), "dtype I32")]:
        broken = dict(tensors)
        damage(broken)
        save_file(broken, str(result.head_path / "model.safetensors"))
        with pytest.raises(jaxspec.CheckpointError, match=message):
            jaxspec.load(str(result.head_path))
