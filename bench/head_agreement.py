"""EAGLE-3 heads on a corpus's held-out answers, by source, and online on a sample of its prompts:
is a head's validation figure what it does when drafting, and on which kind of request?

    . .venv/bin/activate && python bench/head_agreement.py \
        --data corpora/smollm2-135m/round_004/dataset.npz \
        --head v1=eagle3-smollm2-135m --head v2=runs/v2/head

Three tables, every head measured on the same text:

  * teacher-forced, over every held-out row of `--data` (a corpus's dataset.npz, or a train-head
    run's train_data.npz with `--run`): the head run once over the whole row on the target's
    features (as training's depth 0 sees them); how often its argmax is the target's next
    token, at every answer position and at the positions a 3-gram lookup over the row does not
    already propose ("new text"), by source where the data names its rows' sources (a corpus's
    `ids`: magpie, math, self_instruct_topic, ...);
  * the same slots by the target's confidence in its greedy token (CONFIDENCE_BINS), split into
    those a 3-gram lookup proposes (the target copying its own context) and new text: where the
    target is near certain, a head that misses lacks what the target saw;
  * online: greedy speculative decoding (chain k = `--k`) of `--prompts` held-out prompts drawn
    in turn from each source (seeded; the first rows of a split are one template's, a biased
    sample), first-draft acceptance and tau, and the teacher-forced agreement on the text it
    produced. The online figure counts only round starts, so it sits below the teacher-forced one.

The table replaces the section "## Head agreement, online and teacher-forced
(bench/head_agreement.py)" of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import platform

import jax
import jax.numpy as jnp
import numpy as np

from results_md import add_output_options, command_line, publish  # bench/ is on sys.path when a bench script runs

import jaxspec
from jaxspec import models, train
from jaxspec.models import eagle3
from jaxspec.train.data import Dataset, Example, bucket_widths, pack

UNNAMED = "all rows"  # the source of rows whose data names none


@dataclasses.dataclass(frozen=True)
class Depth0Positions:
    """Every scored depth-0 draft slot of some rows, flat (one entry per slot, rows in order)."""

    row: np.ndarray  # int[P]: the row of each slot
    agrees: np.ndarray  # bool[P]: the head's draft is the target's greedy token
    new: np.ndarray  # bool[P]: a 3-gram lookup over the row does not propose that token
    confidence: np.ndarray  # float[P]: the target's probability of its greedy token there


def depth0_positions(target, head, data: Dataset, batch_size: int = 4) -> Depth0Positions:
    """The head run once over each whole row on the target's features, as training's depth 0.

    Head slot p reads (target feature p, token p + 1) and drafts token p + 2; it agrees when that
    is the target's argmax at p + 1. A slot is scored when token p + 2 is the assistant's (the
    training loss mask, `Dataset.batch`), and is new text when a 3-gram lookup over the row's
    earlier tokens does not propose token p + 2 (`Dataset.next_is_lookup_predicted`)."""
    hidden = eagle3.target_hidden_layers(head.config.aux_layer_ids)
    parts = []
    for start in range(0, len(data), batch_size):
        rows = np.arange(start, min(start + batch_size, len(data)))
        width = int(bucket_widths(data.lengths[rows], 64, data.seq_len).max())  # like lengths share a compile
        batch = data.batch(rows, width)
        logits, features, _ = models.forward(target.params, target.config, batch["tokens"],
                                             models.create_cache(target.config, len(rows), width),
                                             hidden_layers=hidden)
        greedy = jnp.argmax(logits, axis=-1)  # [B, W]: the target's token after each prefix
        confidence = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)  # [B, W]: its probability
        tokens = np.asarray(batch["tokens"])  # [B, W]
        tokens_in = jnp.asarray(np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1))
        head_logits, _, _ = eagle3.forward(head.params, head.config, target.params.embed, tokens_in,
                                           eagle3.encode(head.params, features),
                                           eagle3.create_cache(head.config, len(rows), width))
        drafted = np.asarray(eagle3.to_target_ids(head.params, jnp.argmax(head_logits, axis=-1)))  # [B, W]
        # Everything below at slot p, about token p + 2: one position on from `batch`'s alignment.
        label = _next(np.asarray(greedy))
        scored = _next(np.asarray(batch["loss_mask"]))
        new = ~_next(data.next_is_lookup_predicted(rows, width))
        parts.append((np.broadcast_to(rows[:, None], scored.shape)[scored], (drafted == label)[scored], new[scored],
                      _next(np.asarray(confidence))[scored]))
    return Depth0Positions(*(np.concatenate(column) for column in zip(*parts)))


def agreement_by_row(target, head, data: Dataset, batch_size: int = 4) -> np.ndarray:
    """int[N, 4]: per row (agreeing, scored, agreeing on new text, scored new text) depth-0 drafts
    (`depth0_positions`)."""
    return row_counts(depth0_positions(target, head, data, batch_size), len(data))


def row_counts(positions: Depth0Positions, num_rows: int) -> np.ndarray:
    """int[num_rows, 4]: `agreement_by_row`'s counts of `positions`."""
    counts = np.zeros((num_rows, 4), np.int64)
    for column, values in enumerate((positions.agrees, np.ones_like(positions.agrees), positions.agrees & positions.new,
                                     positions.new)):
        np.add.at(counts[:, column], positions.row, values.astype(np.int64))
    return counts


