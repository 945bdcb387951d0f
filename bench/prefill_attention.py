"""Prefill attention on XLA:CPU: the whole [T, S] score matrix at once against a block of 128
queries at a time over the slots each block can reach, in whole forwards of the default model
and in the training-time test's attention.

    . .venv/bin/activate && python bench/prefill_attention.py
    . .venv/bin/activate && python bench/prefill_attention.py --calls 1 --no-write   # a quick look

`flash_decode_reference` attends a prefill-sized T (more than `DECODE_MAX_QUERIES` queries per
kv head) `PREFILL_QUERY_BLOCK` queries at a time (`_prefill_attention`): block [t0, t1) reads
slots [0, S - T + t1) only. This script times one trunk forward with that block and with one block
holding all T (the whole matrix, as before blocks), each compiled as its own program (the block
is read while tracing), in the shapes that matter: the training feature pass (a fresh cache as
long as the window: rows of 256, 512 and 1,024 tokens at batch 2, and 1,024 at batch 8) and a
generation prefill of 1,024 prompt tokens into a cache with room for 512 more. Forwards run as
bench/forward_cost.py runs them, interleaved across variants, medians over `--calls`. A second
table times the training-time test's attention (`models.draft_chain.chain_attention`, the same
blocking of the context's causal attention), forward and backward of one deeper depth of an
EAGLE-3 head over SmolLM2's attention shape (3 kv heads of 3 queries, head dim 64, 6 deeper
depths). The tables replace the `## Prefill attention in query blocks
(bench/prefill_attention.py)` section of bench/RESULTS.md. With `--labels` it times the feature
pass's own forward (`features.target_batch`, whose labels take the argmax of every position's
logits) at batch 8 and 2 instead, into its own section.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib

from forward_cost import forward_costs  # bench/ is on sys.path when a bench script runs
from results_md import add_output_options, publish, run_stamp

HERE = pathlib.Path(__file__).resolve().parent
SECTION = "## Prefill attention in query blocks (bench/prefill_attention.py)"
RERUN = ". .venv/bin/activate && python bench/prefill_attention.py"

# (what, batch, T, capacity): every forward starts at an empty cache (length 0).
CASES = (
    ("feature pass", 2, 256, 256),
    ("feature pass", 2, 512, 512),
    ("feature pass", 2, 1024, 1024),
    ("feature pass", 8, 1024, 1024),
    ("generation prefill", 1, 1024, 1536),
)
WHOLE = "whole matrix"
BLOCKED = "blocks of 128"


@contextlib.contextmanager
def query_block(variant: str):
    """Trace with the reference attending `variant`'s query blocks (BLOCKED: the shipped size)."""
    from jaxspec.pallas import flash_decode

    shipped = flash_decode.PREFILL_QUERY_BLOCK
    flash_decode.PREFILL_QUERY_BLOCK = shipped if variant == BLOCKED else 1 << 30
    try:
        yield
    finally:
        flash_decode.PREFILL_QUERY_BLOCK = shipped


def measure(args) -> dict:
    """{(case, variant): median seconds of one forward}."""
    import jaxspec
    from jaxspec.pallas import flash_decode

    assert flash_decode.PREFILL_QUERY_BLOCK == 128, "the table's heading names the shipped block"
    model = jaxspec.load()
    costs = {}
    for case in CASES:
        _, batch, steps, capacity = case
        variants = {variant: (model.params, model.config, steps) for variant in (WHOLE, BLOCKED)}
        under = {variant: (lambda variant=variant: query_block(variant)) for variant in variants}
        print(f"{case}: compiling, then {args.calls} timed rounds", flush=True)
        for variant, seconds in forward_costs(variants, capacity, 0, args.calls, iters=1, batch=batch,
                                              compile_under=under).items():
            costs[(case, variant)] = seconds
    return costs


# (batch, T): the training batches the chain attention is timed at.
CHAIN_CASES = ((8, 512), (8, 1024))


def measure_chain(args) -> dict:
    """{(case, variant): median seconds of one chain attention's forward and backward}."""
    import jax
    import jax.numpy as jnp
    from forward_cost import median_seconds

    from jaxspec.models.draft_chain import QUERY_BLOCK, DraftChain, chain_attention

    heads, group, head_dim, depths = 3, 3, 64, 6
    costs = {}
    for batch, steps in CHAIN_CASES:
        keys = jax.random.split(jax.random.PRNGKey(0), 5)
        q = jax.random.normal(keys[0], (batch, steps, heads, group, head_dim))
        context = [jax.random.normal(k, (batch, heads, steps, head_dim)) for k in keys[1:3]]
        deeper = [jax.random.normal(k, (depths, batch, heads, steps, head_dim)) for k in keys[3:5]]

        def loss(q, context, deeper, query_block):
            chains = [DraftChain(context=c, deeper=d, depth=jnp.int32(3)) for c, d in zip(context, deeper)]
            return jnp.sum(jnp.sin(chain_attention(q, *chains, query_block=query_block)))

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
        print(f"chain attention {batch} x {steps}: compiling, then {args.calls} timed calls", flush=True)
        for variant, block in ((WHOLE, steps), (BLOCKED, QUERY_BLOCK)):
            costs[((batch, steps), variant)] = median_seconds(step, q, context, deeper, block, repeats=args.calls)
    return costs


