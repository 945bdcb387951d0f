"""The multi-device half of tests/test_sharding.py, run in a subprocess with 8 CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`, which must be set before jax starts).

Runs every case unsharded and on each mesh, and prints one JSON object: tokens per case and
mesh, the params' and caches' shardings, bytes per device, what the compiled decode loop
holds (host callbacks, all-gathers and their shapes), and the errors bad meshes raise.
`python tests/sharding_worker.py` alone prints the same.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 " + os.environ.get("XLA_FLAGS", "")

import jax  # noqa: E402

import jaxspec  # noqa: E402
from jaxspec.api import Model, prepare  # noqa: E402
from jaxspec.config import ModelConfig  # noqa: E402
from jaxspec.config import RopeScaling, RopeType  # noqa: E402
from jaxspec.models import assistant, eagle3, gemma, llama, mtp, qwen35  # noqa: E402
from jaxspec.spec import loop  # noqa: E402

# 8 query heads and 4 kv heads: on (1, 8) the kv heads do not divide and are replicated.
TARGET = ModelConfig(vocab_size=256, dim=64, num_layers=3, num_heads=8, num_kv_heads=4, head_dim=8, ffn_dim=128,
                     rotary_dim=8, max_position_embeddings=512, eos_token_ids=(3,))
DRAFT = ModelConfig(vocab_size=256, dim=32, num_layers=1, num_heads=8, num_kv_heads=8, head_dim=4, ffn_dim=64,
                    rotary_dim=4, max_position_embeddings=512, eos_token_ids=(3,))
HEAD = eagle3.Eagle3Config(dim=64, num_heads=8, num_kv_heads=4, head_dim=8, ffn_dim=128, draft_vocab_size=64,
                           vocab_size=256, rope_theta=10000.0, rotary_dim=8, norm_eps=1e-5,
                           max_position_embeddings=512, aux_layer_ids=(0, 1, 2))
HYBRID = qwen35.Qwen35Config(
    vocab_size=256, dim=32, num_layers=2, layer_types=("linear_attention", "full_attention"), ffn_dim=64,
    num_heads=4, num_kv_heads=2, head_dim=8, rotary_dim=2, linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=4, linear_value_head_dim=4, max_position_embeddings=512, eos_token_ids=(3,))
# Gemma 4: local and global layers (4 kv heads each, the global ones twice as wide, values = keys),
# per-layer inputs, the last two layers sharing K/V; and a shared-KV assistant for it.
_LOCAL = gemma.GemmaAttention(num_heads=8, num_kv_heads=4, head_dim=8, rotary_dim=8, rope_theta=1e4, window=6)
GEMMA = gemma.GemmaConfig(
    generation=4, vocab_size=256, dim=32, num_layers=4, layer_types=("sliding_attention", "full_attention") * 2,
    ffn_dim=64, sliding=_LOCAL, query_scale=1.0, per_layer_dim=4, per_layer_vocab=256, num_kv_shared_layers=2,
    full=gemma.GemmaAttention(num_heads=8, num_kv_heads=4, head_dim=16, rotary_dim=16, rope_theta=1e6,
                              values_from_keys=True,
                              rope_scaling=RopeScaling(rope_type=RopeType.PROPORTIONAL, rotated_fraction=0.25)),
    max_position_embeddings=512, eos_token_ids=(3,))
ASSISTANT = assistant.AssistantConfig(text=dataclasses.replace(GEMMA, dim=16, num_layers=2, per_layer_dim=0,
                                                               per_layer_vocab=0, num_kv_shared_layers=0),
                                      backbone_dim=32)
# A ragged batch: 3 rows of different lengths (padded to whole "data" shards on a mesh), with
# repeats for prompt lookup to find.
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8], [10, 11, 12], [20, 21, 22, 23, 20, 21, 22, 30, 31, 20, 21]]
MESHES = [(8, 1), (2, 4), (1, 8)]  # data parallel only; both; tensor parallel only (kv heads repeated)
# Every case runs on (2, 4), which splits both axes; each one-axis mesh runs plain and one more:
# seeded sampling over the data-only mesh (each shard draws its own rows' keys), a proposer with
# its own cache (EAGLE-3) over the model-only one (each run is two compiles).
CASES_ON = {"8x1": ("plain", "sampling_plain"), "2x4": None, "1x8": ("plain", "eagle3")}
LOOPS_ON = {"8x1": ("plain",), "2x4": ("plain", "ngram", "eagle3"), "1x8": ("plain",)}
NEW_TOKENS = 20


def cases(target: Model, draft: Model, head: Model) -> dict:
    """name -> (draft, options): every proposer kind, greedy, plus seeded sampling."""
    return {
        "plain": (None, {}),
        "ngram": (None, {"method": "ngram", "num_draft_tokens": 3}),
        "draft": (draft, {"num_draft_tokens": 3}),
        "eagle3": (head, {"num_draft_tokens": 3}),
        "sampling_draft": (draft, {"num_draft_tokens": 3, "temperature": 0.8, "top_p": 0.9, "seed": 3}),
        "sampling_plain": (None, {"temperature": 1.0, "seed": 5}),
    }


def run(model: Model, draft, options: dict) -> list[list[int]]:
    result = jaxspec.generate(model, draft, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, **options)
    return result.tokens


def per_device_bytes(tree) -> dict:
    """Total bytes of the tree's arrays and the most any one device holds of them."""
    total, per_device = 0, {}
    for leaf in jax.tree.leaves(tree):
        total += leaf.nbytes
        for shard in leaf.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    return {"total": total, "max_per_device": max(per_device.values())}


