"""A training run (jaxspec.train.run): the loop, the written head, resume, train_head, the CLI.

Run in a process of its own by tests/test_train_run.py (see there why); alone:
`python -m pytest tests/train_run_checks.py`.

The main proof is the successor toy (train_fixtures): a head trained on that target's own answers
must learn its rule, so it should draft nearly every token: tau close to k + 1, and speculative
output == plain greedy. One EAGLE-3 run is shared by the module (a jit compile costs more than the
training itself).
"""

from __future__ import annotations

import dataclasses
import json
import signal

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec import checkpoints, cli, compilation, train
from jaxspec.train import run as run_module
from jaxspec.models import layers
from train_fixtures import ANSWER, distilled_toy

EAGLE3_RUN = train.TrainConfig(steps=60, batch_size=8, learning_rate=1e-2, warmup_steps=5, draft_vocab_size=96,
                               val_fraction=0.2, eval_every=60, save_every=1000)


@pytest.fixture(scope="module")
def toy():
    return distilled_toy()


@pytest.fixture(scope="module")
def eagle3_run(toy, tmp_path_factory):
    target, _, _, data = toy
    out = tmp_path_factory.mktemp("eagle3_run")
    return train.train(target, data, out, EAGLE3_RUN, progress=False), out


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
    assert cli.main(["train-head", "--out", str(tmp_path / "o"), "--answer-window", "128"]) == 2
    assert "--answer-window cuts the rows of --data" in capsys.readouterr().err
    assert cli.main(["train-head", "--out", str(tmp_path / "o"), "--data", "d.npz", "--answer-window", "0"]) == 2
    assert "--answer-window must be an integer >= 1; got 0" in capsys.readouterr().err
    assert cli.main(["train-head", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "o"),
                     "--init-from", str(tmp_path)]) == 2  # named before the target loads
    assert f"init_from {tmp_path}: {tmp_path} is not a checkpoint directory" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# EAGLE-3: training, the written head, resume
# ------------------------------------------------------------------------------------------

def test_cli_names_an_interrupted_run_and_how_to_continue_it(eagle3_run, tmp_path, monkeypatch, capsys):
    """train-head stopped by a signal: the steps done, the signal, the command that resumes it
    (with what the run's directory does not keep), and the shell's exit code for that signal."""
    result, _ = eagle3_run
    stopped = dataclasses.replace(result, step=7, head_path=None, interrupted="SIGTERM", validation=None)
    monkeypatch.setattr(train, "train_head", lambda *args, **kwargs: (stopped, None))
    code = cli.main(["train-head", "--out", str(tmp_path / "my run"), "--weight-format", "int8",
                     "--feature-cache", "runs/features"])
    assert code == 128 + signal.SIGTERM.value
    out = capsys.readouterr().out
    assert "eagle3 head: 7 steps of 60, stopped by SIGTERM and checkpointed" in out
    assert (f"continue with: python -m jaxspec.cli train-head --weight-format int8 --feature-cache runs/features "
            f"--out '{tmp_path / 'my run'}' --resume") in out


