"""The decode kernel's tuned table (jaxspec.pallas.tuning): attention="auto" on a GPU takes the
kernel only where a row of the table says it beats XLA, falls back to XLA (saying so once) on a GPU
kind without rows, and every configuration the sweep may time lowers for CUDA without a GPU.
The GPU is simulated: jax's backend and the device kind are patched; the kernel runs interpreted."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache import KVFormat
from jaxspec.pallas import flash_decode as flash_decode_module
from jaxspec.pallas import kv_quant, tuning
from jaxspec.pallas.flash_decode import Attention, attend, flash_decode_reference
from jaxspec.pallas.tuning import GRID, KernelParams, ShapeClass, Tuned
from tests.conftest import load_bench_script

gpu_run = load_bench_script("gpu_run")
FAKE_GPU = "NVIDIA Fake 80GB"


@pytest.fixture
def fake_gpu(monkeypatch):
    """jax on a GPU of kind FAKE_GPU whose table rows the test sets; flash_decode recorded and run
    in the Pallas interpreter. Returns the recorded calls' keyword arguments."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(tuning, "device_kind", lambda: FAKE_GPU)
    monkeypatch.setattr(tuning, "_told", set())
    calls, kernel = [], flash_decode_module.flash_decode

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return kernel(*args, **kwargs, interpret=True)

    monkeypatch.setattr(flash_decode_module, "flash_decode", recorded)
    return calls


def _attention_inputs(kv_format: str, steps: int, seed: int = 0):
    """q [B, T, K, G, H] and a [B, K, S, H] cache in `kv_format`: B=2, K=2, G=2, S=64, H=32."""
    rng = np.random.RandomState(seed)
    kv = KVFormat.parse(tuple(kv_format.split("/")))
    q = jnp.asarray(rng.randn(2, steps, 2, 2, 32), jnp.float32)
    keys = kv_quant.quantize_reference(jnp.asarray(rng.randn(2, 2, 64, 32)), kv.keys)
    values = kv_quant.quantize_reference(jnp.asarray(rng.randn(2, 2, 64, 32)), kv.values)
    return q, keys, values, jnp.array([5, 64 - steps], jnp.int32)


def test_shape_classes_and_the_kernel_defaults():
    assert ShapeClass.of(1) is ShapeClass.DECODE and ShapeClass.of(5) is ShapeClass.VERIFY
    # The kernel's own defaults are KernelParams()'s, and they sit on the grid the sweep searches.
    defaults = KernelParams()
    assert (flash_decode_module.flash_decode.__kwdefaults__["block_s"],
            flash_decode_module.flash_decode.__kwdefaults__["split_size"]) == (defaults.block_s, defaults.split_size)
    for name, values in GRID.items():
        assert getattr(defaults, name) in values


def test_every_row_of_the_table_is_well_formed():
    """A pasted row names a real K/V format and parameters from the grid, once per key."""
    keys = set()
    for row in tuning.TUNED:
        assert isinstance(row, Tuned) and isinstance(row.shape_class, ShapeClass)
        KVFormat.parse(tuple(row.kv_format.split("/")))
        for name, values in GRID.items():
            assert getattr(row.params, name) in values, row
        assert row.speedup > 0
        key = (row.device_kind, row.shape_class, row.kv_format)
        assert key not in keys, f"two rows for {key}"
        keys.add(key)


def test_auto_on_an_untuned_gpu_takes_xla_and_says_so_once(fake_gpu, caplog, monkeypatch):
    monkeypatch.setattr(tuning, "TUNED", (Tuned("another GPU", ShapeClass.DECODE, "bf16/bf16", KernelParams(), 2.0),))
    with caplog.at_level(logging.WARNING, logger=tuning.__name__):
        for steps in (1, 3, 1):
            q, keys, values, lengths = _attention_inputs("bf16/bf16", steps)
            out = attend(q, keys, values, lengths, attention=Attention.AUTO)
            np.testing.assert_array_equal(out, flash_decode_reference(q, keys, values, lengths))
    assert fake_gpu == []  # the kernel never ran
    told = [record.getMessage() for record in caplog.records if record.name == tuning.__name__]
    assert len(told) == 1 and FAKE_GPU in told[0] and "XLA" in told[0]


