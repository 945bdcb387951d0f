"""Online first-draft acceptance against teacher-forced agreement on the very text it produced:
is a head's held-out validation figure what it does when drafting?

    . .venv/bin/activate && python bench/head_agreement.py --run runs/v2_r02 \
        --head v1=eagle3-smollm2-135m --head v2_s100=runs/heads/v2_s100

For each EAGLE-3 head: greedy speculative decoding (chain k = `--k`, float32 target) of the first
`--prompts` held-out prompts of the training run `--run` (its own split), then, over the prompt
and the text it produced, the head run once over the whole sequence on the target's features
(as training's depth 0 sees them): how often its argmax is the target's next token. The online
figure counts only round starts, so it sits below the teacher-forced one; two heads ordered one
way by validation and the other way here point at the data, not at the objective.

The table replaces the section "## Head agreement, online and teacher-forced
(bench/head_agreement.py)" of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform

import jax.numpy as jnp
import numpy as np

from results_md import add_output_options, command_line, publish  # bench/ is on sys.path when a bench script runs

import jaxspec
from jaxspec import train
from jaxspec.models import eagle3
from jaxspec.train.features import target_batch


def teacher_forced_agreement(target, head, rows: list[list[int]], prompt_lengths: list[int]) -> tuple[int, int]:
    """(agreeing, counted) answer positions: the head's depth-0 draft at slot p (feature p, token
    p + 1) against the target's argmax at p + 1, for every p whose drafted token is an answer's."""
    width = -(-max(map(len, rows)) // 64) * 64
    tokens = np.zeros((len(rows), width), np.int32)  # [B, W], right-padded
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    hidden = eagle3.target_hidden_layers(head.config.aux_layer_ids)
    out = target_batch(target.params, target.config, hidden,
                       {"tokens": jnp.asarray(tokens), "loss_mask": jnp.zeros(tokens.shape, bool)})
    g = eagle3.encode(head.params, out["features"])  # [B, W, D]
    tokens_in = jnp.asarray(np.concatenate([tokens[:, 1:], np.zeros((len(rows), 1), np.int32)], axis=1))
    logits, _, _ = eagle3.forward(head.params, head.config, target.params.embed, tokens_in, g,
                                  eagle3.create_cache(head.config, len(rows), width))
    drafted = np.asarray(eagle3.to_target_ids(head.params, jnp.argmax(logits, axis=-1)))  # [B, W]
    labels = np.asarray(out["labels"])  # [B, W]: the target's argmax after each position
    agreeing = counted = 0
    for i, row in enumerate(rows):
        slots = np.arange(prompt_lengths[i] - 1, len(row) - 2)
        agreeing += int((drafted[i, slots] == labels[i, slots + 1]).sum())
        counted += len(slots)
    return agreeing, counted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a train-head run directory: its data's held-out prompts")
    parser.add_argument("--head", action="append", required=True, metavar="NAME=PATH", help="an EAGLE-3 head (repeat)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    add_output_options(parser)
    args = parser.parse_args(argv)
    specs = [item.split("=", 1) for item in args.head]
    if any(len(pair) != 2 for pair in specs):
        parser.error("--head takes NAME=PATH")

    cfg, data = train.saved_run(args.run)
    _, held_out = train.split_rows(data, cfg.val_fraction, cfg.seed)
    chosen = held_out[: args.prompts]
    prompts = [data.tokens[i, : data.prompt_lengths[i]].tolist() for i in chosen]
    target = jaxspec.load(weight_format="f32")
    title = "## Head agreement, online and teacher-forced (bench/head_agreement.py)"
    lines = [title, "",
             f"{datetime.date.today()}, {platform.machine()}, SmolLM2-135M-Instruct (f32), the first {len(prompts)} "
             f"held-out prompts of {args.run}, {args.new_tokens} greedy tokens, chain k = {args.k}.", "",
             "| head | online first-draft acceptance | tau | teacher-forced depth-0 agreement, same text |",
             "|---|---:|---:|---:|"]
    for name, path in specs:
        head = jaxspec.load(path)
        result = jaxspec.generate(target, head, prompts, max_new_tokens=args.new_tokens, num_draft_tokens=args.k,
                                  ignore_eos=True)
        agreeing, counted = teacher_forced_agreement(target, head, [p + list(t) for p, t in zip(prompts, result.tokens)],
                                                     [len(p) for p in prompts])
        lines.append(f"| {name} ({path}) | {result.stats.acceptance_by_position[0]:.3f} | {result.stats.tau:.2f} | "
                     f"{agreeing / counted:.3f} ({counted} positions) |")
        print(lines[-1], flush=True)
    lines += ["", command_line("head_agreement.py", argv)]
    publish("\n".join(lines), title, args.results, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
