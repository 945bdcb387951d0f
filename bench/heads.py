"""Draft heads (EAGLE-3 and MTP) side by side on Spec-Bench: first-draft acceptance and tau per group, chains and
trees, and wall-clock against plain decoding on MT-bench prompts, all in one run.

    . .venv/bin/activate && python bench/heads.py                                   # the shipped head
    . .venv/bin/activate && python bench/heads.py --head v1=eagle3-smollm2-135m --head r0=runs/head_r0
    . .venv/bin/activate && python bench/heads.py --weight-format int8 --timing-prompts 4

What a head is judged by (issue 15): on each Spec-Bench group (summarization, rag, qa,
translation, math_reasoning, mt_bench; the first turn of the first `--prompts` questions, MT-bench
taking its eight categories in turn, as bench/spec.py picks them), greedy speculative decoding of
128 tokens (`ignore_eos`, so every run does the same work) gives

  * first-draft acceptance: P(the first draft of a round is accepted), `acceptance_by_position[0]`;
  * tau: tokens committed per target forward (round);

for chains of each `--k` and each `--tree` shape, and each of those again with prompt lookup
first for each `--lookup-first` n (rows whose last n tokens occurred before draft the lookup's
continuation, jaxspec.spec.lookup_first). The prompts of a group run as one batch (the
acceptance counts are per row, so batching changes no figure, only the time). Every speculative
output is checked against plain greedy of the same batch, token for token (a mismatch is a bug
and fails the run). Per head and group, the table also gives the share of plain greedy's tokens
outside an EAGLE-3 head's draft vocabulary: the head can never propose them, so at those
positions its acceptance is 0 whatever it learned.

Wall-clock: on the first `--timing-prompts` prompts of `--timing-group` (default mt_bench), at
batch 1, plain decoding and each head at a chain of `--timing-k` (and each `--timing-tree` shape,
and each of those again with each `--lookup-first` n) run back to back per prompt; the speedup is
the median over prompts of the ratio of decode tokens/s. A head directory written by `jaxspec.cli
train-head` carries its training data (train_data.npz): its rows and assistant tokens are reported
beside it, so a table of heads trained on growing data is the acceptance curve against data size. A
head exported from a checkpoint (`train-head --export-head`) is reported with the steps it had, so
the heads along one single-pass run give the same curve against the rows seen.

The table replaces the section "## EAGLE-3 heads on Spec-Bench (bench/heads.py[ --weight-format
F][ --timing-group G])" of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from results_md import add_output_options, command_line, cpu_description, publish  # bench/ is on sys.path when a bench script runs
from spec import DEFAULT_QUESTIONS, GROUPS, TIMING_STOP_TOKEN, pick_prompts

import jaxspec
from jaxspec.models import eagle3
from jaxspec.train import DATA_FILE, EXPORT_FILE, MTP_HEAD_DIR, RUN_FILE
from jaxspec.train.data import Dataset

NEW_TOKENS = 128


def exported_from(path: str) -> dict | None:
    """Where a head written by `train-head --export-head` came from (its run and step), or None."""
    head = pathlib.Path(path)
    for folder in (head, head.parent) if head.name == MTP_HEAD_DIR else (head,):
        if (folder / EXPORT_FILE).is_file():
            return json.loads((folder / EXPORT_FILE).read_text(encoding="utf-8"))
    return None


def run_directory(path: str) -> pathlib.Path:
    """The training run a head came from: an EAGLE-3 head is written into its run's directory,
    an MTP head into the run's `mtp_head/` (train-head), so its run is the folder above; an
    exported checkpoint's head names its run."""
    exported = exported_from(path)
    if exported is not None:
        return pathlib.Path(exported["run"])
    head = pathlib.Path(path)
    if head.name == MTP_HEAD_DIR and (head.parent / RUN_FILE).is_file():
        return head.parent
    return head