# The target's probability of its own greedy token: where it is near 1 the next token is all but
# fixed by the prefix, and a head that misses there lacks what the target saw, not luck.
CONFIDENCE_BINS = (0.0, 0.5, 0.9, 0.99, 1.0)


def agreement_by_confidence(positions: Depth0Positions) -> list[dict]:
    """Per CONFIDENCE_BINS bin (the last closed): its share of the slots, the head's agreement
    there, and the same split into slots a 3-gram lookup proposes ("lookup", where the target
    copies its own context) and new text. Agreement is None where a bin has no such slot."""
    def rate(mask):
        return float(positions.agrees[mask].mean()) if mask.any() else None

    bins = []
    for low, high in zip(CONFIDENCE_BINS[:-1], CONFIDENCE_BINS[1:]):
        inside = (positions.confidence >= low) & ((positions.confidence < high) | (high == CONFIDENCE_BINS[-1]))
        lookup = inside & ~positions.new
        bins.append({"low": low, "high": high, "share": float(inside.mean()), "agreement": rate(inside),
                     "lookup_share": float(lookup.mean()), "lookup_agreement": rate(lookup),
                     "new_agreement": rate(inside & positions.new)})
    return bins


def _next(x: np.ndarray) -> np.ndarray:
    """x[:, p + 1] at p; the last position gets zeros (False)."""
    return np.concatenate([x[:, 1:], np.zeros_like(x[:, :1])], axis=1)


def generated_rows(prompts: list[list[int]], answers) -> Dataset:
    """The prompts with the answers generated for them, as right-padded rows (the answers the
    assistant's tokens)."""
    examples = [Example(tokens=tuple(p) + tuple(a), prompt_length=len(p)) for p, a in zip(prompts, answers)]
    return pack(examples, max(len(e.tokens) for e in examples))


def row_sources(path: str) -> list[str]:
    """Each row's source: a corpus's ids read "r004-magpie-000012"; data without ids: one source."""
    with np.load(path) as file:
        if "ids" not in file.files:
            return [UNNAMED] * len(file["lengths"])
        return [str(row_id).split("-")[1] for row_id in file["ids"]]