def test_top1_agreement_is_the_argmax_drafting_the_targets_token():
    """The training metric's one-max test agrees with an argmax wherever the maximum is unique;
    a label outside the draft vocabulary never agrees; an exact tie counts (documented)."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 32, 50)).astype(np.float32)  # [B, T, Vd]
    labels = rng.integers(-1, 50, size=(4, 32)).astype(np.int32)
    labels[:, ::3] = np.argmax(logits, axis=-1)[:, ::3]  # some rows agree
    expected = (labels >= 0) & (np.argmax(logits, axis=-1) == labels)
    got = np.asarray(train.agrees_with_target(logits, labels))
    np.testing.assert_array_equal(got, expected)
    assert 0 < expected.sum() < expected.size
    tied = np.zeros((1, 1, 4), np.float32)
    assert np.asarray(train.agrees_with_target(tied, np.array([[3]], np.int32))).all()


def test_training_lowers_the_loss_and_learns_the_targets_rule(eagle3_run):
    result, _ = eagle3_run
    first, last = result.history[0], result.history[-1]
    assert result.step == EAGLE3_RUN.steps and len(result.history) == EAGLE3_RUN.steps
    assert last["loss"] < 0.05 * first["loss"], (first, last)
    assert last["top1"] > 0.9
    assert result.validation["top1"] > 0.8
    assert all(t > 0.6 for t in result.validation["top1_by_step"])  # deeper unrolled drafts too
    # Validation also scores apart the text a prompt lookup would not propose and the first 128
    # tokens of each answer: a toy answer (20 tokens of a 64-token cycle) is both, all of it.
    for name in ("new", "early"):
        assert result.validation[f"{name}_share"] == 1.0 and result.validation[f"top1_{name}"] == result.validation["top1"]


def test_bfloat16_products_train_the_same_head(toy, eagle3_run, tmp_path):
    """compute_dtype="bfloat16": the head's products (forward and backward) in bf16 on float32
    master weights. Its first loss is the float32 run's to bf16 rounding (same init, same batch),
    and it learns the target's rule as the float32 run does."""
    target, _, _, data = toy
    first, _ = eagle3_run
    cfg = dataclasses.replace(EAGLE3_RUN, compute_dtype="bfloat16")
    result = train.train(target, data, tmp_path / "bf16", cfg, progress=False)
    assert result.history[0]["loss"] == pytest.approx(first.history[0]["loss"], rel=2e-2)
    assert result.history[-1]["loss"] < 0.05 * result.history[0]["loss"], (result.history[0], result.history[-1])
    assert result.validation["top1"] > 0.8
    assert train.saved_run(tmp_path / "bf16")[0].compute_dtype == "bfloat16"


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


def test_resume_continues_the_same_run(toy, eagle3_run, tmp_path, monkeypatch):
    target, _, _, data = toy
    uninterrupted, _ = eagle3_run
    persisted = []  # a run keeps its compiled steps in XLA's disk cache, for its resume to load
    monkeypatch.setattr(compilation, "enable_persistent_cache", lambda: persisted.append(True))
    partial = train.train(target, data, tmp_path, EAGLE3_RUN, stop_after=25, progress=False)
    assert persisted
    assert partial.step == 25 and partial.head_path is None and not (tmp_path / "config.json").exists()
    with pytest.raises(jaxspec.InvalidRequestError, match="already holds a training run"):
        train.train(target, data, tmp_path, EAGLE3_RUN, progress=False)
    other = train.TrainConfig(**{**EAGLE3_RUN.to_dict(), "learning_rate": 1e-4})
    with pytest.raises(jaxspec.InvalidRequestError, match=r"different settings \['learning_rate'\]"):
        train.train(target, data, tmp_path, other, resume=True, progress=False)
    int8 = jaxspec.convert_weights(target, "int8")  # the same config, another trunk: other features
    with pytest.raises(jaxspec.InvalidRequestError, match=r"data or target \(its config or weight format\)"):
        train.train(int8, data, tmp_path, EAGLE3_RUN, resume=True, progress=False)
    saved_cfg, saved_data = train.saved_run(tmp_path)
    assert saved_cfg == EAGLE3_RUN and saved_data.fingerprint() == data.fingerprint()

    resumed = train.train(target, saved_data, tmp_path, saved_cfg, resume=True, progress=False)
    assert resumed.step == EAGLE3_RUN.steps and resumed.head_path == tmp_path
    assert [h["step"] for h in resumed.history] == list(range(26, EAGLE3_RUN.steps + 1))
    np.testing.assert_allclose([h["loss"] for h in resumed.history],
                               [h["loss"] for h in uninterrupted.history[25:]], rtol=1e-4, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 resumed.head.params, uninterrupted.head.params)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_step_checkpoints_that_step_and_stops(toy, eagle3_run, tmp_path, monkeypatch, signum):
    """SIGTERM (a session's or a scheduler's end) or Ctrl-C while a step runs: that step finishes
    and is checkpointed, the run stops there, the handlers it replaced are back, and a resume
    takes the next step as the uninterrupted run took it."""
    target, _, _, data = toy
    uninterrupted, _ = eagle3_run
    real_step = run_module.train_step
    calls = []

    def step_then_signal(*args, **kwargs):
        out = real_step(*args, **kwargs)
        calls.append(True)
        if len(calls) == 3:
            signal.raise_signal(signum)  # delivered between this step's Python calls, as from outside
        return out

    monkeypatch.setattr(run_module, "train_step", step_then_signal)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stopped = train.train(target, data, tmp_path, EAGLE3_RUN, progress=False)
    assert (stopped.interrupted, stopped.step, stopped.head_path) == (signal.Signals(signum).name, 3, None)
    assert len(calls) == 3 and {s: signal.getsignal(s) for s in handlers} == handlers
    monkeypatch.setattr(run_module, "train_step", real_step)
    resumed = train.train(target, data, tmp_path, EAGLE3_RUN, resume=True, stop_after=4, progress=False)
    assert resumed.interrupted is None and [h["step"] for h in resumed.history] == [4]
    np.testing.assert_allclose(resumed.history[0]["loss"], uninterrupted.history[3]["loss"], rtol=1e-4, atol=1e-6)


