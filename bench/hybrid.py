"""The hybrid trunk's price for exact rollback: state bytes per verify and verify forward cost.

    . .venv/bin/activate && python bench/hybrid.py

A verify forward over T = k + 1 tokens on the Qwen3.5 hybrid records, for every DeltaNet layer,
the recurrent state after each of the T positions (plus the conv inputs), so that the commit can
select each row's accepted state by index. A Llama trunk rolls back by length alone: its extra
bytes are zero. Part 1 counts those bytes (exactly, from `jax.eval_shape` of the forward: nothing
is allocated) for the benchmark's small hybrid and for transformers' default Qwen3.5 text config
(Qwen3.5-9B-like shapes). Part 2 times a verify forward at T = 1..9 (forward alone, and forward +
commit, i.e. the selection of the accepted state) on the small hybrid and on a Llama config of the
same width, depth and parameter count, batch 1, after a 256-token prefill. Runs interleaved
(hybrid, Llama, per T) so drift on a shared machine hits both alike; figures are medians.
The table replaces the `## Hybrid trunk (bench/hybrid.py)` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.models import llama, qwen35
from jaxspec.models.params import is_shape
from jaxspec.models.qwen35 import DeltaRule, LayerType, Qwen35Cache, Qwen35Config
from results_md import add_output_options, publish  # bench/ is on sys.path when a bench script runs

HERE = pathlib.Path(__file__).resolve().parent
SECTION = "## Hybrid trunk (bench/hybrid.py)"
RERUN = ". .venv/bin/activate && python bench/hybrid.py"
LIN, FULL = LayerType.LINEAR_ATTENTION, LayerType.FULL_ATTENTION

# The benchmark's hybrid: Qwen3.5's layout at small width (3 DeltaNet layers, then attention).
HYBRID = Qwen35Config(
    vocab_size=8192, dim=512, num_layers=8, layer_types=(LIN, LIN, LIN, FULL) * 2, ffn_dim=1536,
    num_heads=8, num_kv_heads=2, head_dim=64, rotary_dim=16, rope_theta=10_000_000.0,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    max_position_embeddings=1024)


def param_count(shapes) -> int:
    return sum(math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=is_shape))


def matching_llama(hybrid: Qwen35Config) -> ModelConfig:
    """Same width, depth, heads and vocabulary; the FFN sized so the parameter counts match."""
    base = ModelConfig(vocab_size=hybrid.vocab_size, dim=hybrid.dim, num_layers=hybrid.num_layers,
                       num_heads=hybrid.num_heads, num_kv_heads=hybrid.num_kv_heads, head_dim=hybrid.head_dim,
                       ffn_dim=hybrid.ffn_dim, rotary_dim=hybrid.head_dim, rope_theta=hybrid.rope_theta,
                       max_position_embeddings=hybrid.max_position_embeddings, tie_embeddings=hybrid.tie_embeddings)
    extra = param_count(qwen35.param_shapes(hybrid)) - param_count(llama.param_shapes(base))
    ffn = hybrid.ffn_dim + round(extra / (3 * hybrid.dim * hybrid.num_layers) / 64) * 64
    return dataclasses.replace(base, ffn_dim=ffn)


def hf_default_config() -> Qwen35Config:
    """transformers' Qwen3_5TextConfig() defaults, through jaxspec's own config.json parser."""
    import transformers

    hf = transformers.Qwen3_5TextConfig().to_dict()
    return qwen35.config_from_hf({**hf, "model_type": "qwen3_5_text"})


# ----------------------------------------------------------------------------------------------
# Part 1: bytes
# ----------------------------------------------------------------------------------------------


def nbytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def abstract_params(cfg: Qwen35Config):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), qwen35.param_shapes(cfg), is_leaf=is_shape)


def verify_bytes(cfg: Qwen35Config, steps: int, capacity: int = 64) -> dict[str, int]:
    """Per row: bytes the T-token verify forward records for the commit (pending DeltaNet states +
    conv inputs), the ring kept across rounds, and the K/V it writes, all from eval_shape.
    "pending_chunked": the same forward run in the chunked form, which records only the
    per-position k, v, decay, beta (the commit recomputes the selected state from the ring's)."""
    cache = jax.eval_shape(lambda: Qwen35Cache.create(cfg, 1, capacity))
    tokens = jax.ShapeDtypeStruct((1, steps), jnp.int32)
    pending = {}
    for rule in (DeltaRule.RECURRENT, DeltaRule.CHUNKED):
        _, _, after = jax.eval_shape(lambda p, c, t: qwen35.forward(p, cfg, t, c, delta_rule=rule),
                                     abstract_params(cfg), cache, tokens)
        pending[rule] = nbytes(after.pending)
    kv_written = 2 * len(cfg.attention_layers) * cfg.num_kv_heads * cfg.head_dim * 4 * steps
    return {"pending": pending[DeltaRule.RECURRENT], "pending_chunked": pending[DeltaRule.CHUNKED],
            "ring": nbytes((cache.conv, cache.ssm)), "kv_written": kv_written}


def llama_kv_bytes(cfg: ModelConfig, steps: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * steps


# ----------------------------------------------------------------------------------------------
# Part 2: time
# ----------------------------------------------------------------------------------------------


def _median_ms(fn, *args, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _verify_and_commit(fwd, params, cfg, tokens, cache):
    """A verify round's trunk work: logits for all T positions, then every position accepted."""
    logits, _, cache = fwd(params, cfg, tokens, cache)
    return logits, cache.advance(jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32))


def timing(hybrid: Qwen35Config, llama_cfg: ModelConfig, steps_range, context: int, reps: int) -> list[dict]:
    capacity = context + max(steps_range) + 16
    key = jax.random.PRNGKey(0)
    hybrid_params = qwen35.init_params(hybrid, key, scale=0.05)
    llama_params = llama.init_params(llama_cfg, key, scale=0.05)
    prompt = jax.random.randint(key, (1, context), 0, hybrid.vocab_size)

    chunked_forward = functools.partial(qwen35.forward, delta_rule=DeltaRule.CHUNKED)
    trunks = {}
    for name, cfg, params, fwd, create in (
        ("hybrid", hybrid, hybrid_params, qwen35.forward, Qwen35Cache.create),
        ("hybrid_chunked", hybrid, hybrid_params, chunked_forward, Qwen35Cache.create),
        ("llama", llama_cfg, llama_params, llama.forward, KVCache.create),
    ):
        prefill = jax.jit(lambda p, c, t, fwd=fwd, cfg=cfg: fwd(p, cfg, t, c)[2].set_length(jnp.full((1,), context)))
        cache = jax.block_until_ready(prefill(params, create(cfg, 1, capacity), prompt))
        forward_only = jax.jit(lambda p, c, t, fwd=fwd, cfg=cfg: fwd(p, cfg, t, c)[0])
        forward_commit = jax.jit(lambda p, c, t, fwd=fwd, cfg=cfg: _verify_and_commit(fwd, p, cfg, t, c))
        trunks[name] = (params, cache, forward_only, forward_commit)

    rows = []
    for steps in steps_range:
        tokens = jax.random.randint(jax.random.PRNGKey(steps), (1, steps), 0, hybrid.vocab_size)
        row = {"T": steps}
        for name, (params, cache, forward_only, forward_commit) in trunks.items():
            for fn in (forward_only, forward_commit):  # compile + warm
                jax.block_until_ready(fn(params, cache, tokens))
        # Interleaved: each rep of each measurement alternates between the trunks.
        samples = {(n, m): [] for n in trunks for m in ("forward", "commit")}
        for _ in range(reps):
            for name, (params, cache, forward_only, forward_commit) in trunks.items():
                samples[(name, "forward")].append(_median_ms(forward_only, params, cache, tokens, reps=1))
                samples[(name, "commit")].append(_median_ms(forward_commit, params, cache, tokens, reps=1))
        for (name, what), values in samples.items():
            row[f"{name}_{what}"] = statistics.median(values)
        rows.append(row)
        print(f"T={steps}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items() if k != "T"), flush=True)
    return rows


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def build_section(args, llama_cfg, bytes_rows, real_cfg, real_rows, time_rows) -> str:
    hybrid = HYBRID
    lines = [SECTION, ""]
    lines.append(f"Rerun: `{RERUN}`. {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
                 f"(shared), jax {jax.__version__} on {jax.default_backend()}; float32.")
    lines.append("")
    lines.append(f"Small hybrid: D={hybrid.dim}, L={hybrid.num_layers} ({len(hybrid.linear_layers)} Gated DeltaNet + "
                 f"{len(hybrid.attention_layers)} gated attention), DeltaNet E={hybrid.linear_num_value_heads} value "
                 f"heads x {hybrid.linear_key_head_dim}x{hybrid.linear_value_head_dim} state, "
                 f"{param_count(qwen35.param_shapes(hybrid)) / 1e6:.1f}M params. Llama of equal size: same D, L, "
                 f"heads (N={llama_cfg.num_heads}, K={llama_cfg.num_kv_heads}, H={llama_cfg.head_dim}), F={llama_cfg.ffn_dim}, "
                 f"{param_count(llama.param_shapes(llama_cfg)) / 1e6:.1f}M params. Rollback ring R = "
                 f"{hybrid.rollback_states} states per DeltaNet layer.")
    lines.append("")
    lines.append("Rollback bytes per row. *Recorded per verify*: what a T-token verify forward keeps so the "
                 "commit can select each row's accepted state by index (the DeltaNet state after every "
                 "position, plus the conv inputs); it lives until the commit. *Ring*: committed states kept "
                 "across rounds (R of them, for rollback without a forward). Llama keeps nothing extra: "
                 "rollback is by length. *K/V written* is what both write into their caches anyway.")
    lines.append("")
    lines.append("| T | hybrid: recorded per verify | hybrid, chunked record | hybrid: ring | hybrid: K/V written | "
                 "Llama: extra | Llama: K/V written | Qwen3.5 default: recorded per verify | "
                 "Qwen3.5 default, chunked record |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row, real in zip(bytes_rows, real_rows):
        lines.append(f"| {row['T']} | {mib(row['pending'])} | {mib(row['pending_chunked'])} | {mib(row['ring'])} | "
                     f"{mib(row['kv_written'])} | 0 | {mib(row['llama_kv'])} | {mib(real['pending'])} | "
                     f"{mib(real['pending_chunked'])} |")
    lines.append("")
    lines.append("All in MiB. *Chunked record*: the same verify run in the chunked form "
                 "(`Qwen35Config(recorded_steps=0)`, or `delta_rule=DeltaRule.CHUNKED`), which keeps each "
                 "position's k, v, decay and beta (the start state is the ring's) and whose commit recomputes "
                 "the selected state from them: one chunk of matmuls instead of an index.")
    lines.append("")
    lines.append(f"The last column is transformers' default `Qwen3_5TextConfig` (D={real_cfg.dim}, "
                 f"{len(real_cfg.linear_layers)} DeltaNet layers with {real_cfg.linear_num_value_heads} x "
                 f"{real_cfg.linear_key_head_dim}x{real_cfg.linear_value_head_dim} states): its ring of R = "
                 f"{real_cfg.rollback_states} costs {mib(real_rows[0]['ring'])} MiB per row.")
    lines.append("")
    if time_rows:
        lines.append(f"Verify forward, batch 1, after a {args.context}-token prefill; median of {args.reps} "
                     "interleaved runs (ms). *forward*: logits only (XLA drops the state and K/V writes "
                     "nobody reads); *+ commit*: logits and the cache advanced by T (recording the states, "
                     "selecting the accepted one and writing it into the ring included).")
        lines.append("")
        lines.append("| T | hybrid forward | hybrid + commit | hybrid chunked + commit | Llama forward | "
                     "Llama + commit | hybrid / Llama (+ commit) |")
        lines.append("|---:|---:|---:|---:|---:|---:|---:|")
        for row in time_rows:
            ratio = row["hybrid_commit"] / row["llama_commit"]
            lines.append(f"| {row['T']} | {row['hybrid_forward']:.2f} | {row['hybrid_commit']:.2f} | "
                         f"{row['hybrid_chunked_commit']:.2f} | {row['llama_forward']:.2f} | "
                         f"{row['llama_commit']:.2f} | {ratio:.2f} |")
        lines.append("")
        real_weights = 2 * param_count(qwen35.param_shapes(real_cfg))  # bf16
        steps5 = min(5, len(real_rows))
        verify5 = real_rows[steps5 - 1]
        lines.append("On a shared CPU the absolute times wander and XLA's matmul strategy changes with T in both "
                     "trunks alike (hence the non-monotonic rows); the ratio column is the comparison. At this "
                     "width a verify is weight-bandwidth bound and recording the states costs little. At the "
                     f"default Qwen3.5 shapes a T = {steps5} verify records "
                     f"{mib(verify5['pending'])} MiB per row: at batch 32 that is "
                     f"{32 * verify5['pending'] / 2**30:.1f} GiB written and read back per round, against "
                     f"{real_weights / 2**30:.1f} GiB of bf16 weights per forward; the chunked record keeps "
                     f"{mib(verify5['pending_chunked'])} MiB.")
        lines.append("")
        first, last = time_rows[0], time_rows[-1]
        lines.append(f"Cost of T = {last['T']} vs T = {first['T']} (+ commit): hybrid "
                     f"{last['hybrid_commit'] / first['hybrid_commit']:.2f}x, Llama "
                     f"{last['llama_commit'] / first['llama_commit']:.2f}x.")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-t", type=int, default=9)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--bytes-only", action="store_true", help="skip the timing (part 2)")
    add_output_options(parser)
    args = parser.parse_args()

    llama_cfg = matching_llama(HYBRID)
    real_cfg = hf_default_config()
    steps_range = range(1, args.max_t + 1)
    bytes_rows = [{"T": t, **verify_bytes(HYBRID, t), "llama_kv": llama_kv_bytes(llama_cfg, t)} for t in steps_range]
    real_rows = [verify_bytes(real_cfg, t) for t in steps_range]
    time_rows = [] if args.bytes_only else timing(HYBRID, llama_cfg, steps_range, args.context, args.reps)
    section = build_section(args, llama_cfg, bytes_rows, real_cfg, real_rows, time_rows)
    publish(section, SECTION, args.results, write=not args.no_write)


if __name__ == "__main__":
    main()
