"""Generation over a device mesh (jaxspec.shard): the same tokens as one device, params and caches
really split, one SPMD loop with no host callback and no gather of the history or the cache,
and bad meshes refused by name before anything compiles.

The multi-device checks run in one subprocess with 8 CPU devices (tests/sharding_worker.py;
the device count is fixed when jax starts); the checks that need no second device run here.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import sharding
from jaxspec.api import Model
from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec import models
from jaxspec.models import gated_deltanet, llama, qwen35, quant

WORKER = Path(__file__).with_name("sharding_worker.py")
_llama_forward = jax.jit(llama.forward, static_argnums=1)
_any_forward = jax.jit(models.forward, static_argnums=1)


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, env=env, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_worker_sees_eight_devices(report):
    assert report["devices"] == 8


@pytest.mark.parametrize("case", ["plain", "ngram", "draft", "eagle3", "sampling_draft", "sampling_plain",
                                  "tree_draft", "layer_skip", "mtp", "hybrid_ngram", "gemma_plain", "gemma_ngram",
                                  "gemma_assistant"])
def test_tokens_are_identical_to_one_device(report, case):
    runs = dict(report["tokens"][case])  # a copy: the report is shared by the module's tests
    reference = runs.pop("unsharded")
    assert runs, "the case ran on no mesh"
    assert len(reference) == 3 and all(len(row) == 20 for row in reference)  # ragged prompts, every row full
    assert len({tuple(row) for row in reference}) == 3  # rows differ: a row mix-up would show
    for mesh, tokens in runs.items():
        assert tokens == reference, f"{case} on mesh {mesh} differs from the unsharded run"


def test_params_are_split_over_the_model_axis(report):
    placement = report["placement"]
    for mesh in ("2x4", "1x8"):
        layer = placement[mesh]
        assert layer["q_proj"] == layer["k_proj"] == layer["gate_proj"] == layer["embed"] == "P('model', None)"
        assert layer["o_proj"] == layer["down_proj"] == "P(None, 'model')"  # row-parallel
        assert not layer["fused"]  # q/k/v apart: a split of the fused rows would cut across them
        assert layer["int8_embed_scales"] == "P('model',)"  # an int8 weight's scales follow its rows
    # Bytes per device ~ total / model size: only norms (replicated) are on every device in full.
    for mesh, model_size in (("2x4", 4), ("1x8", 8)):
        held = placement[mesh]["params_bytes"]
        assert held["max_per_device"] <= held["total"] / model_size * 1.05, (mesh, held)
    # The hybrid too: its DeltaNet's stacked q/k/v channels regrouped per key head split with them.
    held = placement["hybrid_2x4"]["params_bytes"]
    assert held["max_per_device"] <= held["total"] / 4 * 1.05, held
    assert placement["hybrid_2x4"]["plan"].endswith("DeltaNet channels by key head")
    assert placement["8x1"]["params_bytes"]["max_per_device"] == placement["8x1"]["params_bytes"]["total"]


def test_kv_heads_that_do_not_divide_are_repeated(report):
    # 4 kv heads on a model axis of 8: repeated to 8, so each device holds one (copies), and
    # the tokens above stay identical.
    assert report["placement"]["1x8"]["plan"].endswith("kv heads x2")
    assert report["placement"]["1x8"]["params_bytes"]["total"] > report["placement"]["2x4"]["params_bytes"]["total"]
    assert "kv heads" not in report["placement"]["2x4"]["plan"]


def test_caches_and_loop_state_are_sharded(report):
    loops = report["loops"]
    assert loops["2x4"]["plain"]["cache_spec"] == "P('data', 'model')"  # [B, K, S, H]: rows, kv heads
    assert loops["1x8"]["plain"]["cache_spec"] == "P(None, 'model')"
    assert loops["8x1"]["plain"]["cache_spec"] == "P('data',)"
    assert loops["2x4"]["plain"]["tokens_spec"] == "P('data',)"
    assert loops["2x4"]["eagle3"]["proposer_cache_specs"] == ["P('data', 'model')"]  # the head's own KV
    assert loops["2x4"]["hybrid_ngram"]["cache_spec"] == "P('data', 'model')"


def test_the_loop_has_no_host_callback_and_gathers_no_history(report):
    """One SPMD program: no custom call (a host callback is one), and no all-gather of anything
    with the history's or the cache's length S (what is gathered is per-round: the vocabulary
    shards' partial argmaxes, the rows' scatter indices)."""
    checked = 0
    for mesh, loops in report["loops"].items():
        for name, compiled in loops.items():
            assert compiled["custom_calls"] == [], (mesh, name, compiled["custom_calls"])
            capacity = compiled["history_shape"][1]
            for shape in compiled["all_gather_shapes"]:
                dims = [int(d) for d in re.findall(r"\d+", shape.split("[", 1)[1])]
                assert capacity not in dims, f"{mesh} {name} all-gathers {shape}: the history or a cache"
            checked += 1
    assert checked >= 6  # plain on every mesh; prompt lookup, EAGLE-3 and the hybrid on (2, 4)


def test_bad_meshes_are_refused_by_name(report):
    errors = report["errors"]
    assert errors["heads_do_not_divide"].startswith("ShardingError: 6 heads")
    # 2 fits: the 3 kv heads repeat up to the 6 query heads.
    assert "this model fits: [1, 2]" in errors["heads_do_not_divide"]
    assert "rules={'heads': None}" in errors["heads_do_not_divide"]
    assert "unknown logical axis name(s) ['experts']" in errors["unknown_rule"]
    assert "'tensor' names no axis" in errors["rule_to_missing_axis"]
    assert "names no axis of the mesh ('rows', 'cols')" in errors["unknown_mesh_axis"]
    assert "needs 16 devices; 8 are visible" in errors["too_many_devices"]
    assert "same mesh" in errors["draft_on_other_mesh"]
    # Gemma's per-type kv heads are split, never repeated: a mesh axis they do not divide is named.
    assert errors["gemma_kv_heads_do_not_divide"].startswith("ShardingError: the 4 kv heads of this GemmaConfig")
    assert report["placement"]["gemma_2x4"]["k_proj"] == ["P('model', None)"] * 2  # local and global layers


def test_rules_can_replicate_attention(report):
    assert report["replicated_attention"]["same_tokens"]
    assert "heads" not in report["replicated_attention"]["plan"].split("split: ")[1].replace("kv heads", "")


# --- on one device ---------------------------------------------------------------------------

def test_repeated_kv_heads_are_the_same_function():
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=6, num_kv_heads=3, head_dim=8, ffn_dim=48,
                      rotary_dim=8, attention_bias=True)
    params = llama.init_params(cfg, jax.random.PRNGKey(0), scale=0.2)
    tokens = jnp.asarray([[1, 5, 9, 2, 7, 3]], jnp.int32)

    def logits(cfg, params):  # one jit per config (eager, each op compiled alone: ~250 compiles)
        out, _, _ = _llama_forward(params, cfg, tokens, KVCache.create(cfg, 1, 8))
        return np.asarray(out)

    # The same function, not the same program: the narrow model's fused q/k/v product and the
    # wide one's separate products are dots of other shapes, which XLA:CPU may block and sum in
    # another order (bitwise equal on some CPUs; 3e-5 relative apart on CI's). The tolerance
    # is float32 rounding's; a wrongly repeated head moves the logits by whole units.
    wide_cfg, wide = sharding.repeat_kv_heads(cfg, params, 2)
    assert wide_cfg.num_kv_heads == 6 and wide.layers[0].attention.k_proj.shape == (48, 32)
    np.testing.assert_allclose(logits(wide_cfg, wide), logits(cfg, params), rtol=1e-5, atol=1e-5)
    int8 = quant.convert(params, "int8")
    int8_cfg, int8_wide = sharding.repeat_kv_heads(cfg, int8, 2)
    np.testing.assert_allclose(logits(int8_cfg, int8_wide), logits(cfg, int8), rtol=1e-5, atol=1e-5)
    # A repeat that pairs kv heads with the wrong query heads is not within that tolerance.
    swapped = wide.replace(layers=[layer.replace(attention=layer.attention.replace(
        k_proj=jnp.roll(layer.attention.k_proj, 8, axis=0), k_bias=jnp.roll(layer.attention.k_bias, 8, axis=0)))
        for layer in wide.layers])
    assert not np.allclose(logits(wide_cfg, swapped), logits(cfg, params), rtol=1e-5, atol=1e-5)


def test_plan_checks_happen_before_anything_compiles(tiny_model):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(sharding.ShardingError, match="needs a jax.sharding.Mesh"):
        jaxspec.shard(tiny_model, {"data": 1})
    with pytest.raises(sharding.ShardingError, match="rules must map"):
        jaxspec.shard(tiny_model, mesh, rules=[("heads", "model")])
    with pytest.raises(jaxspec.InvalidRequestError, match="shard takes a jaxspec Model"):
        jaxspec.shard(tiny_model.params, mesh)
    with pytest.raises(sharding.ShardingError, match="positive integer"):
        jaxspec.make_mesh(data=0)
    for bad in ("data=2,tensor=4", "data=two", "model=2,model=4", "data"):
        with pytest.raises(sharding.ShardingError, match="--mesh takes"):
            sharding.parse_mesh(bad)
    assert sharding.parse_mesh("data=2,model=4") == {"data": 2, "model": 4}


def test_a_one_device_mesh_generates_what_no_mesh_does(tiny_model):
    sharded = jaxspec.shard(tiny_model, jaxspec.make_mesh(1, 1))
    prompts = [[5, 6, 7, 5, 6], [9, 10]]
    plain = jaxspec.generate(tiny_model, None, prompts, max_new_tokens=8, method="ngram")
    on_mesh = jaxspec.generate(sharded, None, prompts, max_new_tokens=8, method="ngram")
    assert on_mesh.tokens == plain.tokens and on_mesh.finish_reason == plain.finish_reason
    assert isinstance(sharded, Model) and sharded.sharding.mesh.shape == {"data": 1, "model": 1}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def test_two_processes_on_one_mesh_get_the_tokens_of_one(report, tmp_path):
    """Two processes on localhost, 4 CPU devices each, the coordinator on a free port: a sharded
    generate over the (2, 4) mesh spanning both returns the unsharded run's tokens."""
    out = tmp_path / "tokens.json"
    failures = []
    for _ in range(2):  # a launch that fails (a port taken meanwhile, a coordinator timeout) is retried once
        port = _free_port()
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        worker = Path(__file__).with_name("multihost_worker.py")
        procs = [subprocess.Popen([sys.executable, str(worker), str(rank), str(port), str(out)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for rank in (1, 0)]
        try:
            errors = [proc.communicate(timeout=300)[1] for proc in procs]  # ~20 s when it works
        finally:
            for proc in procs:
                proc.kill()
        if all(proc.returncode == 0 for proc in procs):
            break
        failures.append("\n".join(f"rank {rank} exit {proc.returncode}: {error[-2000:]}"
                                  for rank, proc, error in zip((1, 0), procs, errors)))
    assert len(failures) < 2, "\n---\n".join(failures)
    got = json.loads(out.read_text())
    assert (got["processes"], got["devices"], got["local_devices"]) == (2, 8, 4)
    assert got["tokens"] == report["tokens"]["ngram"]["unsharded"]


def test_deltanet_channels_grouped_by_key_head_are_the_same_function():
    """The Qwen3.5 DeltaNet's q/k/v channels regrouped per key head (what a split of its key heads
    needs): the same logits in a prefill and in a step that reads the conv state it left."""
    cfg = qwen35.Qwen35Config(
        vocab_size=64, dim=16, num_layers=2, layer_types=("linear_attention", "full_attention"), ffn_dim=24,
        num_heads=2, num_kv_heads=1, head_dim=8, rotary_dim=2, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=4, linear_value_head_dim=3)
    params = qwen35.init_params(cfg, jax.random.PRNGKey(0), scale=0.3)
    grouped = gated_deltanet.grouped_by_key_head(params, cfg)
    assert grouped.layers[0].delta_net.channels_by_key_head
    order = gated_deltanet.key_head_channel_order(cfg)
    assert sorted(order.tolist()) == list(range(cfg.conv_dim)) and order.tolist() != list(range(cfg.conv_dim))
    tokens = jnp.asarray([[3, 9, 1, 7, 12, 5]], jnp.int32)

    def run(params):  # jitted (eager, each op compiled alone: ~450 compiles)
        cache = models.create_cache(cfg, 1, 16)
        prefill, _, cache = _any_forward(params, cfg, tokens[:, :5], cache)
        step, _, _ = _any_forward(params, cfg, tokens[:, 5:], cache.set_length(jnp.asarray([5], jnp.int32)))
        return np.asarray(prefill), np.asarray(step)

    for ours, reference in zip(run(grouped), run(params)):
        np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-6)


def test_a_misfit_names_the_sizes_that_fit_whatever_the_devices_visible():
    """SmolLM2-135M's shape (9 heads, 3 kv heads, ffn 1536, vocab 49152) fits a model axis of 1 or 3
    (1536 / 9 is no whole number): the hint lists both on a machine with one device, and the kv
    heads alone, repeated up to the query heads, fit 9 as well."""
    smollm2 = ModelConfig(vocab_size=49152, dim=576, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64,
                          ffn_dim=1536, rotary_dim=64)
    counts, rules = sharding.axis_counts(smollm2), dict(sharding.DEFAULT_RULES)
    assert sharding._sizes_that_fit("model", counts, rules) == [1, 3]
    attention_only = {name: (axis if name in ("heads", "kv_heads") else None) for name, axis in rules.items()}
    assert sharding._sizes_that_fit("model", counts, attention_only) == [1, 3, 9]
    with pytest.raises(sharding.ShardingError, match=r"needs 4 devices; 1 is visible \(cpu\); on a CPU, "
                                                     r"XLA_FLAGS=--xla_force_host_platform_device_count=4"):
        jaxspec.make_mesh(data=2, model=2)