def training_rows(path: str) -> tuple[Dataset, np.ndarray] | None:
    """The data a head's run carries (train_data.npz) and bool[rows]: the rows it trained on
    (not its held-out ones); None for a head without one."""
    data_file = run_directory(path) / DATA_FILE
    if not data_file.is_file():
        return None
    data = Dataset.load(data_file)
    return data, np.ones(len(data), bool) if data.held_out is None else ~data.held_out


def head_data(path: str) -> str:
    """The training data a head directory carries: "N rows, M assistant tokens" (or "-")."""
    carried = training_rows(path)
    if carried is None:
        return "-"
    data, training = carried
    return f"{int(training.sum()):,} rows, {int(data.assistant_tokens()[training].sum()):,} assistant tokens"


def head_training(path: str) -> str:
    """How a head directory was trained, from its train_run.json: steps of a batch, TTT depth,
    and the head it started from (followed back), with the passes over its data all told; "-"
    for a head without one (the shipped head: see its model card)."""
    run_file = run_directory(path) / RUN_FILE
    if not run_file.is_file():
        return "-"
    cfg = json.loads(run_file.read_text(encoding="utf-8"))["train_config"]
    exported = exported_from(path)
    steps = cfg["steps"] if exported is None else exported["step"]
    of_run = "" if exported is None else f" (a checkpoint: {steps} of its run's {cfg['steps']})"
    text = (f"{cfg.get('method', 'eagle3')}, {steps} steps of {cfg['batch_size']}{of_run}, TTT {cfg['ttt_steps']}, "
            f"peak lr {cfg['learning_rate']:g}")
    rows_seen = steps * cfg["batch_size"]
    start = cfg.get("init_from")
    while start is not None and (run_directory(start) / RUN_FILE).is_file():
        earlier = json.loads((run_directory(start) / RUN_FILE).read_text(encoding="utf-8"))["train_config"]
        text += f"; from {start} ({earlier['steps']} steps of {earlier['batch_size']})"
        rows_seen += earlier["steps"] * earlier["batch_size"]
        start = earlier.get("init_from")
    if start is not None:
        text += f"; from {start}"
    carried = training_rows(path)
    if carried is not None:
        text += f": {rows_seen / max(int(carried[1].sum()), 1):.1f} passes over its rows"
    return text


def undraftable_share(head, token_rows: list[list[int]]) -> float | None:
    """The share of `token_rows`' tokens (the target's own greedy output) that `head` can never
    propose: outside an EAGLE-3 head's draft vocabulary (d2t), a ceiling on its acceptance at
    those positions. None for a head that drafts from the whole vocabulary (MTP)."""
    d2t = getattr(head.params, "d2t", None)
    if d2t is None:
        return None
    draftable = np.asarray(eagle3.to_target_ids(head.params, jnp.arange(d2t.shape[0])))
    tokens = np.concatenate([np.asarray(row, np.int64) for row in token_rows])
    return float(np.mean(~np.isin(tokens, draftable)))


def run_group(model, head, prompts: list[str], plain_tokens, divergences: list[str], exact: bool, label: str,
              **options) -> jaxspec.SpecStats:
    """Speculative greedy over `prompts` in one batch, checked against plain greedy. Where greedy
    is exact (float32 weights, a chain, or the native backend) a difference is a bug and ends the
    run; a tree under XLA's int8 or bf16 products is exact only up to rounding flips (docs/design.md:
    a node reads its ancestors from other slots than a plain step), so there its first divergence is recorded,
    named by `label` (group, head, drafts)."""
    result = jaxspec.generate(model, head, prompts, chat=True, max_new_tokens=NEW_TOKENS, ignore_eos=True, **options)
    for row, (ours, theirs) in enumerate(zip(result.tokens, plain_tokens)):
        if list(ours) != list(theirs):
            if exact:
                sys.exit(f"speculative output differs from plain greedy ({label}, row {row}): a bug")
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            divergences.append(f"{label}, row {row}: from token {first}")
    return result.stats