def test_kept_checkpoints_export_as_the_heads_the_run_had(toy, tmp_path, monkeypatch, capsys):
    """keep_every keeps the heads along a run beside its last two checkpoints; export_head (and
    train-head --export-head) writes any kept one as a loadable head, equal to the run's own head
    at that step, with its run and step beside it. A step not kept, a run's own directory, a
    directory already holding a head, and a target of another config are refused."""
    target, _, _, data = toy
    cfg = dataclasses.replace(EAGLE3_RUN, save_every=5)  # the same compiled step: checkpointing is not in it
    run = tmp_path / "run"
    at10 = train.train(target, data, run, cfg, stop_after=10, keep_every=10, progress=False)
    at25 = train.train(target, data, run, cfg, resume=True, stop_after=25, keep_every=10, progress=False)
    kept = sorted(int(p.name) for p in (run / train.CHECKPOINT_DIR).iterdir() if p.name.isdigit())
    assert kept == [10, 20, 25]  # the last two (20, 25) and the multiples of 10; 5 and 15 are gone
    for step, result, dest in ((10, at10, tmp_path / "h10"), (None, at25, tmp_path / "latest")):
        path = train.export_head(target, run, dest, step=step, head_dtype="float32")
        head = jaxspec.load(str(path))
        assert head.config == result.head.config
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), head.params, result.head.params)
        exported = json.loads((dest / train.EXPORT_FILE).read_text())
        assert exported == {"run": str(run.absolute()), "step": result.step, "steps": cfg.steps}

    with pytest.raises(jaxspec.InvalidRequestError, match=r"no checkpoint at step 15; it holds steps \[10, 20, 25\]"):
        train.export_head(target, run, tmp_path / "h15", step=15)
    with pytest.raises(jaxspec.InvalidRequestError, match="another directory than its run's"):
        train.export_head(target, run, run)
    with pytest.raises(jaxspec.InvalidRequestError, match="already holds a head or a run"):
        train.export_head(target, run, tmp_path / "h10", step=10)
    wider = jaxspec.Model(config=dataclasses.replace(target.config, vocab_size=target.config.vocab_size + 1),
                          params=target.params, source="wider")
    with pytest.raises(jaxspec.InvalidRequestError, match="cannot export a head of"):
        train.export_head(target=wider, run_dir=run, dest=tmp_path / "other")
    with pytest.raises(jaxspec.InvalidRequestError, match="keep_every must be an integer >= 1"):
        train.train(target, data, tmp_path / "bad", cfg, keep_every=0, progress=False)

    monkeypatch.setattr(cli.api, "load", lambda *args, **kwargs: target)  # the toy target has no directory
    assert cli.main(["train-head", "--out", str(run), "--export-head", str(tmp_path / "h20"),
                     "--export-step", "20"]) == 0
    assert f"exported the head of {run} -> {tmp_path / 'h20'}" in capsys.readouterr().out
    assert json.loads((tmp_path / "h20" / train.EXPORT_FILE).read_text())["step"] == 20
    assert cli.main(["train-head", "--out", str(tmp_path / "none"), "--export-head", str(tmp_path / "x")]) == 2
    assert "holds no training run" in capsys.readouterr().err
    assert cli.main(["train-head", "--out", str(run), "--export-step", "20"]) == 2
    assert "give --export-head DEST" in capsys.readouterr().err


