"""Which labels a head trained for the int8 trunk should learn: the corpus's own text, or the
feature pass's argmax? Measured on corpus rows the int8 target wrote greedily.

    . .venv/bin/activate && python bench/int8_labels.py                  # 8 rows each of rounds 0 and 7
    . .venv/bin/activate && python bench/int8_labels.py --rows 16 --data corpora/smollm2-135m/round_008/dataset.npz

(The rounds' dataset.npz files are not committed: the corpus command in corpora/smollm2-135m's
README rebuilds them from the shards in seconds.)

For each row (single-turn, answer length in --lengths), three things are compared with the row's
answer tokens:
  - int8 greedy decoding from the row's prompt (the path serving runs: a prefill, then steps, the
    same numbers a verify gives): does it write the answer again, token for token?
  - the int8 feature pass's argmax (`jaxspec.train.target_batch`: the row as one forward, what a
    feature cache keeps as labels), at each answer position;
  - the float32 feature pass's argmax, likewise (the float32 target's own choice).
Under int8 the long forward rounds differently from decoding (attention sums in another order,
grown by int8 activation roundings), so its argmax can leave text the same trunk writes: the case
for `train-head --labels text`. A round written before the engine's numerics last changed (RMSNorm's
sum, 2026-12-06: rounds 0-5) is an older int8 engine's text, which today's decoding leaves too.

The table replaces the section "## int8 labels (bench/int8_labels.py)" of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from results_md import add_output_options, command_line, publish, run_stamp  # bench/ is on sys.path

import jaxspec
from jaxspec.train import target_batch

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_DATA = [ROOT / "corpora" / "smollm2-135m" / f"round_{r:03d}" / "dataset.npz" for r in (0, 7)]


def pick_rows(data: dict, count: int, lengths: tuple[int, int]) -> list[int]:
    """The first `count` single-turn rows whose answer has a length in [lo, hi] tokens."""
    answer = data["lengths"] - data["prompt_lengths"]
    ok = (data["turns"] == 1) & (answer >= lengths[0]) & (answer <= lengths[1])
    rows = np.flatnonzero(ok)[:count].tolist()
    if len(rows) < count:
        raise SystemExit(f"only {len(rows)} single-turn rows with answers of {lengths[0]}-{lengths[1]} tokens")
    return rows


def measure(path: pathlib.Path, count: int, lengths: tuple[int, int], models: dict) -> dict:
    """One data file's row of the table: rows int8 decoding writes again whole, and the share of
    answer tokens each feature pass's argmax equals."""
    data = dict(np.load(path))
    rows = pick_rows(data, count, lengths)
    width = int(data["lengths"][rows].max())
    tokens = data["tokens"][rows, :width]  # [R, W]
    prompt_lengths, row_lengths = data["prompt_lengths"][rows], data["lengths"][rows]
    positions = np.arange(width)[None]
    # Position t predicts token t + 1; the answer's tokens are prompt_length .. length - 1.
    predicts_answer = (positions >= prompt_lengths[:, None] - 1) & (positions < row_lengths[:, None] - 1)  # [R, W]
    next_tokens = np.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    batch = {"tokens": jnp.asarray(tokens), "loss_mask": jnp.asarray(predicts_answer)}
    out = {"rows": len(rows), "answer_tokens": int(predicts_answer.sum())}
    for fmt, model in models.items():
        labels = np.asarray(jax.device_get(target_batch(model.params, model.config, (), batch)["labels"]))
        out[fmt] = float((labels == next_tokens)[predicts_answer].mean())
    prompts = [tokens[i, :p].tolist() for i, p in enumerate(prompt_lengths)]
    written = jaxspec.generate(models["int8"], None, prompts, max_new_tokens=int((row_lengths - prompt_lengths).max()),
                               ignore_eos=True)
    out["whole"] = sum(list(written.tokens[i][: row_lengths[i] - p]) == tokens[i, p: row_lengths[i]].tolist()
                       for i, p in enumerate(prompt_lengths))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=pathlib.Path, nargs="+", default=DEFAULT_DATA,
                        help="corpus rounds' dataset.npz files, written by the int8 target (default rounds 0 and 7)")
    parser.add_argument("--rows", type=int, default=8, help="rows per file")
    parser.add_argument("--lengths", type=int, nargs=2, default=(128, 512), metavar=("LO", "HI"),
                        help="answer lengths (tokens) of the rows taken")
    add_output_options(parser)
    args = parser.parse_args(argv)

    load = os.getloadavg()[:2]
    models = {fmt: jaxspec.load(weight_format=fmt, progress=False) for fmt in ("int8", "f32")}
    shown = {path: str(path.relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else str(path)
             for path in args.data}
    results = {path: measure(path, args.rows, tuple(args.lengths), models) for path in args.data}

    title = "## int8 labels (bench/int8_labels.py)"
    lines = [title, "",
             run_stamp((load[0], os.getloadavg()[0])) + f" SmolLM2-135M-Instruct; per corpus file, its first {args.rows} "
             f"single-turn rows with answers of {args.lengths[0]}-{args.lengths[1]} tokens, which the int8 target "
             "wrote greedily at batch 64; int8 decoding runs them as one batch.", "",
             "| data | answer tokens | int8 decoding writes the row again whole | int8 feature pass's argmax = text "
             "| float32 feature pass's argmax = text |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {shown[path]} | {r['answer_tokens']:,} | {r['whole']} / {r['rows']} | {r['int8']:.4f} | {r['f32']:.4f} |"
              for path, r in results.items()]
    lines += ["", "Where decoding writes the rows again, the text is what int8 serving accepts and the feature "
              "pass's argmax leaves it at the rest of the positions: `train-head --weight-format int8 --labels "
              "text`. A round written before RMSNorm's sum changed (2026-12-06, rounds 0-5) is an older "
              "engine's text, which today's decoding leaves as well.", "", command_line("int8_labels.py", argv)]
    publish("\n".join(lines), title, args.results, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
