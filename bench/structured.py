"""JSON-schema generation on the default model: plain against prompt lookup and EAGLE-3, all under
the same grammar; the mask's cost per step; the grammar table's build time and memory.

    . .venv/bin/activate && python bench/structured.py
    . .venv/bin/activate && python bench/structured.py --max-new-tokens 16 --repeats 1 --no-write   # plumbing

Workload: extraction requests (a short text, "answer in JSON"), each constrained by a JSON schema
(jaxspec.grammar via outlines-core), in two groups: short fields (names, ages, quantities,
booleans, dates: short answers with little to copy) and copied fields (long names, emails and
addresses the answer copies from the prompt: prompt lookup's case). Greedy, chat template, one
prompt at a time, `--repeats` runs each (median); `--formats` (default f32 and int8 weights).
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
from results_md import add_output_options, replace_section, weight_formats  # noqa: E402

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
CONTACT = {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                            "address": {"type": "string"}},
           "required": ["name", "email", "address"]}
# Long fields copied from the prompt: what prompt lookup is for.
COPY_REQUESTS = [
    ("Contact card: name = Maria Gonzalez Ferrer; email = maria.gonzalez.ferrer@example-mail.com; address = "
     "Carrer de Mallorca 401, 4th floor, 08013 Barcelona, Spain. Give the name, email and address as JSON.", CONTACT),
    ("From the signature below, give the name, email and address as JSON.\n--\nDr. Thomas Alexander Becker\n"
     "thomas.becker@university-hamburg.example.de\nMartin-Luther-King-Platz 6, 20146 Hamburg, Germany", CONTACT),
    ("Shipping label: Priya Ramanathan, 221B Baker Street, Flat 3, London NW1 6XE, United Kingdom "
     "(priya.ramanathan@fastmail.example.org). Give the name, email and address as JSON.", CONTACT),
]
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


def generation_rows(model, head, repeats, max_new_tokens, requests):
    rows = {}
    configurations = [("plain, no grammar", None, dict(), False), ("plain", None, dict(), True),
                      ("prompt lookup k=4", None, dict(method="ngram", num_draft_tokens=4), True),
                      ("EAGLE-3 k=4", head, dict(num_draft_tokens=4), True)]
    for name, draft, options, constrained in configurations:
        tokens = seconds = rounds = 0
        proposed = accepted = 0
        outputs = []
        for prompt, schema in requests:
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


def machinery_overhead(model, repeats, new_tokens=48):
    """Plain decoding with no grammar against the same with a grammar table whose rows are all free
    (FREE allows every token): the same tokens at the same lengths, so the difference is what the
    loop's grammar work (walks, masks, end checks) costs per step. -> (free, with table) ms/step."""
    seconds = {"free": [], "table": []}
    steps = 0
    for prompt, _ in REQUESTS:
        runs = {}
        for name, options in (("free", {}), ("table", {"regex": [None]})):
            results = [jaxspec.generate(model, None, prompt, chat=True, max_new_tokens=new_tokens, ignore_eos=True,
                                        **options) for _ in range(repeats + 1)]
            runs[name] = results[1:]
            seconds[name].append(statistics.median(r.stats.decode_seconds for r in results[1:]))
        assert runs["free"][0].tokens == runs["table"][0].tokens
        steps += runs["free"][0].stats.rounds
    return tuple(1000 * sum(seconds[name]) / steps for name in ("free", "table"))


