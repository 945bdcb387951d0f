"""Sampling filters' cost: top-k / top-p thresholds by bisection (jaxspec.sampling) against a
sort (how transformers' TopK/TopP warpers and jaxspec before it find them), and what that means
end to end for a batch of sampled rows on the default model.

    . .venv/bin/activate && python bench/sampling.py
    . .venv/bin/activate && python bench/sampling.py --repeats 3 --no-write   # plumbing

Filter alone: one jitted `processed_logits` over [B, 49152] random logits (scale 3) for each
filter setting, against the same filters written with a descending sort (`_sorted_filters`,
kept here as the peer; the kept sets agree: tests/test_sampling.py), median of `--repeats`
calls. End to end: `jaxspec.generate` on SmolLM2-135M, B rows of one chat prompt, greedy
against temperature 1.0 with top-p 0.95 (what the corpus's Magpie stage samples with), decode
tokens per second (median of `--e2e-repeats`, each after a warm-up compile), with the
sampler's filters by bisection and, swapped in, by the sort. Replaces the
`## Sampling filters (bench/sampling.py)` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import results_md  # noqa: E402
from forward_cost import median_seconds  # noqa: E402  (bench/ is on sys.path)

import jaxspec  # noqa: E402
from jaxspec import sampling  # noqa: E402

HEADING = "## Sampling filters (bench/sampling.py)"
VOCAB = 49152
SETTINGS = {"top-p 0.95": dict(temperature=1.0, top_p=0.95), "top-k 50": dict(temperature=1.0, top_k=50),
            "top-k 50 + top-p 0.9": dict(temperature=1.0, top_k=50, top_p=0.9)}


def _sorted_filters(logits: jax.Array, params: sampling.SamplingParams, spec: sampling.SamplerSpec) -> jax.Array:
    """Top-k then top-p with one descending sort of the row (the peer; temperature 1)."""
    scaled = logits.astype(jnp.float32)
    ordered = -jnp.sort(-scaled, axis=-1)
    vocab = scaled.shape[-1]
    threshold = jnp.full(scaled.shape[:1], -jnp.inf)
    if spec.top_k:
        k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab)
        threshold = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)[:, 0]
        ordered = jnp.where(ordered >= threshold[:, None], ordered, -jnp.inf)
    if spec.top_p:
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        keep = ((before < params.top_p[:, None]) & (ordered > -jnp.inf)) | (jnp.arange(vocab) == 0)
        threshold = jnp.take_along_axis(ordered, (jnp.sum(keep, axis=-1) - 1)[:, None], axis=-1)[:, 0]
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def filter_rows(batches: list[int], repeats: int) -> list[str]:
    rows = []
    for batch in batches:
        logits = 3.0 * jax.random.normal(jax.random.PRNGKey(batch), (batch, VOCAB))
        for name, setting in SETTINGS.items():
            params, spec = sampling.SamplingParams.create(batch, **setting), sampling.spec_for(**setting)
            ours = 1000 * median_seconds(jax.jit(lambda x, p, s=spec: sampling.processed_logits(x, p, s)), logits,
                                         params, repeats=repeats)
            peer = 1000 * median_seconds(jax.jit(lambda x, p, s=spec: _sorted_filters(x, p, s)), logits, params,
                                         repeats=repeats)
            rows.append(f"| {batch} | {name} | {peer:.1f} | {ours:.1f} | {peer / ours:.1f}x |")
    return rows


def end_to_end_rows(batches: list[int], new_tokens: int, repeats: int) -> list[str]:
    model = jaxspec.load()
    sampled = dict(temperature=1.0, top_p=0.95)
    bisection = sampling.processed_logits
    rows = []
    for batch in batches:
        prompts = ["Write a short story about a lighthouse keeper."] * batch

        def rate(setting, filters):
            sampling.processed_logits = filters  # read at trace time: each variant compiles its own loop
            jax.clear_caches()
            try:
                def run(seed):
                    return jaxspec.generate(model, None, prompts, chat=True, max_new_tokens=new_tokens,
                                            ignore_eos=True, seed=seed, **setting).stats.decode_tokens_per_second
                run(0)  # compile
                return statistics.median(run(seed + 1) for seed in range(repeats))
            finally:
                sampling.processed_logits = bisection

        greedy, ours, peer = rate({}, bisection), rate(sampled, bisection), rate(sampled, _sorted_filters)
        rows.append(f"| {batch} | {greedy:.0f} | {peer:.0f} ({peer / greedy:.2f}x) | {ours:.0f} ({ours / greedy:.2f}x) |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32", help="rows per call, comma-separated")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--e2e-batches", default="1,32")
    parser.add_argument("--e2e-tokens", type=int, default=64)
    parser.add_argument("--e2e-repeats", type=int, default=3)
    results_md.add_output_options(parser)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    section = [HEADING, "",
               f"CPU, {jax.device_count()} device(s), jax {jax.__version__}. `processed_logits` over [B, {VOCAB}] "
               "random logits: thresholds by bisection over the float bits (jaxspec) against one descending "
               f"sort of each row (the peer, as transformers' warpers do it); median of {args.repeats} calls, ms.",
               "", "| B | filters | sort (ms) | bisection (ms) | speedup |", "|---:|---|---:|---:|---:|",
               *filter_rows(batches, args.repeats), "",
               f"End to end on SmolLM2-135M (f32): B rows of one chat prompt, {args.e2e_tokens} new tokens, decode "
               f"tokens/s summed over rows, median of {args.e2e_repeats} runs.", "",
               "| B | greedy (tok/s) | t 1.0, top-p 0.95 by sort (tok/s, / greedy) | by bisection |",
               "|---:|---:|---:|---:|",
               *end_to_end_rows([int(b) for b in args.e2e_batches.split(",")], args.e2e_tokens, args.e2e_repeats)]
    text = "\n".join(section)
    print(text)
    if not args.no_write:
        results_md.replace_section(args.results, HEADING, text)


if __name__ == "__main__":
    main()
