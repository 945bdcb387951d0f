"""The target's half of a training batch (jaxspec.train.features): target_batch and the on-disk
FeatureCache, on the successor toy whose every layer passes the token's embedding through."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import train
from jaxspec.models import eagle3
from train_fixtures import CYCLE, SEQ_LEN, TOY, distilled_toy


@pytest.fixture(scope="module")
def toy():
    return distilled_toy()


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


def _stamps(directory):
    return {p.name: p.stat().st_mtime_ns for p in directory.glob("*.npy")}


def test_feature_cache_holds_the_targets_half_and_is_built_once(toy, tmp_path):
    """Shards of the target's features (float16) and argmax labels, equal to a fresh target pass;
    complete shards are reused, an interrupted one's rows are computed alone, other layers or
    weights rebuild all."""
    target, _, _, data = toy
    layers = eagle3.target_hidden_layers((0, 1, 1))
    directory = tmp_path / "features"
    cache = train.cache_features(target, data, layers, directory, chunk_rows=16)
    assert len(cache.features) == 3 and cache.features[2].shape == (len(data) - 32, 3, SEQ_LEN, TOY.dim)
    assert cache.features[0].dtype == np.float16 and cache.labels[0].dtype == np.int32
    rows = np.asarray([0, 17, 39, 5, -1, 33, 12, 20])  # across shards, one empty row
    fresh = train.target_batch(target.params, TOY, layers, data.batch(rows))
    features, labels = cache.rows(rows)
    for i, feature in enumerate(fresh["features"]):
        # float16 keeps 11 significant bits: relative error <= 2^-11 of each value.
        np.testing.assert_allclose(features[:, i], np.where(rows[:, None, None] < 0, 0, feature), rtol=2 ** -11, atol=1e-6)
    np.testing.assert_array_equal(labels, np.where(rows[:, None] < 0, 0, fresh["labels"]))

    stamps = _stamps(directory)
    (directory / "rows_00001.npy").unlink()  # an interrupted build: shard 1's rows were never committed
    again = train.cache_features(target, data, layers, directory, chunk_rows=16)
    after = _stamps(directory)
    assert set(after) == set(stamps) - {"features_00001.npy", "labels_00001.npy", "rows_00001.npy"} | {
        "features_00003.npy", "labels_00003.npy", "rows_00003.npy"}  # its rows again, as a new shard
    assert all(after[name] == stamps[name] for name in after if name in stamps)
    assert again.features[2].shape[0] == 16
    np.testing.assert_array_equal(again.rows(rows)[0], features)
    np.testing.assert_array_equal(again.rows(rows)[1], labels)
    stamps = _stamps(directory)
    subset = train.cache_features(target, data, layers[:1], directory, chunk_rows=32)
    assert stamps == _stamps(directory)  # read out of the cache
    np.testing.assert_array_equal(subset.rows(rows, layers[:1])[0], features[:, :1])
    other = train.cache_features(target, data, (TOY.num_layers,), directory, chunk_rows=16)
    assert other.layers == (TOY.num_layers,) and other.features[0].shape[1] == 1  # rebuilt, not misread
    # The same config with int8 weights is another trunk: its cache is rebuilt from its own pass.
    int8 = jaxspec.convert_weights(target, "int8")
    rebuilt = train.cache_features(int8, data, layers, directory, chunk_rows=16)
    assert json.loads((directory / train.FEATURE_META).read_text())["target_weights"] == "int8"
    fresh8 = train.target_batch(int8.params, TOY, layers, data.batch(rows))
    features8, labels8 = rebuilt.rows(rows)
    np.testing.assert_array_equal(labels8, np.where(rows[:, None] < 0, 0, fresh8["labels"]))
    np.testing.assert_allclose(features8[:, 0], np.where(rows[:, None, None] < 0, 0, fresh8["features"][0]),
                               rtol=2 ** -11, atol=1e-6)
    assert np.abs(features8[:, -1].astype(np.float32) - features[:, -1].astype(np.float32)).max() > 1e-3
    with pytest.raises(jaxspec.InvalidRequestError, match="chunk_rows"):
        train.cache_features(target, data, layers, directory, chunk_rows=0)


def test_a_cache_serves_any_data_holding_its_rows(toy, tmp_path):
    """Rows are found by their tokens: data that shares rows with a cached Dataset (a corpus's
    union of rounds, say) computes only its new rows, in one forward per shape whatever the
    tokens per forward, and reads every row as a fresh target pass gives it; a repeated row is
    computed once."""
    target, _, _, data = toy
    layers = eagle3.target_hidden_layers((0, 1, 1))
    directory = tmp_path / "features"
    first = data.subset(np.arange(0, 24))
    train.cache_features(target, first, layers, directory, chunk_rows=16)
    stamps = _stamps(directory)
    # The union: rows 12..39 of the data (12 of them cached), two of its rows changed after the
    # prompt (new rows), and row 30 twice.
    picked = np.concatenate([np.arange(12, 40), [30]])
    tokens, lengths = data.tokens[picked].copy(), data.lengths[picked].copy()
    tokens[[0, 5], lengths[[0, 5]] - 1] = (tokens[[0, 5], lengths[[0, 5]] - 1] + 3) % CYCLE
    union = train.Dataset(tokens, lengths, data.prompt_lengths[picked])
    cache = train.cache_features(target, union, layers, directory, chunk_rows=16, tokens_per_forward=SEQ_LEN)
    after = _stamps(directory)
    assert all(after[name] == stamps[name] for name in stamps)
    assert len(after) - len(stamps) == 3 * 2  # 16 + 2 new rows: two new shards
    assert sum(chunk.shape[0] for chunk in cache.labels) == 24 + 16 + 2
    assert tuple(cache.place[-1]) == tuple(cache.place[30 - 12])  # the repeated row: one place
    rows = np.arange(len(union))
    fresh = train.target_batch(target.params, TOY, layers, union.batch(rows))
    features, labels = cache.rows(rows)
    np.testing.assert_array_equal(labels, fresh["labels"])
    for i, feature in enumerate(fresh["features"]):
        np.testing.assert_allclose(features[:, i], feature, rtol=2 ** -11, atol=1e-6)


def _targets_for(target, data, cfg, feature_dir):
    """(targets_for, spec, frozen, draft vocabulary) for a run of `cfg` on `data`, set up as `train`
    sets them up."""
    from jaxspec.train.config import StepSpec
    from jaxspec.train.run import _head_setup

    head_cfg, hidden, vocab = _head_setup(target, data, cfg)
    spec = StepSpec(train=cfg, target_cfg=TOY, head_cfg=head_cfg, hidden_layers=hidden)
    frozen = {"embed": target.params.embed, "draft_ids": jnp.asarray(vocab.target_ids, jnp.int32),
              "target_to_draft": jnp.asarray(vocab.target_to_draft)}
    return train.target_source(target, data, frozen, spec, feature_dir, progress=False), spec, frozen, vocab


def test_batches_cut_to_their_bucket_width_score_as_the_whole_window(toy, tmp_path):
    """Rows of like length batched at their bucket's width (BatchOrder, length_batches) lose
    nothing: padding past a row's end never reaches its positions, so the validation loss and
    top-1 over bucketed batches equal those over full-window batches, from a fresh target pass
    and from the length-ordered feature cache alike."""
    target, _, _, data = toy
    rng = np.random.default_rng(1)
    lengths = np.minimum(data.lengths, data.prompt_lengths + rng.integers(2, 20, len(data))).astype(np.int32)
    tokens = np.where(np.arange(data.seq_len)[None] < lengths[:, None], data.tokens, 0)
    short = train.Dataset(tokens, lengths, data.prompt_lengths)
    widths = train.bucket_widths(short.lengths, 8, short.seq_len)
    assert set(widths.tolist()) == {16, SEQ_LEN} and (widths >= short.lengths).all() and widths.max() == SEQ_LEN

    rows = np.arange(len(short))
    bucketed, whole = train.length_batches(rows, widths, 8), train.length_batches(rows, np.full(len(short), SEQ_LEN), 8)
    assert len(bucketed) > len(whole) and all((short.lengths[r[r >= 0]] <= w).all() for r, w in bucketed)
    results = []
    for cache in (False, True):
        cfg = train.TrainConfig(draft_vocab_size=96, bucket_width=8, cache_features=cache)
        targets_for, spec, frozen, vocab = _targets_for(target, short, cfg, tmp_path / "features")
        params = train.init_head(cfg.method, spec.head_cfg, target, vocab, 0)
        for batches in (bucketed, whole):
            results.append(train.evaluate(params, frozen, batches, targets_for, spec))
    for result in results[1:]:
        np.testing.assert_allclose(result["loss"], results[0]["loss"], rtol=2e-3)  # the cache is float16
        np.testing.assert_allclose(result["top1_by_step"], results[0]["top1_by_step"], atol=0.02)
    np.testing.assert_allclose(results[1]["loss"], results[0]["loss"], rtol=1e-5)  # fresh passes: only rounding
    np.testing.assert_allclose(results[3]["loss"], results[2]["loss"], rtol=1e-5)  # the same cache, cut or not
    # The cache stores length-ordered shards, each only as wide as its widest row.
    cache = train.cache_features(target, short, spec.hidden_layers, tmp_path / "narrow", chunk_rows=8, bucket_width=8)
    by_length = widths[np.argsort(lengths, kind="stable")]
    assert [chunk.shape[1] for chunk in cache.labels] == [int(by_length[c * 8: c * 8 + 8].max()) for c in range(5)]
    assert cache.labels[0].shape[1] == 16 < SEQ_LEN


@pytest.mark.parametrize("cache", [True, False], ids=["cached", "fresh"])
def test_text_labels_are_each_rows_next_token(toy, tmp_path, cache):
    """labels="text": each position's label is the row's next token, read from the feature cache
    or a fresh target pass alike; the default stays the target's argmax. On answers the toy did not
    write (random tokens), the two part at every loss position whose next token is not the
    successor."""
    target, _, _, data = toy
    rng = np.random.default_rng(3)
    in_answer = (np.arange(data.seq_len)[None] >= data.prompt_lengths[:, None]) & \
        (np.arange(data.seq_len)[None] < data.lengths[:, None])
    tokens = np.where(in_answer, rng.integers(0, CYCLE, data.tokens.shape), data.tokens).astype(np.int32)
    written = train.Dataset(tokens, data.lengths, data.prompt_lengths)
    rows = np.asarray([0, 9, -1, 21])
    labels = {}
    for source in ("target", "text"):
        cfg = train.TrainConfig(draft_vocab_size=96, cache_features=cache, labels=source)
        targets_for, *_ = _targets_for(target, written, cfg, tmp_path / f"features_{source}")
        batch = targets_for(rows, SEQ_LEN)
        labels[source], mask = np.asarray(batch["labels"]), np.asarray(batch["loss_mask"])
    batch_tokens = np.asarray(written.batch(rows)["tokens"])
    kept = rows >= 0  # an empty row's labels are the cache's zeros or its padding's successor: no loss either way
    np.testing.assert_array_equal(labels["target"][kept], (batch_tokens[kept] + 1) % CYCLE)  # the toy's argmax
    np.testing.assert_array_equal(labels["text"][:, :-1], batch_tokens[:, 1:])
    assert not mask[:, -1].any()  # the last position's next token is past the batch: never a loss position
    differs = mask & (labels["text"] != labels["target"])
    assert differs.sum() > 0.8 * mask[:, :-1].sum()  # random answers: the labels part where the loss is


def test_text_labels_refuse_soft_labels_and_unknown_sources():
    with pytest.raises(jaxspec.InvalidRequestError, match="labels must be one of"):
        train.TrainConfig(labels="teacher")
    with pytest.raises(jaxspec.InvalidRequestError, match="soft_labels learn the target's distribution"):
        train.TrainConfig(soft_labels=True, cache_features=False, labels="text")


def test_batch_order_covers_each_row_once_an_epoch_at_its_width():
    lengths = np.random.default_rng(2).integers(1, 100, 37)
    widths = train.bucket_widths(lengths, 16, 96)
    rows = np.arange(0, 74, 2)  # the training rows' data indices
    order = train.BatchOrder(rows, widths, 4, seed=3)
    steps = order.steps_per_epoch
    for epoch in range(2):
        batches = [order.step(epoch * steps + i) for i in range(steps)]
        taken = np.concatenate([r for r, _ in batches])
        assert sorted(taken[taken >= 0].tolist()) == rows.tolist()
        width_of = dict(zip(rows.tolist(), widths.tolist()))
        assert all(all(width_of[r] == w for r in batch[batch >= 0].tolist()) for batch, w in batches)
        assert all(len(batch) == 4 for batch, _ in batches)
    again = train.BatchOrder(rows, widths, 4, seed=3)
    assert [again.step(s)[0].tolist() for s in range(5)] == [order.step(s)[0].tolist() for s in range(5)]
    other = train.BatchOrder(rows, widths, 4, seed=4)
    assert [other.step(s)[0].tolist() for s in range(5)] != [order.step(s)[0].tolist() for s in range(5)]
    assert order.step(0)[0].tolist() != order.step(steps)[0].tolist() or order.step(1)[0].tolist() != order.step(
        steps + 1)[0].tolist()  # epochs are shuffled anew
