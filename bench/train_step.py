"""What one EAGLE-3 training step costs on this machine, and what an epoch of the corpus costs.

    . .venv/bin/activate && python bench/train_step.py
    . .venv/bin/activate && python bench/train_step.py --calls 1 --no-write   # a quick look

Three tables, into the `## Training step cost (bench/train_step.py)` section of bench/RESULTS.md:

1. The machine's matrix-product rate: one [4096, 576] x [576, Vd] product (the head's lm_head over
   a batch of 8 x 512 positions) in float32 and with bfloat16 operands (float32 accumulation), as
   `--compute-dtype bfloat16` multiplies. This is the roofline a step is measured against.
2. One `objective.train_step` of an EAGLE-3 head for the default model (SmolLM2-135M-Instruct's
   shape; the target features are random, which costs what real ones cost) at batch 8 x 512, TTT 7,
   a draft vocabulary of `--draft-vocab` tokens, with `compute_dtype` float32 and bfloat16: the two
   programs compile first, then the timed calls alternate between them; medians.
3. An epoch of a corpus (`--data`, default the union of the committed rounds): the tokens a run
   pays for at each `--bucket-width` (a row costs its length rounded up to the width; a width's
   last batch is filled with empty rows), how many widths it has (each compiles its own train
   step, and its validation step), and the hours an epoch takes at the float32 step's tokens/s.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

import numpy as np
from forward_cost import median_seconds  # bench/ is on sys.path when a bench script runs
from results_md import add_output_options, publish, run_stamp

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parent / "corpora" / "smollm2-135m" / "dataset.npz"
SECTION = "## Training step cost (bench/train_step.py)"
RERUN = ". .venv/bin/activate && python bench/train_step.py"
DTYPES = ("float32", "bfloat16")
BUCKET_WIDTHS = (256, 128, 64, 32)


def product_rates(draft_vocab: int, calls: int) -> dict[str, float]:
    """{dtype: GFLOP/s of one [4096, 576] x [576, draft_vocab] product}."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4096, 576), np.float32), rng.standard_normal((576, draft_vocab), np.float32)
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    rates = {}
    for dtype in DTYPES:
        cast = jnp.dtype(dtype)
        product = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
        seconds = median_seconds(product, jnp.asarray(a, cast), jnp.asarray(b, cast), repeats=max(calls, 3))
        rates[dtype] = flops / seconds / 1e9
    return rates