def test_auto_takes_the_kernel_only_where_a_row_beats_xla(fake_gpu, caplog, monkeypatch):
    tuned = KernelParams(block_s=16, split_size=32, num_warps=8, num_stages=3)
    monkeypatch.setattr(tuning, "TUNED", (
        Tuned(FAKE_GPU, ShapeClass.DECODE, "q8_0/q5_1", tuned, speedup=1.3),
        Tuned(FAKE_GPU, ShapeClass.VERIFY, "q8_0/q5_1", tuned, speedup=0.9),  # measured, but a loss
        Tuned(FAKE_GPU, ShapeClass.DECODE, "bf16/bf16", tuned, speedup=tuning.WIN_MARGIN - 0.01),  # within noise
    ))
    with caplog.at_level(logging.WARNING, logger=tuning.__name__):
        q, keys, values, lengths = _attention_inputs("q8_0/q5_1", 1)
        out = attend(q, keys, values, lengths, attention="auto")
        assert fake_gpu == [dict(mask=None, scale=None, block_s=16, split_size=32, num_warps=8, num_stages=3)]
        np.testing.assert_allclose(out, flash_decode_reference(q, keys, values, lengths), atol=3e-5, rtol=3e-5)
        for kv_format, steps in (("q8_0/q5_1", 3), ("bf16/bf16", 1), ("f32/f32", 1)):  # a loss, noise, no row
            q, keys, values, lengths = _attention_inputs(kv_format, steps)
            np.testing.assert_array_equal(attend(q, keys, values, lengths, attention="auto"),
                                          flash_decode_reference(q, keys, values, lengths))
        # Asked for by name, the kernel runs with its defaults whatever the table says.
        attend(q, keys, values, lengths, attention="pallas")
    assert len(fake_gpu) == 2 and fake_gpu[1]["block_s"] == KernelParams().block_s
    assert not caplog.records  # a known GPU kind: nothing to say


def test_auto_off_a_gpu_never_reads_the_table(monkeypatch):
    monkeypatch.setattr(tuning, "device_kind", lambda: pytest.fail("read the device kind off a GPU"))
    q, keys, values, lengths = _attention_inputs("bf16/bf16", 1)
    np.testing.assert_array_equal(attend(q, keys, values, lengths), flash_decode_reference(q, keys, values, lengths))


def test_the_sweep_prints_rows_in_the_table_s_own_form():
    row = Tuned(FAKE_GPU, ShapeClass.VERIFY, "q8_0/q5_1", KernelParams(block_s=32, split_size=1024, num_stages=3), 1.42)
    assert eval(gpu_run.format_row(row), vars(tuning)) == row  # noqa: S307 (our own source line)


# A slice of the grid bench/gpu_run.sh --cpu lowers whole (201 configurations, ~15 s): every K/V
# format and shape (decode, verify, a tree's verify) at the grid's two extreme tilings, and the
# extreme warps x stages.
_EXTREMES = {(min(GRID["block_s"]), max(GRID["split_size"])), (max(GRID["block_s"]), min(GRID["split_size"]))}
LOWERING_SLICE = [config for config in gpu_run.lowering_configs()
                  if (config[3].block_s, config[3].split_size) in _EXTREMES
                  and (config[3].num_warps, config[3].num_stages) == (KernelParams.num_warps, KernelParams.num_stages)]
LOWERING_SLICE += [("q8_0/q5_1", 1, False, KernelParams(num_warps=w, num_stages=s))
                   for w, s in ((min(GRID["num_warps"]), min(GRID["num_stages"])),
                                (max(GRID["num_warps"]), max(GRID["num_stages"])))]


@pytest.mark.parametrize("kv_format, steps, tree, params", LOWERING_SLICE,
                         ids=[f"{c[0]}-T{c[1]}{'-tree' if c[2] else ''}-{c[3].block_s}-{c[3].split_size}-"
                              f"{c[3].num_warps}w{c[3].num_stages}s" for c in LOWERING_SLICE])
def test_tuned_configurations_lower_for_cuda_without_a_gpu(kv_format, steps, tree, params):
    """jax.export runs Pallas's Triton lowering for CUDA on CPU (B=8, S=8192, K=8, G=4, H=128),
    and the Triton call carries the configuration's warps and stages."""
    gpu_run.lowers_for_cuda(kv_format, steps, tree, params)


def test_the_slice_covers_every_format_and_shape():
    assert len(LOWERING_SLICE) == len(gpu_run.KV_FORMATS) * 3 * 2 + 2
    assert {config[0] for config in LOWERING_SLICE} == set(gpu_run.KV_FORMATS)
    assert {(config[1], config[2]) for config in LOWERING_SLICE} == \
        {(1, False), (gpu_run.GPU_ATTENTION.verify_steps, False), (9, True)}