def compiled_loop(model: Model, draft, options: dict) -> dict:
    """What the compiled decode loop of a sharded request holds."""
    prepared = prepare(model, draft, PROMPTS, max_new_tokens=NEW_TOKENS, **options)
    draft_inputs = prepared.speculation.draft_inputs(model)
    state = loop.prefill_jit(model.params, draft_inputs, prepared.request, spec=prepared.spec)
    hlo = loop.decode_jit.lower(model.params, draft_inputs, state, prepared.request,
                                spec=prepared.spec).compile().as_text()
    return {
        "custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo))),
        "all_gather_shapes": sorted(set(re.findall(r"= (\S+?)\{[^}]*\} all-gather\(", hlo))),
        "all_reduce_count": hlo.count(" all-reduce("),
        "history_shape": list(state.tokens.shape),
        "tokens_spec": str(state.tokens.sharding.spec),
        "cache_spec": str(state.cache.keys[0].sharding.spec),
        "proposer_cache_specs": sorted({str(leaf.sharding.spec) for leaf in jax.tree.leaves(state.proposer_state)
                                        if leaf.ndim == 4}),
    }


def error_of(call) -> str:
    try:
        call()
    except jaxspec.JaxspecError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def main() -> None:
    target = Model(config=TARGET, params=llama.init_params(TARGET, jax.random.PRNGKey(0), scale=0.2))
    draft = Model(config=DRAFT, params=llama.init_params(DRAFT, jax.random.PRNGKey(1), scale=0.2))
    head = Model(config=HEAD, params=eagle3.init_params(HEAD, jax.random.PRNGKey(2), scale=0.2))
    report = {"devices": len(jax.devices()), "tokens": {}, "placement": {}, "loops": {}}
    for name, (case_draft, options) in cases(target, draft, head).items():
        report["tokens"][name] = {"unsharded": run(target, case_draft, options)}
    for shape in MESHES:
        key = "x".join(map(str, shape))
        sharded = jaxspec.shard(target, jaxspec.make_mesh(*shape))
        for name, (case_draft, options) in cases(target, draft, head).items():
            if CASES_ON[key] is None or name in CASES_ON[key]:
                report["tokens"][name][key] = run(sharded, case_draft, options)
        layer = sharded.params.layers[0]
        report["placement"][key] = {
            "plan": str(sharded.sharding),
            "q_proj": str(layer.attention.q_proj.sharding.spec),
            "k_proj": str(layer.attention.k_proj.sharding.spec),
            "o_proj": str(layer.attention.o_proj.sharding.spec),
            "gate_proj": str(layer.mlp.gate_proj.sharding.spec),
            "down_proj": str(layer.mlp.down_proj.sharding.spec),
            "embed": str(sharded.params.embed.sharding.spec),
            "fused": layer.attention.qkv_proj is not None,
            "params_bytes": per_device_bytes(sharded.params),
            "int8_embed_scales": str(jaxspec.convert_weights(sharded, "int8").params.embed.scales.sharding.spec),
        }
        report["loops"][key] = {name: compiled_loop(sharded, case_draft, options)
                                for name, (case_draft, options) in cases(target, draft, head).items()
                                if name in LOOPS_ON[key]}
    # On the (2, 4) mesh: a draft tree, layer-skip (the target's own first layers, so its own
    # sharding) and an MTP head, each the same tokens as unsharded.
    on_24 = jaxspec.shard(target, jaxspec.make_mesh(2, 4))
    mtp_cfg = mtp.MtpConfig(block=dataclasses.replace(TARGET, num_layers=1))
    mtp_head = Model(config=mtp_cfg, params=mtp.init_params(mtp_cfg, jax.random.PRNGKey(5), scale=0.2))
    for name, case_draft, options in (("tree_draft", draft, {"tree": (2, 2, 4)}),
                                      ("layer_skip", None, {"method": "layer_skip", "exit_layer": 2,
                                                            "num_draft_tokens": 3}),
                                      ("mtp", mtp_head, {"num_draft_tokens": 2})):
        report["tokens"][name] = {"unsharded": run(target, case_draft, options), "2x4": run(on_24, case_draft, options)}
    # The Qwen3.5 hybrid (DeltaNet layers beside attention) on (2, 4), prompt lookup (its rounds
    # without a match are plain steps).
    hybrid = Model(config=HYBRID, params=qwen35.init_params(HYBRID, jax.random.PRNGKey(4), scale=0.2))
    sharded_hybrid = jaxspec.shard(hybrid, jaxspec.make_mesh(2, 4))
    ngram = {"method": "ngram", "num_draft_tokens": 3}
    report["tokens"]["hybrid_ngram"] = {"unsharded": run(hybrid, None, ngram), "2x4": run(sharded_hybrid, None, ngram)}
    report["loops"]["2x4"]["hybrid_ngram"] = compiled_loop(sharded_hybrid, None, ngram)
    report["placement"]["hybrid_2x4"] = {"plan": str(sharded_hybrid.sharding),
                                         "params_bytes": per_device_bytes(sharded_hybrid.params)}
    # Gemma 4 on (2, 4): plain, prompt lookup and the assistant (reading the sharded target cache).
    gemma_model = Model(config=GEMMA, params=gemma.init_params(GEMMA, jax.random.PRNGKey(6), scale=0.3))
    helper = Model(config=ASSISTANT, params=assistant.init_params(ASSISTANT, jax.random.PRNGKey(7), scale=0.3))
    sharded_gemma = jaxspec.shard(gemma_model, jaxspec.make_mesh(2, 4))
    for name, case_draft, options in (("gemma_plain", None, {}), ("gemma_ngram", None, ngram),
                                      ("gemma_assistant", helper, {"num_draft_tokens": 3})):
        report["tokens"][name] = {"unsharded": run(gemma_model, case_draft, options),
                                  "2x4": run(sharded_gemma, case_draft, options)}
    report["placement"]["gemma_2x4"] = {
        "k_proj": [str(layer.attention.k_proj.sharding.spec) for layer in sharded_gemma.params.layers[:2]]}
    mesh24 = jaxspec.make_mesh(2, 4)
    odd = ModelConfig(vocab_size=256, dim=48, num_layers=1, num_heads=6, num_kv_heads=3, head_dim=8, ffn_dim=96,
                      rotary_dim=8)
    odd_model = Model(config=odd, params=llama.init_params(odd, jax.random.PRNGKey(3)))
    report["errors"] = {
        "heads_do_not_divide": error_of(lambda: jaxspec.shard(odd_model, mesh24)),
        "unknown_rule": error_of(lambda: jaxspec.shard(target, mesh24, rules={"experts": "model"})),
        "rule_to_missing_axis": error_of(lambda: jaxspec.shard(target, mesh24, rules={"heads": "tensor"})),
        "unknown_mesh_axis": error_of(lambda: jaxspec.shard(target, jax.make_mesh((2, 4), ("rows", "cols")))),
        "too_many_devices": error_of(lambda: jaxspec.make_mesh(4, 4)),
        "gemma_kv_heads_do_not_divide": error_of(lambda: jaxspec.shard(gemma_model, jaxspec.make_mesh(1, 8))),
        "draft_on_other_mesh": error_of(lambda: run(jaxspec.shard(target, mesh24),
                                                    jaxspec.shard(draft, jaxspec.make_mesh(8, 1)), {})),
    }
    replicated_attention = jaxspec.shard(odd_model, mesh24, rules={"heads": None, "kv_heads": None})
    report["replicated_attention"] = {
        "plan": str(replicated_attention.sharding),
        "same_tokens": run(replicated_attention, None, {}) == run(odd_model, None, {}),
    }
    json.dump(report, sys.stdout)
    print()


if __name__ == "__main__":
    main()
