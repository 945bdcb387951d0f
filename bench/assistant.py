"""The shared-KV assistant's cost: one assistant step against one target step, and a round.

    . .venv/bin/activate && python bench/assistant.py
    . .venv/bin/activate && python bench/assistant.py --calls 3 --no-write   # a quick look

No trained Gemma 4 assistant (nor any real Gemma 4 checkpoint) fits this machine, so this
measures what does not depend on training: the cost of the assistant's forward next to its
target's, on random weights of two shape sets, and the round it makes (k assistant steps plus
one T = k + 1 verify) against k + 1 plain steps. Acceptance, and so wall-clock speedup, needs a
trained assistant; the table says how many accepted drafts per round a round must average to
pay for itself at these costs (`break-even tau`).

Shapes (float32, batch 1, a cache of --capacity slots holding --length tokens):
- `tiny`: tests/test_assistant.py's (target D = 32, 5 layers, V = 128; assistant D = 24, 3 layers);
- `small`: a Gemma 4 E2B-like layout scaled to this CPU: target D = 512, 12 layers (the last 4
  KV-shared), 8 query heads over 1 kv head of width 128 (global layers 256, values = keys),
  per-layer inputs of width 64, V = 262,144 as Gemma's; assistant D = 256, 4 layers, the same
  kv layout, with the plain tied head and with the centroid-masked head (2048 clusters, top 32:
  4096 of the 262,144 tokens scored).
Each program is jitted once and timed as the median of --calls calls, each running --iters
forwards in a `fori_loop` (interleaved across programs, so drift hits them alike). The table
replaces the `## Shared-KV assistant (bench/assistant.py)` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from results_md import add_output_options, replace_section

from jaxspec.config import RopeScaling, RopeType
from jaxspec.models import assistant, create_cache, forward, gemma

HERE = pathlib.Path(__file__).resolve().parent
SECTION = "## Shared-KV assistant (bench/assistant.py)"
S, F = gemma.LayerType.SLIDING, gemma.LayerType.FULL


def _target(dim, pattern, heads, kv_heads, head_dim, global_head_dim, ffn, vocab, per_layer, shared, window):
    layers = len(pattern)
    local = gemma.GemmaAttention(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rotary_dim=head_dim,
                                 rope_theta=10_000.0, window=window)
    full = gemma.GemmaAttention(num_heads=heads, num_kv_heads=kv_heads, head_dim=global_head_dim,
                                rotary_dim=global_head_dim, rope_theta=1e6, values_from_keys=True,
                                rope_scaling=RopeScaling(rope_type=RopeType.PROPORTIONAL, rotated_fraction=0.25))
    return gemma.GemmaConfig(generation=4, vocab_size=vocab, dim=dim, num_layers=layers, layer_types=pattern,
                             ffn_dim=ffn, sliding=local, full=full, query_scale=1.0, final_logit_softcap=30.0,
                             per_layer_dim=per_layer, per_layer_vocab=vocab if per_layer else 0,
                             num_kv_shared_layers=shared, max_position_embeddings=4096)


def _assistant(target: gemma.GemmaConfig, dim, layers, ffn, centroids=None):
    text = dataclasses.replace(target, dim=dim, num_layers=layers, ffn_dim=ffn,
                               layer_types=tuple(S if i < layers - 1 else F for i in range(layers)),
                               per_layer_dim=0, per_layer_vocab=0, num_kv_shared_layers=0, final_logit_softcap=None)
    return assistant.AssistantConfig(text=text, backbone_dim=target.dim, num_centroids=centroids,
                                     centroid_top_k=32)


def shape_sets():
    tiny = _target(32, (S, F, S, S, F), 4, 1, 8, 16, 64, 128, 8, 2, 5)
    small = _target(512, (S, S, S, F) * 3, 8, 1, 128, 256, 2048, 262_144, 64, 4, 512)
    return {
        "tiny": (tiny, {"tied head": _assistant(tiny, 24, 3, 48)}),
        "small": (small, {"tied head": _assistant(small, 256, 4, 1024),
                          "centroid head": _assistant(small, 256, 4, 1024, centroids=2048)}),
    }


def measure(name, target_cfg, assistants, *, capacity, length, k, iters, calls):
    key = jax.random.PRNGKey(0)
    target_params = gemma.init_params(target_cfg, key, scale=0.05)
    cache = create_cache(target_cfg, 1, capacity)
    prompt = jax.random.randint(key, (1, length), 0, target_cfg.vocab_size, jnp.int32)
    _, (hidden,), cache = jax.jit(forward, static_argnums=1, static_argnames=("hidden_layers",))(
        target_params, target_cfg, prompt, cache, hidden_layers=(target_cfg.num_layers,))
    cache = cache.advance(jnp.asarray([length], jnp.int32))
    hidden = hidden[:, -1:]

    def target_program(steps):
        tokens = jnp.zeros((1, steps), jnp.int32)

        @jax.jit
        def run(params, cache):
            def body(_, carry):  # the cache carried in place, the logits kept alive (the LM head counts)
                cache, total = carry
                logits, _, cache = forward(params, target_cfg, tokens, cache)
                return cache, total + jnp.max(logits)
            return jax.lax.fori_loop(0, iters, body, (cache, jnp.zeros(())))[1]
        return lambda: run(target_params, cache)

    def assistant_program(cfg, params, steps):
        @jax.jit
        def run(params, hidden):
            def body(_, carry):
                token, hidden = carry
                logits, hidden = assistant.forward(params, cfg, target_cfg, target_params.embed, token, hidden, cache)
                return jnp.argmax(logits, axis=-1).astype(jnp.int32), hidden
            return jax.lax.fori_loop(0, iters * steps, body, (jnp.zeros((1, 1), jnp.int32), hidden))
        return lambda: run(params, hidden)

    programs = {"target step (T = 1)": target_program(1), f"target verify (T = {k + 1})": target_program(k + 1)}
    for label, cfg in assistants.items():
        params = assistant.init_params(cfg, key, scale=0.05)
        programs[f"assistant step, {label}"] = assistant_program(cfg, params, 1)
    samples = {label: [] for label in programs}
    for label, program in programs.items():
        program()  # compile before any timing
    for _ in range(calls):  # interleaved
        for label, program in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(program())
            samples[label].append((time.perf_counter() - start) / iters)
    medians = {label: statistics.median(values) for label, values in samples.items()}
    step, verify = medians["target step (T = 1)"], medians[f"target verify (T = {k + 1})"]
    rows = []
    for label, seconds in medians.items():
        ratio = seconds / step
        row = [name, label, f"{seconds * 1e3:.2f}", f"{ratio:.2f}"]
        if label.startswith("assistant"):
            round_cost = k * seconds + verify  # k drafts and one verify
            # tau accepted + 1 bonus tokens per round against (tau + 1) plain steps
            row += [f"{round_cost * 1e3:.2f}", f"{round_cost / step - 1:.2f}"]
        else:
            row += ["", ""]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--length", type=int, default=300)
    parser.add_argument("-k", type=int, default=4, help="drafts per round")
    parser.add_argument("--iters", type=int, default=8, help="forwards per timed call")
    parser.add_argument("--shapes", nargs="+", default=["tiny", "small"])
    add_output_options(parser, calls=7)
    args = parser.parse_args(argv)
    sets = shape_sets()
    rows = []
    for name in args.shapes:
        target_cfg, assistants = sets[name]
        rows += measure(name, target_cfg, assistants, capacity=args.capacity, length=args.length, k=args.k,
                        iters=args.iters, calls=args.calls)
        print(f"{name}: done", file=sys.stderr)
    header = ["shapes", "forward", "ms", "x target step", f"round ms (k = {args.k})", "break-even tau"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    section = "\n".join([
        SECTION, "",
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__}, float32, "
        f"batch 1, {args.length} tokens in a {args.capacity}-slot cache; median of {args.calls} calls x "
        f"{args.iters} forwards. Command: `python bench/assistant.py`.", "",
        "Random weights: no trained Gemma 4 assistant (nor a real Gemma 4 checkpoint) fits this machine, so "
        "acceptance and wall-clock speedup are not measured here. `round ms`: k assistant steps plus one "
        "T = k + 1 verify; `break-even tau`: the accepted drafts per round at which a round costs what its "
        "tau + 1 tokens cost as plain steps (a round is faster above it). The assistant writes nothing and "
        "has no prefill; its attention reads the target's K/V in place.", "",
        *lines,
    ])
    print(section)
    if not args.no_write:
        replace_section(args.results, SECTION, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