def test_a_run_can_start_from_a_trained_head(toy, eagle3_run, tmp_path):
    """init_from: the trained head is the new run's start, so its first loss (the warmup's first
    step moves nothing) is a trained head's, not a fresh one's; the compiled step is shared."""
    target, _, _, data = toy
    first, first_dir = eagle3_run
    cfg = dataclasses.replace(EAGLE3_RUN, init_from=str(first_dir))
    started = train.train(target, data, tmp_path / "started", cfg, stop_after=1, progress=False)
    fresh = train.train(target, data, tmp_path / "fresh", EAGLE3_RUN, stop_after=1, progress=False)
    assert fresh.history[0]["loss"] == pytest.approx(first.history[0]["loss"], rel=1e-6)
    assert started.history[0]["loss"] < 0.1 * first.history[0]["loss"], (started.history, first.history[0])
    assert started.history[0]["top1"] > 0.8
    assert train.saved_run(tmp_path / "started")[0].init_from == str(first_dir)  # recorded, checked on resume


def test_starting_from_a_head_carries_its_rows_by_target_token(toy, eagle3_run, tmp_path):
    """A draft vocabulary of another size takes the head's lm_head row for each token they share
    and a fresh row for each token the head never drafted; every other param is the head's."""
    target, _, _, data = toy
    _, first_dir = eagle3_run
    source = jaxspec.load(str(first_dir))
    source_params = layers.unfuse_projections(source.params)
    source_ids = np.arange(96) + np.asarray(source_params.d2t)
    for size in (64, 128):
        vocab = train.draft_vocab(data, target.config.vocab_size, size)
        head_cfg = train.eagle3_config_for(target.config, size)
        fresh = train.init_head(train.Method.EAGLE3, head_cfg, target, vocab, seed=1)
        params, carried = train.start_from(train.Method.EAGLE3, head_cfg, fresh, vocab, source)
        shared = np.isin(vocab.target_ids, source_ids)
        assert carried == shared.sum() == min(size, 96)
        for row, token in enumerate(vocab.target_ids):
            expected = (source_params.lm_head[int(np.flatnonzero(source_ids == token)[0])] if shared[row]
                        else fresh.lm_head[row])
            np.testing.assert_array_equal(params.lm_head[row], expected)
        np.testing.assert_array_equal(params.d2t, fresh.d2t)
        np.testing.assert_array_equal(params.fc, source_params.fc)
        np.testing.assert_array_equal(params.attention.q_proj, source_params.attention.q_proj)

    vocab = train.draft_vocab(data, target.config.vocab_size, 96)
    head_cfg = train.eagle3_config_for(target.config, 96)
    fresh = train.init_head(train.Method.EAGLE3, head_cfg, target, vocab, seed=0)
    other_aux = dataclasses.replace(head_cfg, aux_layer_ids=tuple(reversed(head_cfg.aux_layer_ids)))
    with pytest.raises(jaxspec.InvalidRequestError, match=r"does not fit this run's head: aux_layer_ids"):
        train.start_from(train.Method.EAGLE3, other_aux, fresh, vocab, source)
    with pytest.raises(jaxspec.InvalidRequestError, match="cannot start an mtp run"):
        train.start_from(train.Method.MTP, train.mtp_config_for(target.config), fresh, vocab, source)
    with pytest.raises(jaxspec.InvalidRequestError, match="init_from .* is not a checkpoint directory"):
        train.load_start_head(str(tmp_path))
    with pytest.raises(jaxspec.InvalidRequestError, match="init_from must be"):
        train.TrainConfig(init_from="")


