"""JSON-schema generation on the default model: plain against prompt lookup and EAGLE-3, all under
the same grammar; the mask's cost per step; the grammar table's build time and memory.

    . .venv/bin/activate && python bench/structured.py
    . .venv/bin/activate && python bench/structured.py --max-new-tokens 16 --repeats 1 --no-write   # plumbing

Workload: extraction requests (a short text, "answer in JSON") whose answers copy names, places
and numbers from the prompt, each constrained by a JSON schema (jaxspec.grammar via
outlines-core), greedy, chat template, one prompt at a time, `--repeats` runs each (median).
Rows: plain, prompt lookup (k = 4) and the shipped EAGLE-3 head (k = 4), constrained; plain
unconstrained on the same prompts for the mask's end-to-end cost; speedups are against plain
constrained measured in the same run. Every speculative output is checked token-identical to
plain constrained, and every constrained output to validate against its schema.

The mask's cost is also measured alone: one jitted `allowed` + mask over [1, k + 1] states (what a
verify adds) against one plain decode step, for the dense and the sparse table layouts. Table
build: `compile_grammar` (outlines-core's index over the 49,152-token vocabulary) and
`build_table`, cold (a fresh tokenizer cache) and warm, and each layout's bytes. The table
replaces the `## Structured output (bench/structured.py)` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import jsonschema

import jaxspec
from jaxspec import grammar
from jaxspec.sampling import masked

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from results_md import replace_section  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer"}, "city": {"type": "string", "maxLength": 40}},
          "required": ["name", "age", "city"]}
ORDER = {"type": "object", "properties": {"item": {"type": "string", "maxLength": 40},
                                          "quantity": {"type": "integer"},
                                          "express": {"type": "boolean"}},
         "required": ["item", "quantity", "express"]}
EVENT = {"type": "object", "properties": {"event": {"type": "string", "maxLength": 60},
                                          "date": {"type": "string", "maxLength": 30},
                                          "attendees": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                                        "maxItems": 4}},
         "required": ["event", "date", "attendees"]}
REQUESTS = [
    ("Maria Gonzalez is 34 years old and lives in Barcelona. Give her name, age and city as JSON.", PERSON),
    ("Our new colleague, Thomas Becker, 52, moved here from Hamburg. Give his name, age and city as JSON.", PERSON),
    ("Please send 12 boxes of blue ballpoint pens by express delivery. Give the order as JSON "
     "(item, quantity, express).", ORDER),
    ("I would like 3 copies of The Great Gatsby, no rush. Give the order as JSON (item, quantity, express).", ORDER),
    ("The Spring Science Fair is on March 14, 2025; Alice, Bob and Chen will present. Give the event, date and "
     "attendees as JSON.", EVENT),
    ("Annual Board Meeting, October 2, 2024, attended by Dana Smith and Eli Jones. Give the event, date and "
     "attendees as JSON.", EVENT),
]


def _median_run(model, draft, prompt, schema, repeats, max_new_tokens, **options):
    runs = []
    for _ in range(repeats + 1):  # the first run compiles (or loads the program) and warms
        runs.append(jaxspec.generate(model, draft, prompt, chat=True, max_new_tokens=max_new_tokens,
                                     json_schema=schema, **options))
    timed = runs[1:]
    seconds = statistics.median(r.stats.decode_seconds for r in timed)
    return timed[0], seconds


def generation_rows(model, head, repeats, max_new_tokens):
    rows = {}
    configurations = [("plain, no grammar", None, dict(), False), ("plain", None, dict(), True),
                      ("prompt lookup k=4", None, dict(method="ngram", num_draft_tokens=4), True),
                      ("EAGLE-3 k=4", head, dict(num_draft_tokens=4), True)]
    for name, draft, options, constrained in configurations:
        tokens = seconds = rounds = 0
        proposed = accepted = 0
        outputs = []
        for prompt, schema in REQUESTS:
            result, run_seconds = _median_run(model, draft, prompt, schema if constrained else None, repeats,
                                              max_new_tokens, **options)
            if constrained and result.finish_reason[0] == "stop":  # a complete answer (not cut by the length)
                jsonschema.validate(json.loads(result.text[0]), schema)
            outputs.append(result.tokens[0])
            tokens += result.stats.decode_tokens
            seconds += run_seconds
            rounds += result.stats.rounds
            proposed += result.stats.proposed
            accepted += result.stats.accepted
        rows[name] = dict(tokens=tokens, seconds=seconds, rounds=rounds, proposed=proposed, accepted=accepted,
                          outputs=outputs)
        print(f"{name}: {tokens} tokens in {seconds:.2f} s ({tokens / seconds:.1f} tok/s), tau "
              f"{tokens / max(rounds, 1):.2f}", flush=True)
    for name in ("prompt lookup k=4", "EAGLE-3 k=4"):
        assert rows[name]["outputs"] == rows["plain"]["outputs"], f"{name} differs from plain constrained"
    return rows


def mask_cost(model, tokenizer, repeats=200):
    """Seconds of one verify's mask work (allowed over k + 1 states, then the -inf fill) per layout."""
    compiled = grammar.compile_grammar(tokenizer, model.config.vocab_size, json_schema=json.dumps(EVENT))
    costs = {}
    for layout in ("dense", "sparse"):
        table, starts = grammar.build_table([compiled], model.config.vocab_size, layout=layout)
        states = jnp.asarray(starts)[:, None].repeat(5, axis=1)  # [1, k+1]
        logits = jnp.zeros((1, 5, model.config.vocab_size), jnp.float32)

        @jax.jit
        def apply(table, states, logits):
            return masked(logits, table.allowed(states))

        jax.block_until_ready(apply(table, states, logits))
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(apply(table, states, logits))
            samples.append(time.perf_counter() - start)
        costs[layout] = (statistics.median(samples), table.nbytes)
    return costs, compiled


