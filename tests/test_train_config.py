"""Training settings (jaxspec.train.config): TrainConfig refuses bad values and round-trips
through the dict a run directory saves."""

from __future__ import annotations

import pytest

import jaxspec
from jaxspec import train


def test_train_config_rejects_bad_settings():
    for bad, message in [({"batch_size": 0}, "batch_size must be"), ({"learning_rate": -1.0}, "learning_rate must be"),
                         ({"step_decay": 1.5}, "step_decay must be"), ({"method": "medusa"}, "medusa"),
                         ({"compute_dtype": "float16"}, "compute_dtype must be")]:
        with pytest.raises((jaxspec.InvalidRequestError, ValueError), match=message):
            train.TrainConfig(**bad)
    with pytest.raises(jaxspec.InvalidRequestError, match="soft_labels needs"):
        train.TrainConfig(soft_labels=True)
    assert not train.TrainConfig(soft_labels=True, cache_features=False).cache_features


def test_train_config_round_trips_through_its_dict():
    cfg = train.TrainConfig(method="mtp", steps=60, batch_size=8, aux_layer_ids=[0, 1, 1], seed=3)
    assert cfg.method is train.Method.MTP and cfg.aux_layer_ids == (0, 1, 1)
    assert train.TrainConfig.from_dict(cfg.to_dict()) == cfg
