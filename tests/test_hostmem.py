"""A load's host memory (jaxspec.hostmem and the consuming walks built on it): arrays XLA:CPU
adopts without a copy, conversions that drop each weight once its twin exists, quantization in row
slices; each gives exactly what the whole-tree path gives."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxspec import hostmem
from jaxspec.api import _lay_out
from jaxspec.cpu import packing
from jaxspec.models import backends, quant
from jaxspec.models.layers import fuse_projections
from jaxspec.models.quant import WeightFormat


def test_an_aligned_array_is_adopted_by_the_cpu_device_without_a_copy():
    for shape, dtype in (((3, 5), np.float32), ((7,), np.int8), ((2, 3, 4), np.float16)):
        array = hostmem.aligned_empty(shape, dtype)
        assert array.shape == shape and array.dtype == dtype and array.flags.c_contiguous
        assert array.ctypes.data % hostmem.HOST_ALIGNMENT == 0
    assert hostmem.aligned_empty((0, 4), np.float32).shape == (0, 4)  # nothing to align
    array = hostmem.aligned_empty((64, 32), np.float32)
    array[...] = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    on_device = jax.device_put(array)
    if jax.default_backend() == "cpu":
        assert on_device.unsafe_buffer_pointer() == array.ctypes.data  # adopted: no copy
    unaligned = np.empty(64 * 32 + 1, np.float32)[1:].reshape(64, 32)  # 4 bytes past numpy's alignment
    unaligned[...] = array
    realigned = hostmem.aligned(unaligned)
    assert realigned.ctypes.data % hostmem.HOST_ALIGNMENT == 0
    np.testing.assert_array_equal(realigned, array)
    assert hostmem.aligned(array) is array
    hostmem.release_freed_memory()  # a no-op where libc has no malloc_trim; never an error


@pytest.mark.parametrize("out_features", [16, 37, 1])
def test_pack_f32_writes_the_documented_layout(out_features):
    matrix = np.random.default_rng(out_features).standard_normal((out_features, 24)).astype(np.float32)
    packed = packing.pack_f32(matrix)
    groups = -(-out_features // packing.GROUP_ROWS)
    padded = np.zeros((groups * packing.GROUP_ROWS, 24), np.float32)
    padded[:out_features] = matrix
    np.testing.assert_array_equal(packed.data, padded.reshape(groups, packing.GROUP_ROWS, 24).transpose(0, 2, 1))
    assert packed.data.ctypes.data % hostmem.HOST_ALIGNMENT == 0


@pytest.mark.parametrize("fmt", [WeightFormat.INT8, WeightFormat.Q4])
def test_quantizing_in_row_slices_gives_the_whole_weight_s_codes(monkeypatch, fmt):
    matrix = np.random.default_rng(1).standard_normal((45, 96)).astype(np.float32)
    whole = quant._convert_leaf(matrix, fmt)
    monkeypatch.setattr(quant, "QUANTIZE_ROWS", 8)  # 6 slices, the last of 5 rows
    sliced = quant._convert_leaf(matrix, fmt)
    jax.tree.map(np.testing.assert_array_equal, sliced, whole)
    assert type(sliced) is type(whole) and sliced.shape == whole.shape


def test_a_consuming_walk_empties_its_list_and_equals_the_whole_tree_walk(tiny_model):
    params = jax.device_get(tiny_model.params)
    loaded = [params]
    converted = quant.convert_consuming(loaded, WeightFormat.INT8)
    assert loaded == []
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(converted),
                 jax.device_get(quant.convert(params, WeightFormat.INT8)))


@pytest.mark.parametrize("products", ["xla", "native"])
def test_load_s_block_by_block_layout_equals_fusing_then_laying_out(tiny_model, products):
    if products == "native":
        from jaxspec.cpu import kernels

        if not kernels.available(notice=False):
            pytest.skip("the native CPU kernels do not build here")
    loaded = [tiny_model.params]
    laid_out = _lay_out(loaded, products)
    assert loaded == []
    expected = backends.apply(fuse_projections(tiny_model.params), backends.Products.parse(products))
    assert jax.tree.structure(laid_out) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(laid_out), jax.device_get(expected))


def test_a_restore_in_groups_of_arrays_gives_the_saved_tree(tiny_model, tmp_path, monkeypatch):
    from jaxspec import models
    from jaxspec.checkpoints import store

    params = jax.device_get(tiny_model.params)
    store.save_params(params, tmp_path / "params")
    family = models.family_of(tiny_model.config)
    whole = store.restore_params(tmp_path / "params", family, tiny_model.config)
    monkeypatch.setattr(store, "RESTORE_GROUP_BYTES", 20_000)  # a handful of tiny arrays a group
    wanted = jax.tree.leaves(quant.shape_structs(family.param_shapes(tiny_model.config), WeightFormat.F32))
    groups = store._restore_groups(wanted, store.RESTORE_GROUP_BYTES)
    assert len(groups) > 3 and [index for group in groups for index in group] == list(range(len(wanted)))
    grouped = store.restore_params(tmp_path / "params", family, tiny_model.config)
    for restored in (whole, grouped):
        assert jax.tree.structure(restored) == jax.tree.structure(params)
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), params)