def build_times(model):
    """compile_grammar cold (a tokenizer the cache has not seen) and warm, and build_table, per schema."""
    times = []
    for schema in (PERSON, ORDER, EVENT):
        fresh = jaxspec.load().tokenizer  # a new Tokenizer object: its vocabulary is built afresh
        start = time.perf_counter()
        compiled = grammar.compile_grammar(fresh, model.config.vocab_size, json_schema=json.dumps(schema))
        cold = time.perf_counter() - start
        start = time.perf_counter()
        grammar.compile_grammar(fresh, model.config.vocab_size, json_schema=json.dumps(schema))
        warm = time.perf_counter() - start
        start = time.perf_counter()
        table, _ = grammar.build_table([compiled], model.config.vocab_size)
        jax.block_until_ready(table)
        build = time.perf_counter() - start
        dense, _ = grammar.build_table([compiled], model.config.vocab_size, layout="dense")
        sparse, _ = grammar.build_table([compiled], model.config.vocab_size, layout="sparse")
        times.append(dict(schema=list(schema["properties"]), states=compiled.num_states,
                          transitions=compiled.num_transitions, cold=cold, warm=warm, build=build,
                          auto=table.layout, dense=dense.nbytes, sparse=sparse.nbytes))
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    jaxspec.set_compile_notices(False)

    model = jaxspec.load()
    head = jaxspec.load("eagle3-smollm2-135m")
    rows = generation_rows(model, head, args.repeats, args.max_new_tokens)
    plain = rows["plain"]
    plain_step = plain["seconds"] / plain["rounds"]
    free = rows["plain, no grammar"]
    free_step = free["seconds"] / free["rounds"]
    costs, _ = mask_cost(model, model.tokenizer)
    builds = build_times(model)

    lines = ["## Structured output (bench/structured.py)", "",
             f"SmolLM2-135M f32 on this CPU ({jax.devices()[0].platform}), JSON-schema extraction: "
             f"{len(REQUESTS)} prompts, greedy, chat template, up to {args.max_new_tokens} new tokens, "
             f"median of {args.repeats} runs each; speedups against plain constrained in the same run. "
             "Every constrained output validates against its schema; the speculative outputs are "
             "token-identical to plain constrained.", "",
             "| run | tokens | tok/s | ms/step | tau | acceptance | speedup |", "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        rate = row["tokens"] / row["seconds"]
        tau = row["tokens"] / max(row["rounds"], 1)
        acceptance = f"{row['accepted'] / row['proposed']:.0%}" if row["proposed"] else "-"
        speedup = rate / (plain["tokens"] / plain["seconds"])
        lines.append(f"| {name} | {row['tokens']} | {rate:.1f} | {1000 * row['seconds'] / max(row['rounds'], 1):.1f} "
                     f"| {tau:.2f} | {acceptance} | {speedup:.2f}x |")
    lines += ["", f"Mask cost per step, end to end: plain constrained {1000 * plain_step:.2f} ms/step against "
              f"{1000 * free_step:.2f} unconstrained ({plain_step / free_step - 1:+.1%}; the outputs differ, "
              "so the steps run at different lengths).",
              "Alone (one verify's mask: `allowed` over [1, k + 1 = 5] states and the -inf fill, jitted):", ""]
    lines += ["| layout | table bytes | mask us | share of a plain step |", "|---|---|---|---|"]
    for layout, (seconds, nbytes) in costs.items():
        lines.append(f"| {layout} | {nbytes:,} | {1e6 * seconds:.0f} | {seconds / plain_step:.1%} |")
    lines += ["", "Table build (`compile_grammar` cold: outlines-core's index over the vocabulary, the "
              "tokenizer's byte map built first; warm: cached; `build_table`: the device table):", "",
              "| schema | states | transitions | compile cold s | warm ms | build_table ms | auto layout | dense bytes | "
              "sparse bytes |", "|---|---|---|---|---|---|---|---|---|"]
    for b in builds:
        lines.append(f"| {', '.join(b['schema'])} | {b['states']} | {b['transitions']:,} | {b['cold']:.2f} | "
                     f"{1000 * b['warm']:.2f} | {1000 * b['build']:.1f} | {b['auto']} | {b['dense']:,} | "
                     f"{b['sparse']:,} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_write:
        replace_section(ROOT / "bench" / "RESULTS.md", lines[0], report)


if __name__ == "__main__":
    main()