LABELS_SECTION = "## Feature-pass forwards: rows per forward (bench/prefill_attention.py --labels)"
# (batch, T): a feature-pass forward at the training batch and at features.TOKENS_PER_FORWARD.
LABELS_CASES = ((8, 1024), (2, 1024))


def measure_labels(args) -> dict:
    """{case: median seconds of one `features.target_batch`}: the pass's own forward, which also
    takes the argmax of the full-vocabulary logits at every position (float32 [B, T, 49152]:
    1.6 GB at 8 x 1,024, where the trunk forward above reduces one position's)."""
    import jax.numpy as jnp
    import numpy as np
    from forward_cost import median_seconds

    import jaxspec
    from jaxspec.train.features import target_batch

    model = jaxspec.load()
    layers = (1, 14, 26, 30)  # an EAGLE-3 head's three and the final-normed stream, as training caches them
    costs = {}
    for batch, steps in LABELS_CASES:
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, steps)), jnp.int32)
        rows = {"tokens": tokens, "loss_mask": jnp.ones((batch, steps), bool)}
        print(f"target_batch {batch} x {steps}: compiling, then {args.calls} timed calls", flush=True)
        costs[(batch, steps)] = median_seconds(lambda: target_batch(model.params, model.config, layers, rows),
                                               repeats=args.calls)
    return costs


def build_labels_section(args, costs: dict, load: tuple[float, float]) -> str:
    lines = [LABELS_SECTION, "",
             f"{run_stamp(load)} One `features.target_batch` "
             f"(SmolLM2-135M-Instruct, f32: four hidden layers and the argmax labels at every position), median "
             f"over {args.calls} calls. Why the feature pass runs forwards of about 2,048 tokens "
             "(`features.TOKENS_PER_FORWARD`).", "",
             f"Rerun: `{RERUN} --labels`", "",
             "| batch | T | seconds | tokens/s |", "|---:|---:|---:|---:|"]
    for batch, steps in LABELS_CASES:
        lines.append(f"| {batch} | {steps} | {costs[(batch, steps)]:.2f} | {batch * steps / costs[(batch, steps)]:.0f} |")
    lines.append("")
    return "\n".join(lines)


def build_section(args, costs: dict, chain_costs: dict, load: tuple[float, float]) -> str:
    lines = [SECTION, "",
             f"{run_stamp(load)} One forward of the default "
             f"model (SmolLM2-135M-Instruct, f32) from an empty cache, median over {args.calls} calls, the two "
             "variants interleaved.", "",
             f"Rerun: `{RERUN}`", "",
             "| forward | batch | T | cache slots | whole matrix s | blocks of 128 s | speed-up | tokens/s (blocks) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for case in CASES:
        what, batch, steps, capacity = case
        whole, blocked = costs[(case, WHOLE)], costs[(case, BLOCKED)]
        lines.append(f"| {what} | {batch} | {steps} | {capacity} | {whole:.2f} | {blocked:.2f} | "
                     f"{whole / blocked:.2f}x | {batch * steps / blocked:.0f} |")
    lines += ["", "The training-time test's attention, one deeper depth, forward and backward "
              f"(median over {args.calls} calls):", "",
              "| batch | T | whole matrix s | blocks of 128 s | speed-up |", "|---:|---:|---:|---:|---:|"]
    for case in CHAIN_CASES:
        whole, blocked = chain_costs[(case, WHOLE)], chain_costs[(case, BLOCKED)]
        lines.append(f"| {case[0]} | {case[1]} | {whole:.2f} | {blocked:.2f} | {whole / blocked:.2f}x |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labels", action="store_true",
                        help="time the feature pass's own forward (with its labels) at two batch sizes instead, into "
                             "its own section")
    add_output_options(parser, calls=3)
    args = parser.parse_args()

    start_load = os.getloadavg()[0]
    if args.labels:
        costs = measure_labels(args)
        section = build_labels_section(args, costs, (start_load, os.getloadavg()[0]))
        publish(section, LABELS_SECTION, args.results, write=not args.no_write)
        return
    costs, chain_costs = measure(args), measure_chain(args)
    section = build_section(args, costs, chain_costs, (start_load, os.getloadavg()[0]))
    publish(section, SECTION, args.results, write=not args.no_write)


if __name__ == "__main__":
    main()
