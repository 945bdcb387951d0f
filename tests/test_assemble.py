"""Assembling a family's params from named tensors (jaxspec.checkpoints.assemble).

Pure host code: a tiny params type and a dict of arrays stand in for a family and a checkpoint file.
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest
from flax import struct

from jaxspec.checkpoints.assemble import assemble_params
from jaxspec.errors import CheckpointError
from jaxspec.models.family import TensorSource
from jaxspec.models.params import param


@struct.dataclass
class TinyLayer:
    norm: jax.Array = param(axes=("embed",))  # [D]


@struct.dataclass
class TinyParams:
    token_embed: jax.Array = param(axes=("vocab", "embed"))  # [V, D]
    layers: tuple[TinyLayer, ...]


SHAPES = TinyParams(token_embed=(4, 2), layers=(TinyLayer(norm=(2,)), TinyLayer(norm=(2,))))
TENSORS = TinyParams(token_embed=TensorSource("wte"),
                     layers=tuple(TinyLayer(norm=TensorSource(f"h.{i}.ln", lambda w: w + 1.0, f" (layer {i})"))
                                  for i in range(2)))
STORED = {"wte": np.arange(8, dtype=np.float16).reshape(4, 2), "h.0.ln": np.zeros(2), "h.1.ln": np.ones(2)}


def assemble(stored: dict[str, np.ndarray]):
    return assemble_params(SHAPES, TENSORS, stored.__getitem__, available=stored, source="test file",
                           path=pathlib.Path("/ckpt/model.bin"), progress=False)


def test_leaves_are_read_transformed_and_made_float32():
    params = assemble(STORED)
    assert isinstance(params, TinyParams)
    assert params.token_embed.dtype == np.float32 and params.token_embed.flags.c_contiguous
    np.testing.assert_array_equal(params.token_embed, STORED["wte"].astype(np.float32))
    np.testing.assert_array_equal(params.layers[0].norm, [1.0, 1.0])  # the transform ran
    np.testing.assert_array_equal(params.layers[1].norm, [2.0, 2.0])


def test_a_missing_tensor_is_named_with_why_the_config_needs_it():
    with pytest.raises(CheckpointError, match=r"test file /ckpt/model.bin lacks tensor 'h.1.ln' \(layer 1\)"):
        assemble({k: v for k, v in STORED.items() if k != "h.1.ln"})


def test_a_tensor_of_the_wrong_shape_is_named_after_its_transform():
    with pytest.raises(CheckpointError, match=r"'h.0.ln' in /ckpt/model.bin has shape \(3,\), expected \(2,\)"):
        assemble({**STORED, "h.0.ln": np.zeros(3)})


def test_the_first_failure_is_the_first_tensor_in_declared_order():
    """token_embed before the layers, as the type declares them (sorted names would reach "layers" first)."""
    with pytest.raises(CheckpointError, match="'wte'"):
        assemble({"h.0.ln": np.zeros(3)})