def step_seconds(args) -> dict[str, float]:
    """{compute dtype: median seconds of one train step} at batch args.batch x args.width."""
    import jax
    import jax.numpy as jnp

    import jaxspec
    from jaxspec.models import eagle3
    from jaxspec.train import objective
    from jaxspec.train.config import StepSpec, TrainConfig, optimizer
    from jaxspec.train.data import DraftVocab
    from jaxspec.train.heads import eagle3_config_for, init_head, trainable_params

    target = jaxspec.load()
    vocab_size, vd = target.config.vocab_size, args.draft_vocab
    draft_tokens = np.arange(vd, dtype=np.int64)  # which tokens are drafted does not change the cost
    vocab = DraftVocab(target_ids=draft_tokens, d2t=np.zeros(vd, np.int64), t2d=np.isin(np.arange(vocab_size), draft_tokens))
    to_draft = np.full(vocab_size, -1, np.int32)
    to_draft[draft_tokens] = np.arange(vd)
    head_cfg = eagle3_config_for(target.config, vd)
    frozen = {"embed": target.params.embed, "draft_ids": jnp.asarray(draft_tokens, jnp.int32),
              "target_to_draft": jnp.asarray(to_draft)}
    rng = np.random.default_rng(0)
    shape = (args.batch, args.width)
    targets = {"tokens": jnp.asarray(rng.integers(0, vd, shape), jnp.int32),
               "features": tuple(jnp.asarray(rng.standard_normal(shape + (target.config.dim,)), jnp.float32)
                                 for _ in head_cfg.aux_layer_ids),
               "labels": jnp.asarray(rng.integers(0, vd, shape), jnp.int32),
               "loss_mask": jnp.asarray(np.broadcast_to(np.arange(args.width) >= args.width // 8, shape))}

    steps = {}
    for dtype in DTYPES:
        cfg = TrainConfig(ttt_steps=args.ttt, compute_dtype=dtype, batch_size=args.batch)
        spec = StepSpec(train=cfg, target_cfg=target.config, head_cfg=head_cfg,
                        hidden_layers=eagle3.target_hidden_layers(head_cfg.aux_layer_ids))
        params = trainable_params(init_head(cfg.method, head_cfg, target, vocab, seed=0))
        state = {"params": params, "opt": jax.jit(optimizer(cfg).init)(params)}

        def step(spec=spec, state=state):  # params and opt_state are donated: carry them on
            state["params"], state["opt"], metrics = objective.train_step(state["params"], state["opt"], frozen,
                                                                          targets, spec=spec)
            return metrics

        print(f"train step, compute {dtype}: compiling", flush=True)
        jax.block_until_ready(step())
        steps[dtype] = step
    samples = {dtype: [] for dtype in DTYPES}
    for _ in range(args.calls):
        for dtype, step in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step())
            samples[dtype].append(time.perf_counter() - start)
    return {dtype: float(np.median(times)) for dtype, times in samples.items()}


def epoch_tokens(lengths: np.ndarray, seq_len: int, bucket_width: int, batch: int) -> tuple[int, int]:
    """(tokens an epoch's batches hold, padding included; distinct widths) at `bucket_width`."""
    from jaxspec.train.data import bucket_widths, length_batches

    widths = bucket_widths(lengths, bucket_width, seq_len)
    batches = length_batches(np.arange(len(lengths)), widths, batch)  # as training pads them
    return sum(len(rows) * int(width) for rows, width in batches), len(np.unique(widths))


def build_section(args, rates: dict, seconds: dict, data, load: tuple[float, float]) -> str:
    tokens = args.batch * args.width
    lines = [SECTION, "",
             f"{run_stamp(load)} Medians over {args.calls} calls. Rerun: `{RERUN}`", "",
             f"The machine's product rate, one [4096, 576] x [576, {args.draft_vocab}] product (an lm_head over "
             f"{args.batch} x {args.width} positions):", "",
             "| operands | GFLOP/s |", "|---|---:|"]
    lines += [f"| {dtype} | {rates[dtype]:.0f} |" for dtype in DTYPES]
    lines += ["", f"One EAGLE-3 train step for SmolLM2-135M-Instruct, batch {args.batch} x {args.width}, TTT "
              f"{args.ttt}, draft vocabulary {args.draft_vocab} (`--compute-dtype`):", "",
              "| compute dtype | s / step | tokens/s | against float32 |", "|---|---:|---:|---:|"]
    lines += [f"| {dtype} | {seconds[dtype]:.2f} | {tokens / seconds[dtype]:.0f} | "
              f"{seconds['float32'] / seconds[dtype]:.2f}x |" for dtype in DTYPES]
    rate = tokens / seconds["float32"]
    real = int(np.sum(data.lengths))
    lines += ["", f"An epoch of `{args.data.relative_to(HERE.parent) if args.data.is_relative_to(HERE.parent) else args.data}` "
              f"({len(data.lengths):,} rows, {real:,} tokens) at batch {args.batch}, at the float32 step's "
              f"{rate:.0f} tokens/s:", "",
              "| bucket width | tokens paid | padding | widths (a step program each) | hours per epoch |",
              "|---:|---:|---:|---:|---:|"]
    for width in BUCKET_WIDTHS:
        paid, programs = epoch_tokens(data.lengths, data.seq_len, width, args.batch)
        lines.append(f"| {width} | {paid:,} | {100 * (paid - real) / paid:.1f}% | {programs} | {paid / rate / 3600:.1f} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--draft-vocab", type=int, default=6656, help="the v2 head's (the shipped head's tokens first)")
    parser.add_argument("--data", type=pathlib.Path, default=DEFAULT_DATA, help="a corpus dataset.npz")
    add_output_options(parser, calls=3)
    args = parser.parse_args()

    from jaxspec.train.data import Dataset

    data = Dataset.load(args.data)  # first: a missing corpus fails before minutes of timing
    start_load = os.getloadavg()[0]
    rates = product_rates(args.draft_vocab, args.calls)
    seconds = step_seconds(args)
    section = build_section(args, rates, seconds, data, (start_load, os.getloadavg()[0]))
    publish(section, SECTION, args.results, write=not args.no_write)


if __name__ == "__main__":
    main()
