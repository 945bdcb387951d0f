"""The target's half of a training batch (jaxspec.train.features): target_batch and the on-disk
FeatureCache, on the successor toy whose every layer passes the token's embedding through."""

from __future__ import annotations

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