def sample_by_source(rows: np.ndarray, sources: list[str], count: int, seed: int) -> list[int]:
    """`count` of `rows`, taking each source in turn (its rows in a seeded random order)."""
    rng = np.random.default_rng(seed)
    queues = collections.defaultdict(list)
    for row in rng.permutation(rows):
        queues[sources[row]].append(int(row))
    order = sorted(queues)
    chosen: list[int] = []
    while len(chosen) < min(count, len(rows)):
        for source in order:
            if queues[source] and len(chosen) < count:
                chosen.append(queues[source].pop(0))
    return chosen


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _share(agreeing: int, scored: int) -> str:
    return f"{agreeing / scored:.3f} ({scored})" if scored else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--data", nargs="+", help="corpus dataset.npz files: their held-out rows")
    where.add_argument("--run", help="a train-head run directory: its data's held-out rows")
    parser.add_argument("--head", action="append", required=True, metavar="NAME=PATH", help="an EAGLE-3 head (repeat)")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts decoded online, sources in turn")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--weight-format", default="f32", choices=("f32", "bf16", "int8", "q4"))
    parser.add_argument("--seed", type=int, default=0)
    add_output_options(parser)
    args = parser.parse_args(argv)
    specs = [item.split("=", 1) for item in args.head]
    if any(len(pair) != 2 for pair in specs):
        parser.error("--head takes NAME=PATH")

    if args.run:
        cfg, data = train.saved_run(args.run)
        _, held_out = train.split_rows(data, cfg.val_fraction, cfg.seed)
        sources, described = [UNNAMED] * len(data), f"the held-out rows of {args.run}"
    else:
        data = train.load_datasets(args.data)
        if data.held_out is None:
            parser.error("--data: these files mark no held-out rows")
        held_out = np.flatnonzero(data.held_out)
        sources = [source for path in args.data for source in row_sources(path)]
        described = f"the held-out rows of {', '.join(args.data)}"
    held = data.subset(held_out)
    held_sources = [sources[i] for i in held_out]
    chosen = sample_by_source(held_out, sources, args.prompts, args.seed)
    prompts = data.prompts(chosen)
    target = jaxspec.load(weight_format=args.weight_format)

    title = "## Head agreement, online and teacher-forced (bench/head_agreement.py)"
    names = sorted(set(held_sources))
    lines = [title, "", f"{datetime.date.today()}, {platform.machine()}, SmolLM2-135M-Instruct ({args.weight_format}), "
             f"{described}: {len(held)} rows, {int(held.assistant_tokens().sum()):,} answer tokens.", "",
             "Teacher-forced depth-0 agreement with the target, all answer positions / new text only (positions):", "",
             "| head | " + " | ".join(names + ["all"]) + " |", "|---|" + "---:|" * (len(names) + 1)]
    confident = ["By the target's confidence (its probability of its greedy token), all sources: the bin's share "
                 "of the answer positions, the head's agreement there, the share a 3-gram lookup proposes (the "
                 "target copying its context) and the agreement on those and on the rest:", "",
                 "| head | target's confidence | share | agreement | lookup share | agreement on lookup | "
                 "agreement on new text |", "|---|---|---:|---:|---:|---:|---:|"]
    drawn = collections.Counter(sources[i] for i in chosen)
    online = [f"Online, {len(prompts)} held-out prompts ({', '.join(f'{n} {drawn[n]}' for n in names if drawn[n])}), "
              f"{args.new_tokens} greedy tokens, chain k = {args.k}:", "",
              "| head | online first-draft acceptance | tau | teacher-forced depth-0 agreement, same text |",
              "|---|---:|---:|---:|"]
    for name, path in specs:
        head = jaxspec.load(path)
        positions = depth0_positions(target, head, held)
        counts = row_counts(positions, len(held))
        cells = []
        for source in names + [None]:
            picked = counts[[source is None or s == source for s in held_sources]].sum(0)
            cells.append(f"{_share(picked[0], picked[1])} / {_share(picked[2], picked[3])}")
        lines.append(f"| {name} ({path}) | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
        for bin_ in agreement_by_confidence(positions):
            confident.append(f"| {name} | {bin_['low']:g}-{bin_['high']:g} | {bin_['share']:.3f} | "
                             f"{_rate(bin_['agreement'])} | {bin_['lookup_share']:.3f} | "
                             f"{_rate(bin_['lookup_agreement'])} | {_rate(bin_['new_agreement'])} |")
        result = jaxspec.generate(target, head, prompts, max_new_tokens=args.new_tokens, num_draft_tokens=args.k,
                                  ignore_eos=True)
        text = agreement_by_row(target, head, generated_rows(prompts, result.tokens)).sum(0)
        online.append(f"| {name} ({path}) | {result.stats.acceptance_by_position[0]:.3f} | {result.stats.tau:.2f} | "
                      f"{_share(text[0], text[1])} |")
        print(online[-1], flush=True)
    lines += ["", *confident, "", *online, "", command_line("head_agreement.py", argv)]
    publish("\n".join(lines), title, args.results, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