def timing(model, runs: dict[str, tuple], prompts: list[str]) -> dict[str, float]:
    """Median over prompts (batch 1) of each run's decode tokens/s over plain's, run back to back;
    `runs` maps a name to (head, extra generate options: a chain's num_draft_tokens, or a tree)."""
    stop = model.tokenizer.encode(TIMING_STOP_TOKEN, add_special_tokens=False)
    ratios: dict[str, list[float]] = {name: [] for name in runs}
    plain_rates = []
    for prompt in prompts:
        options = dict(chat=True, max_new_tokens=NEW_TOKENS, ignore_eos=True, stop_token_ids=stop)
        for _ in range(2):  # the first call of a shape compiles
            plain = jaxspec.generate(model, None, prompt, **options)
        plain_rates.append(plain.stats.decode_tokens_per_second)
        for name, (head, extra) in runs.items():
            for _ in range(2):
                spec = jaxspec.generate(model, head, prompt, **options, **extra)
            ratios[name].append(spec.stats.decode_tokens_per_second / plain.stats.decode_tokens_per_second)
    return {"plain": statistics.median(plain_rates), **{name: statistics.median(r) for name, r in ratios.items()}}


def section_title(weight_format: str, timing_group: str) -> str:
    """The RESULTS.md section a run replaces: one per weight format and timed group, so a run
    timing another group keeps MT-bench's. Flags at their defaults are left out."""
    flags = [(flag, value) for flag, value, default in (("--weight-format", weight_format, "f32"),
                                                        ("--timing-group", timing_group, "mt_bench"))
             if value != default]
    return "## EAGLE-3 heads on Spec-Bench (bench/heads.py" + "".join(f" {f} {v}" for f, v in flags) + ")"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", action="append", default=None, metavar="NAME=PATH",
                        help="a head to measure (repeat; default v1=eagle3-smollm2-135m)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per group")
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=GROUPS,
                        help="Spec-Bench groups to run (default all six)")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 6], help="chain draft lengths")
    parser.add_argument("--tree", nargs="*", default=["4,8,16"], help="draft-tree shapes D,K,N")
    parser.add_argument("--lookup-first", type=int, nargs="*", default=[], metavar="N",
                        help="also run each setting with prompt lookup first (lookup_first=N), timed too")
    parser.add_argument("--timing-prompts", type=int, default=3, help="prompts timed at batch 1 (0: none)")
    parser.add_argument("--timing-group", default="mt_bench", choices=GROUPS,
                        help="the Spec-Bench group whose prompts are timed (default mt_bench)")
    parser.add_argument("--timing-k", type=int, default=4)
    parser.add_argument("--timing-tree", nargs="*", default=[], metavar="D,K,N",
                        help="also time these draft-tree shapes (each head, and with each --lookup-first)")
    parser.add_argument("--weight-format", default="f32", choices=("f32", "bf16", "int8", "q4"))
    parser.add_argument("--questions", type=pathlib.Path, default=DEFAULT_QUESTIONS)
    add_output_options(parser)
    args = parser.parse_args(argv)

    specs = [item.split("=", 1) for item in (args.head or ["v1=eagle3-smollm2-135m"])]
    if any(len(pair) != 2 for pair in specs):
        parser.error("--head takes NAME=PATH")
    model = jaxspec.load(weight_format=args.weight_format)
    heads = {name: jaxspec.load(path) for name, path in specs}
    picked = pick_prompts(args.questions, args.prompts)
    settings = [("chain", k, dict(num_draft_tokens=k)) for k in args.k]
    settings += [("tree", shape, dict(tree=shape)) for shape in args.tree]
    settings += [(kind, f"{value} +lookup{n}", dict(options, lookup_first=n))
                 for kind, value, options in list(settings) for n in args.lookup_first]

    rows = []  # (head, setting, {group: (first-draft acceptance, tau)})
    undraftable = {name: {} for name in heads}  # {head: {group: share of plain's tokens it cannot draft}}
    divergences = []  # trees under int8 / bf16 weights that left plain greedy (run_group)
    groups = list(args.groups)
    for group in groups:
        prompts = [p.text for p in picked[group]]
        plain = jaxspec.generate(model, None, prompts, chat=True, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        for name, head in heads.items():
            undraftable[name][group] = undraftable_share(head, plain.tokens)
            for kind, value, options in settings:
                # The native backend's attention is tree-exact by construction (docs/design.md).
                exact = args.weight_format == "f32" or kind == "chain" or model.products.name.value == "native"
                stats = run_group(model, head, prompts, plain.tokens, divergences, exact,
                                  f"{group} {name} {kind} {value}", **options)
                key = (name, f"{kind} {value}")
                entry = next((r for r in rows if r[0] == key), None)
                if entry is None:
                    entry = (key, {})
                    rows.append(entry)
                entry[1][group] = (stats.acceptance_by_position[0], stats.tau)
                print(f"{group:15s} {name:6s} {kind} {value}: first draft {stats.acceptance_by_position[0]:.3f}, "
                      f"tau {stats.tau:.2f}", flush=True)
    drafts = [(f"chain {args.timing_k}", dict(num_draft_tokens=args.timing_k))]
    drafts += [(f"tree {shape}", dict(tree=shape)) for shape in args.timing_tree]
    drafts += [(f"{label} +lookup{n}", dict(extra, lookup_first=n)) for label, extra in list(drafts)
               for n in args.lookup_first]
    timed = {f"{name} {label}": (head, extra) for name, head in heads.items() for label, extra in drafts}
    speed = timing(model, timed, [p.text for p in picked[args.timing_group][: args.timing_prompts]]
                   ) if args.timing_prompts else None

    title = section_title(args.weight_format, args.timing_group)
    lines = [title, "",
             f"{datetime.date.today()}, {cpu_description()}, jax {jax.__version__}, SmolLM2-135M-Instruct ({args.weight_format} weights), {args.prompts} prompts per group (first turns), "
             f"{NEW_TOKENS} greedy tokens, batch = the group's prompts; " + (
                 "every output equal to plain greedy." if not divergences else
                 "every chain's output equal to plain greedy; trees under these weights are exact only up to "
                 "rounding flips, and left it in " + f"{len(divergences)} rows (" + "; ".join(divergences) + ")."),
             "", "| head | trained on | training |", "|---|---|---|"]
    lines += [f"| {name} ({path}) | {head_data(path)} | {head_training(path)} |" for name, path in specs]
    lines += ["", "First-draft acceptance / tau per group:", "",
              "| head | drafts | " + " | ".join(groups) + " | mean |", "|---|---|" + "---:|" * (len(groups) + 1)]
    for (name, setting), by_group in rows:
        cells = [f"{by_group[g][0]:.2f} / {by_group[g][1]:.2f}" for g in groups]
        mean = (np.mean([by_group[g][0] for g in groups]), np.mean([by_group[g][1] for g in groups]))
        lines.append(f"| {name} | {setting} | " + " | ".join(cells) + f" | {mean[0]:.2f} / {mean[1]:.2f} |")
    lines += ["", "Share of plain greedy's tokens outside a head's draft vocabulary (never accepted there; "
              "- : the head drafts from the whole vocabulary):", "",
              "| head | " + " | ".join(groups) + " |", "|---|" + "---:|" * len(groups)]
    lines += [f"| {name} | " + " | ".join("-" if share[g] is None else f"{share[g]:.3f}" for g in groups) + " |"
              for name, share in undraftable.items()]
    if speed is not None:
        lines += ["", f"Wall-clock on {args.timing_prompts} {args.timing_group} prompts, batch 1 "
                  f"(median ratio of decode tokens/s; plain {speed['plain']:.1f} tok/s):", "",
                  "| head, drafts | speedup over plain |", "|---|---:|"]
        lines += [f"| {name} | {speed[name]:.2f}x |" for name in timed]
    lines += ["", command_line("heads.py", argv)]
    publish("\n".join(lines), title, args.results, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