def test_a_run_can_keep_the_vocabulary_of_the_head_it_starts_from(toy, eagle3_run, tmp_path):
    """keep_init_vocab: every token the start head drafts stays in the run's vocabulary with its
    own lm_head row, even tokens the data ranks last; the data's most frequent others fill it up.
    The start head here drafts a vocabulary the data would never pick (its rows moved to the
    data's least used tokens), so a run without the option leaves some of its rows behind (the
    toy's vocabulary is 128 tokens: a 100-token vocabulary of the data's ranking drops the 28 it
    ranks last)."""
    target, _, _, data = toy
    _, first_dir = eagle3_run
    source = layers.unfuse_projections(jaxspec.load(str(first_dir)).params)
    vocab_size = target.config.vocab_size
    odd_ids = np.sort(train.draft_token_ranking(data, vocab_size)[-96:])  # the 96 the data ranks last
    odd = dataclasses.replace(source, d2t=odd_ids - np.arange(96))
    odd_dir = tmp_path / "odd_head"
    checkpoints.save_eagle3(odd_dir, train.eagle3_config_for(target.config, 96), odd)
    np.testing.assert_array_equal(train.start_vocab(jaxspec.load(str(odd_dir))), odd_ids)

    cfg = dataclasses.replace(EAGLE3_RUN, draft_vocab_size=100, init_from=str(odd_dir), keep_init_vocab=True)
    kept = train.train(target, data, tmp_path / "kept", cfg, stop_after=1, progress=False)
    params = layers.unfuse_projections(kept.head.params)
    ids = np.arange(100) + np.asarray(params.d2t)
    assert np.isin(odd_ids, ids).all()
    train_rows, _ = train.split_rows(data, cfg.val_fraction, cfg.seed)  # the run ranks its training rows
    others = train.draft_token_ranking(data.subset(train_rows), vocab_size)
    np.testing.assert_array_equal(np.sort(ids[~np.isin(ids, odd_ids)]), np.sort(others[~np.isin(others, odd_ids)][:4]))
    # The warmup's first step has learning rate 0: every kept row is still the start head's.
    rows = np.searchsorted(ids, odd_ids)
    np.testing.assert_allclose(np.asarray(params.lm_head)[rows], np.asarray(source.lm_head), rtol=1e-6)
    assert train.saved_run(tmp_path / "kept")[0].keep_init_vocab  # recorded, checked on resume

    assert vocab_size == 128
    plain_vocab = train.draft_vocab(data, vocab_size, 100)
    assert np.isin(odd_ids, plain_vocab.target_ids).sum() == 96 - 28  # without it: the data's own top 100
    with pytest.raises(jaxspec.InvalidRequestError, match="cannot hold the 96 of"):
        train.train(target, data, tmp_path / "small", dataclasses.replace(cfg, draft_vocab_size=64), progress=False)


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

def test_an_mtp_block_starts_as_the_targets_last_layer(toy):
    target = toy[0]
    head_cfg = train.mtp_config_for(target.config)
    vocab_size = target.config.vocab_size
    identity = train.DraftVocab(target_ids=np.arange(vocab_size), d2t=np.zeros(vocab_size, np.int64),
                                t2d=np.ones(vocab_size, bool))
    copied = train.init_head(train.Method.MTP, head_cfg, target, identity, seed=0, mtp_block_from_last_layer=True)
    last = layers.unfuse_projections(target.params.layers[-1])
    jax.tree.map(np.testing.assert_array_equal, copied.block, last)
    drawn = train.init_head(train.Method.MTP, head_cfg, target, identity, seed=0)
    assert not np.array_equal(drawn.block.attention.q_proj, last.attention.q_proj)  # random, by default off


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
    # A later run can start from it: its params exactly, q/k/v and gate/up as training keeps them.
    vocab_size = target.config.vocab_size
    identity = train.DraftVocab(target_ids=np.arange(vocab_size), d2t=np.zeros(vocab_size, np.int64),
                                t2d=np.ones(vocab_size, bool))
    fresh = train.init_head(train.Method.MTP, head.config, target, identity, seed=1)
    started, _ = train.start_from(train.Method.MTP, head.config, fresh, identity, head)
    jax.tree.map(np.testing.assert_array_equal, started, train.trainable_params(layers.unfuse_projections(result.head.params)))
    # A damaged head names what is wrong.
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(result.head_path / "model.safetensors"))
    for damage, message in [(lambda t: t.pop("eh_proj"), "lacks MTP head tensor 'eh_proj'"),
                            (lambda t: t.update(enorm=t["enorm"][:-1]), "'enorm' has shape"),
                            (lambda t: t.update({"block.q_proj": t["block.q_proj"].astype(np.int32)}), "stored as I32")]:
        broken = dict(tensors)
        damage(broken)
        save_file(broken, str(result.head_path / "model.safetensors"))
        with pytest.raises(jaxspec.CheckpointError, match=message):
            jaxspec.load(str(result.head_path))