def mask_cost(model, tokenizer, repeats=200):
    """Seconds of one verify's mask work (allowed over k + 1 states, then the -inf fill) per layout."""
    compiled = grammar.compile_grammar(tokenizer, model.config.vocab_size, json_schema=json.dumps(EVENT))
    costs = {}
    for layout in ("dense", "classes", "sparse"):
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
        grammar.table._cached_table.cache_clear()  # time a build, not the cache
        start = time.perf_counter()
        table, _ = grammar.build_table([compiled], model.config.vocab_size)
        jax.block_until_ready(table)
        build = time.perf_counter() - start
        sizes = {layout: grammar.build_table([compiled], model.config.vocab_size, layout=layout)[0].nbytes
                 for layout in ("dense", "classes", "sparse")}
        times.append(dict(schema=list(schema["properties"]), states=compiled.num_states,
                          transitions=compiled.num_transitions, cold=cold, warm=warm, build=build,
                          auto=table.layout, **sizes))
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--formats", type=weight_formats, default=["f32", "int8"],
                        help="weight formats to run, e.g. f32,int8 (default both)")
    add_output_options(parser)
    args = parser.parse_args()
    jaxspec.set_compile_notices(False)

    lines = ["## Structured output (bench/structured.py)", "",
             f"SmolLM2-135M on this CPU ({jax.devices()[0].platform}), JSON-schema extraction, two groups: "
             f"short fields ({len(REQUESTS)} prompts: names, numbers, booleans, dates) and copied fields "
             f"({len(COPY_REQUESTS)} prompts: long names, emails and addresses the answer copies); greedy, "
             f"chat template, up to {args.max_new_tokens} new tokens, median of {args.repeats} runs each; "
             "speedups against plain constrained of the same weight format and group in the same run. Every "
             "constrained output validates against its schema; the speculative outputs are "
             "token-identical to plain constrained.", "",
             "| weights | group | run | tokens | tok/s | ms/step | tau | acceptance | speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    steps = {}
    for weight_format in args.formats:
        model = jaxspec.load(weight_format=weight_format)
        head = jaxspec.load("eagle3-smollm2-135m")
        for group, requests in (("short", REQUESTS), ("copied", COPY_REQUESTS)):
            rows = generation_rows(model, head, args.repeats, args.max_new_tokens, requests)
            plain = rows["plain"]
            if group == "short":
                steps[weight_format] = (plain["seconds"] / plain["rounds"],
                                        rows["plain, no grammar"]["seconds"] / rows["plain, no grammar"]["rounds"])
            for name, row in rows.items():
                rate = row["tokens"] / row["seconds"]
                tau = row["tokens"] / max(row["rounds"], 1)
                acceptance = f"{row['accepted'] / row['proposed']:.0%}" if row["proposed"] else "-"
                speedup = rate / (plain["tokens"] / plain["seconds"])
                lines.append(f"| {weight_format} | {group} | {name} | {row['tokens']} | {rate:.1f} | "
                             f"{1000 * row['seconds'] / max(row['rounds'], 1):.1f} | {tau:.2f} | {acceptance} | "
                             f"{speedup:.2f}x |")
    plain_step, free_step = steps[args.formats[0]]
    model = jaxspec.load()
    free_ms, table_ms = machinery_overhead(model, args.repeats)
    costs, _ = mask_cost(model, model.tokenizer)
    builds = build_times(model)
    lines += ["", f"Grammar cost per step, end to end (f32): plain decoding with a grammar table whose rows are all "
              f"free (every token allowed: the same tokens at the same lengths, {len(REQUESTS)} prompts x 48 tokens) "
              f"{table_ms:.2f} ms/step against {free_ms:.2f} with none ({table_ms / free_ms - 1:+.1%}: the walks, "
              "masks and end checks). Constrained against unconstrained on the short group "
              f"({args.formats[0]}): {1000 * plain_step:.2f} against {1000 * free_step:.2f} ms/step "
              f"({plain_step / free_step - 1:+.1%}; those outputs differ, so their steps run at other lengths).",
              "Alone (one verify's mask: `allowed` over [1, k + 1 = 5] states and the -inf fill, jitted, "
              "for the event schema):", ""]
    lines += ["| layout | table bytes | mask us | share of a plain step |", "|---|---|---|---|"]
    for layout, (seconds, nbytes) in costs.items():
        lines.append(f"| {layout} | {nbytes:,} | {1e6 * seconds:.0f} | {seconds / plain_step:.1%} |")
    lines += ["", "Table build (`compile_grammar` cold: outlines-core's index over the vocabulary, the "
              "tokenizer's byte map built first; warm: cached; `build_table`: the device table):", "",
              "| schema | states | transitions | compile cold s | warm ms | build_table ms | auto layout | dense bytes | "
              "classes bytes | sparse bytes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for b in builds:
        lines.append(f"| {', '.join(b['schema'])} | {b['states']} | {b['transitions']:,} | {b['cold']:.2f} | "
                     f"{1000 * b['warm']:.2f} | {1000 * b['build']:.1f} | {b['auto']} | {b['dense']:,} | "
                     f"{b['classes']:,} | {b['sparse']:,} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_write:
        replace_section(args.results, lines[0], report)


if __name__ == "__main__":
    main()
