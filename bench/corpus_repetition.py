"""How much of a training corpus's assistant text a prompt lookup over the row itself predicts, by
position within the answer: the share of the data a draft head learns nothing hard from.

    . .venv/bin/activate && python bench/corpus_repetition.py                  # every round built
    . .venv/bin/activate && python bench/corpus_repetition.py --data corpora/smollm2-135m/round_000/dataset.npz

A 135M model's answers often loop until the length bound; inside a loop, the token that followed
the last occurrence of the previous `--n` tokens (`jaxspec.train.lookup_predicted`, what the
`ngram` proposer drafts) is the next token. Spec-Bench's acceptance is measured on the first 128
answer tokens (bench/heads.py), where little of the corpus's loss mass lies when answers are long,
so this table says which part of the data a head's validation figures are made of.

The table replaces the section "## Corpus repetition (bench/corpus_repetition.py)" of
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import platform

from results_md import add_output_options, command_line, publish  # bench/ is on sys.path when a bench script runs

from jaxspec.train import answer_positions, load_datasets, lookup_predicted

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORPUS = ROOT / "corpora" / "smollm2-135m"
BINS = (0, 32, 64, 128, 256, 512, 1024, 2048)


def shown(path: pathlib.Path) -> str:
    """A data file as the table names it: relative to the repository when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", nargs="+", type=pathlib.Path, default=None,
                        help="dataset.npz files (default: every round_NNN/dataset.npz of the repository's corpus)")
    parser.add_argument("--n", type=int, default=3, help="the lookup's n-gram order (default 3)")
    add_output_options(parser)
    args = parser.parse_args(argv)

    files = [f.resolve() for f in args.data] if args.data else sorted(CORPUS.glob("round_*/dataset.npz"))
    if not files:
        parser.error(f"no dataset.npz under {CORPUS}: build the corpus's rounds first (its README)")
    data = load_datasets(files)
    positions = answer_positions(data)  # int[N, T], -1 off the answers
    predicted = lookup_predicted(data, args.n)  # bool[N, T]
    answered = positions >= 0
    total = int(answered.sum())

    title = "## Corpus repetition (bench/corpus_repetition.py)"
    lines = [title, "",
             f"{datetime.date.today()}, {platform.machine()}: {len(data):,} rows ({', '.join(map(shown, files))}), "
             f"{total:,} assistant tokens; a token counts as predicted when the token after the last earlier "
             f"occurrence of its {args.n} preceding tokens in the row is that token.", "",
             "| answer tokens | share of the assistant tokens | predicted by a lookup |", "|---|---:|---:|"]
    for low, high in zip(BINS, BINS[1:]):
        in_bin = answered & (positions >= low) & (positions < high)
        count = int(in_bin.sum())
        if count:
            lines.append(f"| {low}-{high - 1} | {count / total:.2f} | {predicted[in_bin].mean():.2f} |")
    lines.append(f"| all | 1.00 | {predicted[answered].mean():.2f} |")
    first = answered & (positions < 128)
    lines += ["", f"Tokens 0-127 of each answer, where Spec-Bench's 128-token runs measure a head, are "
              f"{first.sum() / total:.0%} of the assistant tokens; a lookup predicts {predicted[first].mean():.0%} "
              f"of them and {predicted[answered & ~first].mean():.0%} of the rest.",
              "", command_line("corpus_repetition.py", argv)]
    publish("\n".join(lines), title, args.results, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
