"""Speculative decoding on Spec-Bench: trained heads, prompt lookup and layer-skip vs plain, jaxspec vs transformers.

    . .venv/bin/activate && python bench/spec.py            # 4 prompts per group, HF on 2
    . .venv/bin/activate && python bench/spec.py --quick    # 2 prompts per group, HF on 1, k = 4
    . .venv/bin/activate && python bench/spec.py --prompts 8 --hf-prompts 4   # the whole set
    . .venv/bin/activate && python bench/spec.py --model gemma3-270m --quick --k 2 4 --temperatures   # Gemma-3-270M

Time on this 2-core machine is dominated by decoding itself (128 tokens x 5 methods x prompt,
with a prefill of seconds for each summarization/rag call) and by compiling (one program per
method and prompt-length bucket): see the total in RESULTS.md.

Default model (SmolLM2-135M-Instruct Q4_1 GGUF, dequantized to float32; `--model` picks another of
MODELS: gemma3-270m is Gemma-3-270M, the pretrained base model, Q4_K_M GGUF, fed plain prompts
without a chat template and without a trained head), batch 1, 128 greedy tokens
(`ignore_eos=True`, so every method does the same work), chat template on, the first turn
of Spec-Bench questions in six groups: summarization, rag, qa, translation, math_reasoning and
mt_bench (the eight MT-bench categories together). Per prompt, every method runs back to back
(jaxspec plain, prompt lookup at each k, layer-skip, then HF plain and HF prompt lookup) so that
drift on a shared machine hits them alike; a speedup is the ratio of a method's decode tokens/s to
plain's on the same prompt, and every figure is a median over prompts.

Also measured:
  * exactness: each speculative output must equal jaxspec's plain greedy output token for token
    (mismatches are counted and listed: any is a bug);
  * the cost of one target forward at T = 1..9 new tokens relative to T = 1 (cache of capacity
    1024 holding 300 tokens): a round of k drafts runs T = k + 1, so a method beats plain only if
    its tau (tokens committed per round) exceeds cost(k + 1) / cost(1) plus its drafting cost;
  * sampled decoding at temperature 0.7 and 1.0 (`--temperatures`): plain sampling vs prompt lookup
    and layer-skip (lossless rejection sampling), tau and speedup, HF's sampled plain and prompt
    lookup beside them, on the first 2 prompts of each group (`--sampled-prompts`);
  * draft trees (EAGLE-2 dynamic trees, `--trees D,K,N ...`) beside chains at the same head and
    for prompt lookup (`--ngram-trees`): tau, speedup, the tree/chain tau ratio per group, the best
    setting per group, and the cost of a tree verify at T = 1 + N (`--tree-cost-nodes`, up to 64)
    next to a causal forward of the same T;
  * trained draft heads: the shipped EAGLE-3 head (`--eagle3`, default "eagle3-smollm2-135m",
    at k = `--eagle3-k`, default 2 4 6) and optionally an MTP head trained by `jaxspec.cli
    train-head --method mtp` (`--mtp DIR`, k = `--mtp-k`), in the greedy and the sampled rows,
    with acceptance per draft position and the cost of one head step next to a target step;
  * the layer-skip exit layer and k, picked on 2 prompts (the first qa and mt_bench ones) by
    predicted speedup = tau x cost(1) / round cost, where tau is the exact acceptance of an
    early-exit draft replayed along plain greedy output (one forward per prompt) and the round
    cost is measured (draft forwards at T = 2 and 1, verification at T = k + 1).

The result replaces the `## Speculative decoding (bench/spec.py)` section of bench/RESULTS.md
(other sections kept) and the figure goes to bench/spec_speedup.png; another model writes its own
section (`## Gemma-3-270M: speculation (bench/spec.py --model gemma3-270m)`) and figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import datetime
import functools
import json
import math
import pathlib
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from forward_cost import forward_costs, heap_tree, timed  # bench/ is on sys.path when a bench script runs
from results_md import add_output_options, cpu_description, peer_versions, replace_section

os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loading bars in the log
HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_QUESTIONS = HERE / "data" / "spec_bench" / "question.jsonl"
DEFAULT_PLOT = HERE / "spec_speedup.png"
SECTION = "## Speculative decoding (bench/spec.py)"
SHORT_CACHE = (256, 100)  # (capacity, length): the cache a short prompt + 128 new tokens runs with
GROUPS = ("summarization", "rag", "qa", "translation", "math_reasoning", "mt_bench")
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
# A token no chat answer produces, passed as a stop token so that jaxspec's prefill/decode time
# split is right under ignore_eos (see `run_jaxspec`). Every run is checked to reach 128 tokens.
TIMING_STOP_TOKEN = "<empty_output>"


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """What the benchmark needs to know about one model `--model` names."""

    title: str  # the model and its file, in the report's header
    short: str  # in the figure's title
    chat: bool  # prompts through the tokenizer's chat template (an instruction-tuned model) or plain
    section: str  # its RESULTS.md section (f32 target; other formats and tags append to it)
    plot: str  # its figure's file name in bench/ (f32 target)
    eagle3: str  # the default --eagle3 head ("none": there is none)
    exit_layers: tuple[int, ...]  # the layer-skip sweep (default; --quick: its first and third)
    timing_stop: str = TIMING_STOP_TOKEN  # a token no answer produces (see run_jaxspec)


DEFAULT_MODEL = "smollm2-135m"
MODELS = {
    DEFAULT_MODEL: ModelSettings("SmolLM2-135M-Instruct Q4_1 GGUF", "SmolLM2-135M", chat=True, section=SECTION,
                                 plot="spec_speedup.png", eagle3="eagle3-smollm2-135m", exit_layers=(8, 12, 16, 20)),
    "gemma3-270m": ModelSettings(
        "Gemma-3-270M (the pretrained base model, not instruction-tuned) Q4_K_M GGUF", "Gemma-3-270M (base)",
        chat=False, section="## Gemma-3-270M: speculation (bench/spec.py --model gemma3-270m)",
        plot="spec_speedup_gemma3-270m.png", eagle3="none", exit_layers=(12, 15, 17), timing_stop="<unused0>"),
}


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    """The prompt's ids as jaxspec.generate(chat=chat) builds them."""
    return tokenizer.encode_chat(text) if chat else tokenizer.encode(text)


@dataclasses.dataclass(frozen=True)
class Prompt:
    group: str
    question_id: int
    category: str
    text: str


def pick_prompts(path: pathlib.Path, per_group: int) -> dict[str, list[Prompt]]:
    """The first `per_group` questions of each group by question_id (first turns).

    mt_bench takes the categories in turn (writing #81, roleplay #91, reasoning #101, ...), so
    that its prompts cover all eight rather than the first eight writing ones.
    """
    if not path.is_file():
        sys.exit(f"{path}: no such file; pass --questions PATH to Spec-Bench's question.jsonl")
    by_category: dict[str, list[dict]] = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            q = json.loads(line)
            by_category.setdefault(q["category"], []).append(q)
    for questions in by_category.values():
        questions.sort(key=lambda q: q["question_id"])
    picked: dict[str, list[Prompt]] = {}
    for group in GROUPS:
        if group == "mt_bench":
            queues = [by_category.get(c, []) for c in MT_BENCH]
            order = [q for rank in range(max(map(len, queues), default=0)) for queue in queues
                     if rank < len(queue) for q in [queue[rank]]]
        else:
            order = by_category.get(group, [])
        if len(order) < per_group:
            sys.exit(f"{path}: group {group} has {len(order)} questions, need {per_group}")
        picked[group] = [Prompt(group, q["question_id"], q["category"], q["turns"][0]) for q in order[:per_group]]
    return picked


def median(values) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else math.nan


# ---------------------------------------------------------------------------------------------
# Cost of one forward at T new tokens
# ---------------------------------------------------------------------------------------------


def head_step_cost(model, head, capacity: int, length: int, calls: int, iters: int = 4) -> float:
    """Median seconds of one draft step of a feature head (EAGLE-3 or MTP) at T = 1, timed like
    `forward_costs` (a jitted loop with the head's cache in the carry)."""
    from jaxspec.api import lm_head_of
    from jaxspec.models import eagle3, mtp

    cfg = head.config
    module = eagle3 if isinstance(cfg, eagle3.Eagle3Config) else mtp
    cache = module.create_cache(cfg, 1, capacity).set_length(jnp.full((1,), length, jnp.int32))
    tokens = jnp.asarray([[100]], jnp.int32)
    feature = jnp.ones((1, 1, model.config.dim), jnp.float32)
    extra = () if module is eagle3 else (lm_head_of(model),)

    @jax.jit
    def loop(params, embed, extra, cache):
        def body(_, carry):
            cache, g, checksum = carry
            logits, g, cache = module.forward(params, cfg, embed, *extra, tokens, g, cache)
            return cache, g, checksum + logits[0, -1, 0]

        return jax.lax.fori_loop(0, iters, body, (cache, feature, jnp.zeros((), jnp.float32)))[2]

    timed(loop, head.params, model.params.embed, extra, cache)  # compile
    return median(timed(loop, head.params, model.params.embed, extra, cache)[1] / iters for _ in range(calls))


# ---------------------------------------------------------------------------------------------
# Layer-skip: exact acceptance replay along plain greedy output
# ---------------------------------------------------------------------------------------------


def early_exit_argmax(model, ids: list[int], exits: tuple[int, ...]) -> dict[int, np.ndarray]:
    """For each exit e: argmax of final_norm + head after the first e layers, at every position.

    This is what the layer-skip draft (the target's first e layers, its norm and head) predicts
    for the next token given the true context: its K/V for context tokens are the target's own
    first-e-layer K/V, so along an accepted prefix the draft's proposals are these argmaxes.
    """
    size = max(16, 1 << (len(ids) - 1).bit_length())  # few distinct shapes, few compiles
    tokens = np.zeros((1, size), np.int32)
    tokens[0, : len(ids)] = ids
    predictions = jax.device_get(_early_exit_predict(model.params, jnp.asarray(tokens), cfg=model.config,
                                                     exits=exits))
    return {e: np.asarray(p)[: len(ids)] for e, p in zip(exits, predictions)}


@functools.partial(jax.jit, static_argnames=("cfg", "exits"))
def _early_exit_predict(params, tokens, *, cfg, exits):
    from jaxspec import models
    from jaxspec.models import layers

    cache = models.create_cache(cfg, 1, tokens.shape[1])
    _, hiddens, _ = models.forward(params, cfg, tokens, cache, hidden_layers=tuple(e - 1 for e in exits),
                                   logit_indices=jnp.zeros((1, 1), jnp.int32))
    head = layers.output_head(params.embed, params.lm_head)
    out = []
    for h in hiddens:  # [1, T, D]
        normed = layers.rms_norm(h[0], params.final_norm, cfg.norm_eps, axis=1)  # [T, D]
        out.append(jnp.argmax(normed @ head.T, axis=-1))
    return out


def replay_rounds(predicted: np.ndarray, prompt_length: int, generated: list[int], k: int) -> int:
    """Rounds a k-draft whose proposal for each position is `predicted[position - 1]` needs to
    commit `generated` (the target's greedy output; its first token comes from prefill)."""
    committed, rounds, total = 1, 0, len(generated)
    while committed < total:
        accepted = 0
        while (accepted < k and committed + accepted < total
               and predicted[prompt_length + committed + accepted - 1] == generated[committed + accepted]):
            accepted += 1
        committed += accepted + 1
        rounds += 1
    return rounds


# ---------------------------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Method:
    name: str  # row label
    key: str  # "plain" | "ngram-4" | "layer_skip" | "hf" | "hf-pld"
    method: str  # jaxspec method, or "hf"
    k: int = 0
    exit_layer: int | None = None
    draft: str | None = None  # a key of the loaded heads: "eagle3" | "mtp"
    tree: str | None = None  # "D,K,N": draft a tree of that shape (k is then its depth)


def run_jaxspec(model, prompt: Prompt, m: Method, new_tokens: int, timing_stop: int,
                temperature: float = 0.0, seed: int = 0, heads: dict | None = None, chat: bool = True) -> dict:
    import jaxspec

    kwargs = dict(chat=chat, max_new_tokens=new_tokens, ignore_eos=True, method=m.method,
                  temperature=temperature, seed=seed)
    if m.tree is not None:
        kwargs["tree"] = m.tree
    elif m.method != "plain":
        kwargs["num_draft_tokens"] = m.k
    if m.method == "layer_skip":
        kwargs["exit_layer"] = m.exit_layer
    # With ignore_eos and no stop token, nothing after prefill depends on its logits, and the
    # "prefill done" host callback fires before prefill has run: decode_seconds then includes
    # the prefill (seconds for a long prompt here). A stop token that never comes restores the
    # dependency. Reported upstream; harmless once fixed.
    kwargs["stop_token_ids"] = [timing_stop]
    result = jaxspec.generate(model, (heads or {}).get(m.draft), prompt.text, **kwargs)
    s = result.stats
    return dict(tokens=result.tokens[0], tps=s.decode_tokens_per_second, tau=s.tau,
                acceptance=s.acceptance_rate, by_position=s.acceptance_by_position, depths=s.accepted_depths,
                prefill_s=s.prefill_seconds, compile_s=s.compile_seconds, complete=s.new_tokens == new_tokens)


class HF:
    """transformers `generate` on the same GGUF weights (float32), plain or prompt lookup."""

    def __init__(self, path: pathlib.Path):
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32).eval()

    def generate(self, ids: list[int], new_tokens: int, lookup: int = 0, temperature: float = 0.0,
                 seed: int = 0) -> dict:
        """`generate` (greedy, or sampling at `temperature`); decode tokens/s = tokens after the first
        step's over the time after it.

        A streamer timestamps every step on the host, so prefill (the step that returns the
        first token, or the first accepted block under prompt lookup) is cut out of the same call.
        """
        from transformers.generation.streamers import BaseStreamer

        class Clock(BaseStreamer):
            def __init__(self):
                self.steps = []  # (time, tokens) per put after the prompt's

            def put(self, value):
                self.steps.append((time.perf_counter(), int(value.numel())))

            def end(self):
                pass

        torch = self.torch
        input_ids = torch.tensor([ids])
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        if temperature > 0:
            torch.manual_seed(seed)
            extra |= dict(temperature=temperature, top_k=0, top_p=1.0)
        clock = Clock()
        with torch.inference_mode():
            out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=temperature > 0,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                                      streamer=clock, **extra)
            done = time.perf_counter()
        tokens = out[0, len(ids):].tolist()
        first_at, first_tokens = clock.steps[1]  # steps[0] is the prompt itself
        decode_s = done - first_at
        rate = (len(tokens) - first_tokens) / decode_s if decode_s > 0 else math.nan
        return dict(tokens=tokens, tps=rate)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec) + suffix


def group_summary(records: list[dict], methods: list[Method], hf_ids: set[int]) -> dict:
    """Per method: median tok/s, tau, acceptance, speedup (all prompts and HF's), exact count."""
    out = {}
    for m in methods:
        rows = [r for r in records if m.key in r]
        hf_rows = [r for r in rows if r["qid"] in hf_ids]
        speed = [r[m.key]["tps"] / r["plain"]["tps"] for r in rows] if m.method != "hf" else (
            [r[m.key]["tps"] / r["hf"]["tps"] for r in rows])
        speed_hf = [r[m.key]["tps"] / r["plain"]["tps"] for r in hf_rows] if m.method != "hf" else speed
        out[m.key] = dict(
            n=len(rows),
            tps=median(r[m.key]["tps"] for r in rows),
            tau=median(r[m.key].get("tau") for r in rows),
            acceptance=median(r[m.key].get("acceptance") for r in rows),
            speedup=median(speed),
            speedup_hf_prompts=median(speed_hf),
            exact=sum(r[m.key].get("exact", True) for r in rows),
        )
    return out


def section_title(weight_format: str, tag: str | None = None, model: str = DEFAULT_MODEL) -> str:
    """This script's RESULTS.md section: one per model, weight format (f32 keeps the model's title)
    and `--section` tag (a focused run, e.g. the tree sweep, keeps its own section beside the full one)."""
    base = MODELS[model].section
    title = base if weight_format == "f32" else f"{base[:-1]} --weight-format {weight_format})"
    return title if not tag else f"{title}: {tag}"


def build_report(args, picked, methods, hf_methods, records, summaries, costs, sweep, chosen,
                 mismatches, incomplete, seconds, compile_s, sampling: str = "") -> str:
    settings = MODELS[args.model]
    lines = [f"{section_title(args.weight_format, args.section, args.model)}\n",
             f"Target weights: {args.weight_format} (the heads follow).\n"]
    total_prompts = sum(len(v) for v in picked.values())
    lines.append(
        f"{datetime.date.today().isoformat()}; {cpu_description()}, {os.cpu_count()} cores, shared "
        f"with other work (timings noisy: methods run back to back per prompt, figures are medians over "
        f"prompts, speedups are per-prompt ratios to plain on the same prompt); jax {jax.__version__}, "
        f"{peer_versions()}. {settings.title} dequantized to float32, batch 1, "
        f"{args.max_new_tokens} greedy tokens (`ignore_eos`), "
        f"{'chat template' if settings.chat else 'plain prompts (chat=False: no chat template, a base model)'}, "
        f"first turns of Spec-Bench "
        f"questions: {args.prompts} per group (the first by question_id; mt_bench takes its eight "
        f"categories in turn), {total_prompts} in all; HF transformers on the first {args.hf_prompts} of "
        f"each group. Total run {seconds / 60:.1f} min ({compile_s / 60:.1f} min of it compiling).\n")
    flags = "".join(" " + shlex.quote(a) for a in args.argv)
    lines.append(f"Rerun: `. .venv/bin/activate && python bench/spec.py{flags}`\n")

    # Exactness.
    spec_runs = sum(1 for r in records for m in methods if m.method not in ("plain", "hf") and m.key in r)
    if mismatches:
        detail = "; ".join(f"{key} on #{qid} (first difference at token {at})" for key, qid, at in mismatches)
        lines.append(f"**Exactness: {len(mismatches)} of {spec_runs} speculative runs differ from plain "
                     f"greedy: {detail}.**\n")
    else:
        lines.append(f"Exactness: all {spec_runs} speculative runs produced exactly jaxspec's plain greedy "
                     f"tokens.\n")
    if incomplete:
        lines.append(f"Runs that stopped short of {args.max_new_tokens} tokens (timing stop token hit): "
                     + ", ".join(incomplete) + "\n")

    # Overview.
    lines.append("### Speedup over plain decoding (decode tokens/s ratio, median over prompts)\n")
    head = ["group"] + [m.name for m in methods if m.method != "plain"] + [m.name for m in hf_methods if m.key != "hf"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|---" + "|---:" * (len(head) - 1) + "|")
    for group in GROUPS:
        s = summaries[group]
        cells = [fmt(s[m.key]["speedup"], ".2f", "x") for m in methods if m.method != "plain"]
        cells += [fmt(s[m.key]["speedup"], ".2f", "x") for m in hf_methods if m.key != "hf"]
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    lines.append("")

    # Per group.
    for group in GROUPS:
        prompts = picked[group]
        hf_prompts = prompts[: args.hf_prompts]
        lines.append(f"### {group}\n")
        lines.append(
            "Prompts: " + ", ".join(f"#{p.question_id}" + (f" ({p.category})" if group == "mt_bench" else "")
                                    for p in prompts)
            + "; HF on " + (", ".join(f"#{p.question_id}" for p in hf_prompts) if hf_prompts else "none")
            + ". Prompt tokens: " + ", ".join(str(r["prompt_tokens"]) for r in records if r["group"] == group)
            + ".\n")
        s = summaries[group]
        lines.append("| method | jaxspec tok/s | tau | accepted | speedup | speedup on HF's prompts | exact "
                     "| HF tok/s | HF speedup |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        hf_for = {"plain": "hf", f"ngram-{args.hf_k}": "hf-pld"}
        for m in methods:
            x = s[m.key]
            hf_key = hf_for.get(m.key)
            hf = s.get(hf_key) if hf_key else None
            tau = "1.00" if m.method == "plain" else fmt(x["tau"], ".2f")
            accepted = "-" if m.method == "plain" else fmt(100 * x["acceptance"], ".0f", "%")
            exact = "-" if m.method == "plain" else f"{x['exact']}/{x['n']}"
            lines.append(
                f"| {m.name} | {fmt(x['tps'], '.1f')} | {tau} | {accepted} | {fmt(x['speedup'], '.2f', 'x')} "
                f"| {fmt(x['speedup_hf_prompts'], '.2f', 'x') if hf_prompts else '-'} | {exact} "
                f"| {fmt(hf['tps'], '.1f') if hf else '-'} "
                f"| {fmt(hf['speedup'], '.2f', 'x') if hf and hf_key != 'hf' else ('1.00x' if hf else '-')} |")
        lines.append("")

    # Cost curve.
    base = costs["T=1"]
    lines.append("### Cost of one target forward at T new tokens (the bound on every speedup here)\n")
    lines.append(f"`jaxspec.models.forward` of the whole model ({type(args.model_config).__name__}), batch 1, timed as a jitted `fori_loop` of 4 "
                 f"forwards with the cache in the carry (as in the generation loop), median of {args.cost_calls} "
                 f"calls per T taken round-robin. Cache of capacity {args.cost_capacity} holding {args.cost_length} "
                 f"tokens (about what a summarization or rag prompt runs with), and of capacity {SHORT_CACHE[0]} "
                 f"holding {SHORT_CACHE[1]} (a short prompt + {args.max_new_tokens} new tokens). A round with k "
                 "drafts verifies T = k + 1 tokens, so even free drafts win only if tau > cost(k + 1) / cost(1): "
                 "the break-even tau.\n")
    lines.append(f"| T | ms ({args.cost_capacity}/{args.cost_length}) | cost / cost(1) = break-even tau "
                 f"| ms ({SHORT_CACHE[0]}/{SHORT_CACHE[1]}) | cost / cost(1) = break-even tau |")
    lines.append("|---:|---:|---:|---:|---:|")
    short_base = costs["short T=1"]
    for t in range(1, args.cost_max_t + 1):
        c, short = costs[f"T={t}"], costs.get(f"short T={t}")
        short_cells = f"{1e3 * short:.1f} | {short / short_base:.2f}" if short else "- | -"
        lines.append(f"| {t} | {1e3 * c:.1f} | {c / base:.2f} | {short_cells} |")
    lines.append("")

    # Layer-skip sweep.
    if sweep:
        lines.append("### Layer-skip: choice of exit layer and k\n")
        lines.append(
            f"On {len(sweep['prompts'])} prompts (" + ", ".join(f"#{q}" for q in sweep["prompts"]) + "): tau is "
            "replayed exactly from plain greedy output (the first-e-layers draft's argmax at each position, "
            "from one forward), predicted speedup = tau x cost(1) / (draft cost(T=2) + (k - 1) x draft "
            f"cost(T=1) + cost(T=k+1)), costs with the {SHORT_CACHE[0]}/{SHORT_CACHE[1]} cache as in the table "
            "above; the drafts' costs are "
            f"measured at exit layers {min(sweep['exits'])} and {max(sweep['exits'])} and interpolated "
            "between (linear in layers).\n")
        ks_sweep = sweep["ks"]
        lines.append("| exit layer | draft cost(1) / cost(1) | " + " | ".join(
            f"tau k={k} | predicted k={k}" for k in ks_sweep) + " |")
        lines.append("|---:|---:|" + "---:|---:|" * len(ks_sweep))
        for e in sweep["exits"]:
            cells = []
            for k in ks_sweep:
                tau, pred = sweep["tau"][(e, k)], sweep["predicted"][(e, k)]
                cells += [f"{tau:.2f}", f"{pred:.2f}x"]
            lines.append(f"| {e} | {sweep['draft_cost'][e]:.2f} | " + " | ".join(cells) + " |")
        e, k = chosen
        lines.append(f"\nChosen: exit layer {e}, k = {k} (predicted {sweep['predicted'][(e, k)]:.2f}x, replayed tau "
                     f"{sweep['tau'][(e, k)]:.2f}; measured on the same prompts in the main run: tau "
                     f"{fmt(sweep.get('measured_tau'), '.2f')}, speedup {fmt(sweep.get('measured_speedup'), '.2f', 'x')}).\n")

    lines.append(tree_report(summaries, methods, costs, args))
    lines.append(acceptance_report(records, methods, costs, args))
    if sampling:
        lines.append(sampling)
    if args.plot is not None:
        lines.append("Figure: `bench/spec_speedup.png` (speedup per group and method; the T-cost curve).\n")
    lines.append(_reading(summaries, methods, hf_methods, costs, args))
    return "\n".join(lines)


def tree_report(summaries: dict, methods: list[Method], costs: dict, args) -> str:
    """Trees against chains at the same drafter, per group: the best chain and the best tree by
    speedup, their tau ratio (best tree tau / best chain tau), and the cost of a tree verify."""
    trees = [m for m in methods if m.tree]
    if not trees:
        return ""
    lines = ["### Draft trees vs chains at the same drafter\n",
             "EAGLE-2 dynamic trees (`tree=D,K,N`: depth, children per expanded node, nodes verified) against "
             "the chains of the same drafter. Tau ratio = the highest tree tau / the highest chain tau (the tree "
             "named); best = by median speedup over plain; the tree wins wall-clock when its best beats the best "
             "chain.\n",
             "| group | drafter | best chain (tau, speedup) | best tree (tau, speedup) | tau ratio (tree) | tree "
             "wins wall-clock |", "|---|---|---|---|---:|---|"]
    for group in GROUPS:
        s = summaries[group]
        for drafter in sorted({m.method for m in trees}):
            chains = [m for m in methods if m.method == drafter and not m.tree]
            shaped = [m for m in trees if m.method == drafter]
            if not chains:
                continue
            best_chain = max(chains, key=lambda m: _nan_low(s[m.key]["speedup"]))
            best_tree = max(shaped, key=lambda m: _nan_low(s[m.key]["speedup"]))
            deepest = max(shaped, key=lambda m: _nan_low(s[m.key]["tau"]))  # the tree with the highest tau
            ratio = _nan_low(s[deepest.key]["tau"]) / max(_nan_low(s[m.key]["tau"]) for m in chains)
            wins = s[best_tree.key]["speedup"] > s[best_chain.key]["speedup"]
            lines.append(
                f"| {group} | {drafter} | {best_chain.name} ({fmt(s[best_chain.key]['tau'], '.2f')}, "
                f"{fmt(s[best_chain.key]['speedup'], '.2f', 'x')}) | {best_tree.name} "
                f"({fmt(s[best_tree.key]['tau'], '.2f')}, {fmt(s[best_tree.key]['speedup'], '.2f', 'x')}) "
                f"| {ratio:.2f}x ({deepest.tree}) | {'yes' if wins else 'no'} |")
    lines.append("")
    nodes = [n for n in args.tree_cost_nodes if f"tree T={n + 1}" in costs]
    if nodes:
        base = costs["T=1"]
        lines.append("Cost of a tree verify, T = 1 + N tokens under the ancestor mask (a 4-ary tree; the shape "
                     "does not change the cost), next to a causal forward of the same T, relative to T = 1, cache "
                     f"{args.cost_capacity}/{args.cost_length}:\n")
        lines.append("| N | T | tree verify ms | tree / cost(1) | causal ms | causal / cost(1) |")
        lines.append("|---:|---:|---:|---:|---:|---:|")
        for n in nodes:
            tree_cost, causal = costs[f"tree T={n + 1}"], costs[f"causal T={n + 1}"]
            lines.append(f"| {n} | {n + 1} | {1e3 * tree_cost:.1f} | {tree_cost / base:.2f} | {1e3 * causal:.1f} "
                         f"| {causal / base:.2f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def acceptance_report(records: list[dict], methods: list[Method], costs: dict, args) -> str:
    """Where drafts die: the fraction of rounds whose draft position i was accepted (mean over
    prompts), per speculative method; then what a head step costs next to a target step."""
    spec = [m for m in methods if m.method not in ("plain", "hf")]
    depth = max((m.k for m in spec), default=0)
    if not depth:
        return ""
    lines = ["### Acceptance per draft position (greedy, all groups)\n",
             "Of the rounds that proposed draft i, the fraction in which it was accepted (which needs drafts "
             "1..i-1 accepted too), mean over prompts; a head proposes k drafts every round, so its tau is about "
             "1 + the row's sum.\n",
             "| method | tau (median) | " + " | ".join(f"pos {i + 1}" for i in range(depth)) + " |",
             "|---|---:|" + "---:|" * depth]
    for m in spec:
        rows = [r[m.key] for r in records if m.key in r]
        by_position = np.nanmean([np.asarray(r["by_position"], float)[: m.k] for r in rows], axis=0)
        cells = [fmt(float(v), ".2f") for v in by_position] + ["-"] * (depth - m.k)
        lines.append(f"| {m.name} | {fmt(median(r['tau'] for r in rows), '.2f')} | " + " | ".join(cells) + " |")
    lines.append("")
    head_costs = {name: costs[f"short head {name}"] for name in ("eagle3", "mtp") if f"short head {name}" in costs}
    if head_costs:
        base = costs["short T=1"]
        parts = [f"{'EAGLE-3' if name == 'eagle3' else 'MTP'} {1e3 * c:.2f} ms = {c / base:.2f}x"
                 for name, c in head_costs.items()]
        verify = ", ".join(f"T={k + 1} {costs[f'short T={k + 1}'] / base:.2f}x" for k in sorted(
            {m.k for m in spec if m.draft}) if f"short T={k + 1}" in costs)
        lines.append(f"One head draft step (T = 1, {SHORT_CACHE[0]}/{SHORT_CACHE[1]} cache): " + "; ".join(parts)
                     + f" of a target step ({1e3 * base:.1f} ms). A round of k head drafts costs about k head "
                     f"steps plus a verification at T = k + 1 ({verify} of a target step), so tau must exceed "
                     "that sum to win.\n")
    return "\n".join(lines) + "\n"


def sampling_report(args, sampled: list[dict], with_hf: bool) -> str:
    """One table per temperature: per group, each method's tau and speedup over plain sampling."""
    methods = [m for m in args.sample_methods if m.method != "plain"]
    lines = ["### Sampling (temperature > 0)\n",
             f"The same loop at temperature {', '.join(str(t) for t in args.temperatures)} (no top-k/top-p), on the "
             f"first {args.sampled_prompts} prompt(s) of each group, seeded per question; verification is lossless "
             "rejection sampling (tests/test_spec_sampling.py proves the distribution). Prompt lookup's drafts are "
             "point masses; layer-skip draws its drafts from its own distribution (`draft_sampling='sample'`). "
             "HF: `do_sample=True` plain and with `prompt_lookup_num_tokens`, on the first "
             f"{args.hf_prompts} prompt(s) of each group. Speedups are medians of per-prompt ratios to the same "
             "engine's plain sampling.\n"]
    for temperature in args.temperatures:
        rows = [r for r in sampled if r["temperature"] == temperature]
        lines.append(f"Temperature {temperature}:\n")
        head = ["group", "plain tok/s"] + [cell for m in methods for cell in (f"{m.name}: tau", "speedup")]
        if with_hf:
            head += ["HF plain tok/s", f"HF prompt lookup k={args.hf_k} speedup"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|---" + "|---:" * (len(head) - 1) + "|")
        for group in (*GROUPS, "all"):
            chunk = [r for r in rows if group in ("all", r["group"])]
            cells = [group, fmt(median(r["plain"]["tps"] for r in chunk), ".1f")]
            for m in methods:
                cells.append(fmt(median(r[m.key]["tau"] for r in chunk), ".2f"))
                cells.append(fmt(median(r[m.key]["tps"] / r["plain"]["tps"] for r in chunk), ".2f", "x"))
            if with_hf:
                hf_rows = [r for r in chunk if "hf" in r]
                cells.append(fmt(median(r["hf"]["tps"] for r in hf_rows), ".1f") if hf_rows else "-")
                cells.append(fmt(median(r["hf-pld"]["tps"] / r["hf"]["tps"] for r in hf_rows), ".2f", "x")
                             if hf_rows else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _reading(summaries, methods, hf_methods, costs, args) -> str:
    """A few plain sentences on what the numbers say, against the issue's aims."""
    lookups = [m for m in methods if m.method == "ngram"]
    best = {g: max(lookups, key=lambda m: _nan_low(summaries[g][m.key]["speedup"])) for g in GROUPS} if lookups else {}
    out = []
    if "summarization" in best:
        m = best["summarization"]
        s = summaries["summarization"][m.key]
        out.append(f"Aim 1, prompt lookup >= 2x plain on summarization: best is {m.name} at "
                   f"{fmt(s['speedup'], '.2f', 'x')} (tau {fmt(s['tau'], '.2f')}) — "
                   + ("met." if s["speedup"] >= 2 else "not met."))
    if any(h.key == "hf-pld" for h in hf_methods) and f"ngram-{args.hf_k}" in summaries[GROUPS[0]]:
        above = []
        for g in GROUPS:
            ours = summaries[g][f"ngram-{args.hf_k}"]["speedup_hf_prompts"]
            theirs = summaries[g]["hf-pld"]["speedup"]
            above.append(f"{g} {fmt(ours, '.2f', 'x')} vs {fmt(theirs, '.2f', 'x')}")
        out.append(f"Aim 2, jaxspec's speedup above HF's (prompt lookup k = {args.hf_k}, each over its own plain, "
                   "on the same prompts): " + "; ".join(above) + ".")
    if "eagle3-4" in summaries["mt_bench"]:
        s = summaries["mt_bench"]["eagle3-4"]
        best = max((m for m in methods if m.draft == "eagle3"), key=lambda m: _nan_low(summaries["mt_bench"][m.key]["speedup"]))
        out.append(f"Aim (trained head), EAGLE-3 on the MT-bench categories: tau {fmt(s['tau'], '.2f')} at k = 4 "
                   f"(aim >= 3.0: {'met' if s['tau'] >= 3.0 else 'not met'}); best wall-clock speedup "
                   f"{fmt(summaries['mt_bench'][best.key]['speedup'], '.2f', 'x')} with {best.name} (aim >= 1.5x: "
                   f"{'met' if summaries['mt_bench'][best.key]['speedup'] >= 1.5 else 'not met'}).")

    def ratios(prefix):
        return ", ".join(f"T={t} {costs[f'{prefix}T={t}'] / costs[f'{prefix}T=1']:.2f}x"
                         for t in (2, 3, 5, 9) if f"{prefix}T={t}" in costs)

    out.append(f"The bound: on this CPU a forward at T tokens costs {ratios('')} the T = 1 one with the "
               f"{args.cost_capacity}/{args.cost_length} cache, and {ratios('short ')} with the "
               f"{SHORT_CACHE[0]}/{SHORT_CACHE[1]} one; a round must commit at least that many tokens (tau) "
               "to break even, before any drafting cost.")
    return "\n\n".join(out) + "\n"


def _nan_low(value: float) -> float:
    return -math.inf if math.isnan(value) else value


def write_section(path: pathlib.Path, section: str, weight_format: str, tag: str | None = None,
                  model: str = DEFAULT_MODEL) -> None:
    """Replace this script's section of RESULTS.md for `model`, `weight_format` and `tag`, keep the rest."""
    replace_section(path, section_title(weight_format, tag, model), section)


def plot(path: pathlib.Path, summaries, methods, hf_methods, costs, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [m for m in methods if m.method != "plain"] + [m for m in hf_methods if m.key != "hf"]
    fig, (ax, ax_cost) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2.3, 1]})
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(GROUPS))
    top = 4.0  # a bar past this (a timing outlier) is clipped and labelled, so the rest stay readable
    for i, m in enumerate(series):
        values = [summaries[g][m.key]["speedup"] for g in GROUPS]
        at = x + (i - (len(series) - 1) / 2) * width
        ax.bar(at, [min(v, top) for v in values], width, label=m.name,
               hatch="//" if m.method == "hf" else None, edgecolor="black", linewidth=0.4)
        for xi, v in zip(at, values):
            if v > top:
                ax.annotate(f"{v:.1f}x", (xi, top), ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, min(top * 1.08, max([1.2] + [summaries[g][m.key]["speedup"] * 1.1 for g in GROUPS
                                                  for m in series if not math.isnan(summaries[g][m.key]["speedup"])])))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, GROUPS, rotation=15)
    ax.set_ylabel("speedup over plain (decode tok/s)")
    ax.set_title(f"{MODELS[args.model].short}, {args.max_new_tokens} greedy tokens, CPU (2 cores)")
    ax.legend(fontsize=8, ncol=2)
    ts = list(range(1, args.cost_max_t + 1))
    ratio = [costs[f"T={t}"] / costs["T=1"] for t in ts]
    short_ts = [t for t in ts if f"short T={t}" in costs]
    short = [costs[f"short T={t}"] / costs["short T=1"] for t in short_ts]
    ax_cost.plot(ts, ratio, "o-", label=f"cache {args.cost_capacity}, {args.cost_length} in use")
    ax_cost.plot(short_ts, short, "s--", label=f"cache {SHORT_CACHE[0]}, {SHORT_CACHE[1]} in use")
    ax_cost.plot(ts, ts, ":", color="gray", label="T (no reuse of weight reads)")
    ax_cost.plot(ts, [1] * len(ts), "--", color="gray", label="1 (memory-bound ideal)")
    ax_cost.set_xlabel("T tokens per target forward (k + 1)")
    ax_cost.set_ylabel("relative cost = break-even tau")
    ax_cost.set_title("One target forward vs T")
    ax_cost.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS),
                        help=f"the target (default {DEFAULT_MODEL}); each has its own RESULTS.md section and figure")
    parser.add_argument("--questions", type=pathlib.Path, default=DEFAULT_QUESTIONS,
                        help=f"Spec-Bench question.jsonl (default: {DEFAULT_QUESTIONS})")
    parser.add_argument("--quick", action="store_true",
                        help="2 prompts per group (HF on 1), k = 4 only, fewer exit layers and timing calls")
    parser.add_argument("--prompts", type=int, help="prompts per group (default 4; --quick 2)")
    parser.add_argument("--hf-prompts", type=int, help="of those, how many HF runs on (default 2; --quick 1)")
    parser.add_argument("--k", type=int, nargs="+", help="prompt-lookup draft lengths (default 2 4 8; --quick 4)")
    parser.add_argument("--hf-k", type=int, default=4, help="HF prompt_lookup_num_tokens (default 4)")
    parser.add_argument("--exit-layers", type=int, nargs="+",
                        help="layer-skip sweep (default 8 12 16 20, gemma3-270m 12 15 17; --quick the 1st and 3rd)")
    parser.add_argument("--layer-skip-k", type=int, nargs="+", help="layer-skip k sweep (default 1 2 4)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--cost-capacity", type=int, default=1024)
    parser.add_argument("--cost-length", type=int, default=300)
    parser.add_argument("--cost-max-t", type=int, help="largest T of the cost curve (default 9; --quick 5)")
    parser.add_argument("--cost-calls", type=int, help="timed calls per T (default 20; --quick 10)")
    parser.add_argument("--temperatures", type=float, nargs="*", default=[0.7, 1.0],
                        help="sampled rows at these temperatures (default 0.7 1.0; none: greedy only)")
    parser.add_argument("--sampled-prompts", type=int, help="prompts per group for the sampled rows (default 2; --quick 1)")
    parser.add_argument("--eagle3", default=None,
                        help='an EAGLE-3 head for the target (name or directory; "none" to skip; default '
                             '"eagle3-smollm2-135m" for the default model, none for a model without one)')
    parser.add_argument("--eagle3-k", type=int, nargs="+", default=[2, 4, 6], help="EAGLE-3 draft lengths")
    parser.add_argument("--mtp", default=None, help="an MTP head directory written by train-head --method mtp")
    parser.add_argument("--mtp-k", type=int, nargs="+", default=[2], help="MTP draft lengths")
    parser.add_argument("--sampled-head-k", type=int, default=4, help="the heads' k in the sampled rows")
    parser.add_argument("--trees", nargs="*", default=["3,4,8", "4,8,16", "5,8,32"],
                        help="draft-tree shapes D,K,N for the heads (none: chains only)")
    parser.add_argument("--ngram-trees", nargs="*", default=["4,3,12"], help="draft-tree shapes for prompt lookup")
    parser.add_argument("--tree-cost-nodes", type=int, nargs="*", default=[4, 8, 16, 32, 64],
                        help="tree sizes N whose verify (T = 1 + N) is timed")
    parser.add_argument("--no-hf", action="store_true", help="jaxspec only")
    parser.add_argument("--weight-format", default="f32", choices=("f32", "bf16", "int8", "q4"),
                        help="the target's weights (heads follow); each format has its own RESULTS.md section")
    parser.add_argument("--no-layer-skip", action="store_true")
    parser.add_argument("--section", default=None,
                        help="a tag for a focused run's own RESULTS.md section (e.g. 'trees'), kept beside the full run's")
    parser.add_argument("--plot", type=pathlib.Path, default=None,
                        help="the figure (default bench/spec_speedup.png; spec_speedup_FORMAT.png for int8, bf16; "
                             "spec_speedup_gemma3-270m.png for gemma3-270m)")
    parser.add_argument("--no-plot", action="store_true", help="write RESULTS.md but no figure")
    add_output_options(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    settings = MODELS[args.model]
    if args.eagle3 is None:
        args.eagle3 = settings.eagle3
    quick = args.quick
    args.prompts = args.prompts or (2 if quick else 4)
    args.hf_prompts = min(args.prompts, args.hf_prompts if args.hf_prompts is not None else (1 if quick else 2))
    if args.no_hf:
        args.hf_prompts = 0
    args.k = args.k or ([4] if quick else [2, 4, 8])
    args.exit_layers = args.exit_layers or list(settings.exit_layers[::2] if quick else settings.exit_layers)
    args.layer_skip_k = args.layer_skip_k or ([1, 2] if quick else [1, 2, 4])
    args.cost_calls = args.cost_calls or (10 if quick else 20)
    args.sampled_prompts = min(args.prompts, args.sampled_prompts if args.sampled_prompts is not None else (1 if quick else 2))
    args.cost_max_t = args.cost_max_t or (5 if quick else 9)
    if not args.no_layer_skip:
        need = max(args.layer_skip_k) + 1
        args.cost_max_t = max(args.cost_max_t, need)
    if args.eagle3.lower() != "none":
        args.cost_max_t = max(args.cost_max_t, max(args.eagle3_k) + 1)
    if args.no_plot:
        args.plot = None
    elif args.plot is None:
        suffix = ("" if args.weight_format == "f32" else f"_{args.weight_format}") + (
            f"_{args.section}" if args.section else "")
        stem = pathlib.Path(settings.plot).stem
        args.plot = DEFAULT_PLOT.with_name(f"{stem}{suffix}.png")
    began = time.perf_counter()

    import jaxspec
    from jaxspec import checkpoints

    picked = pick_prompts(args.questions, args.prompts)
    model = jaxspec.load(args.model, weight_format=args.weight_format)
    cfg = args.model_config = model.config
    heads = {}
    if args.eagle3 and args.eagle3.lower() != "none":
        heads["eagle3"] = jaxspec.load(args.eagle3)
    if args.mtp:
        heads["mtp"] = jaxspec.load(args.mtp)
    head_ks = {"eagle3": args.eagle3_k, "mtp": args.mtp_k}
    timing_stop = model.tokenizer.hf_tokenizer.token_to_id(settings.timing_stop)
    assert timing_stop is not None, f"{settings.timing_stop!r} is not a token of {args.model}"
    chat = settings.chat
    compile_total = 0.0

    # 1. Forward cost at T = 1..max_t with the brief's cache (capacity 1024 holding 300 tokens);
    # at a few T with the cache the short prompts run with (256 holding 100), which the
    # layer-skip choice uses, with the drafts' T = 1, 2 costs at the lowest and highest exit
    # layers (a draft's cost is linear in its layer count: interpolated between).
    start = time.perf_counter()
    ts = range(1, args.cost_max_t + 1)
    costs = forward_costs({f"T={t}": (model.params, cfg, t) for t in ts}, args.cost_capacity,
                          args.cost_length, args.cost_calls)
    short_ts = sorted({t for t in (1, 2, 3, 5, 9) if t <= args.cost_max_t}
                      | {k + 1 for name in heads for k in head_ks[name]}
                      | ({k + 1 for k in args.layer_skip_k} if not args.no_layer_skip else set()))
    short = {f"T={t}": (model.params, cfg, t) for t in short_ts}
    measured_exits = sorted({min(args.exit_layers), max(args.exit_layers)})
    if not args.no_layer_skip:
        for e in measured_exits:
            draft = jaxspec.layer_skip(model, e)
            for t in (1, 2):
                short[f"e={e},T={t}"] = (draft.params, draft.config, t)
    short_costs = forward_costs(short, SHORT_CACHE[0], SHORT_CACHE[1], args.cost_calls)
    if args.tree_cost_nodes:  # a tree verify against a causal forward of the same T
        tree_variants = {}
        for n in args.tree_cost_nodes:
            tree_variants[f"tree T={n + 1}"] = (model.params, cfg, n + 1, heap_tree(n))
            tree_variants[f"causal T={n + 1}"] = (model.params, cfg, n + 1)
        costs.update(forward_costs(tree_variants, args.cost_capacity, args.cost_length, args.cost_calls))
    costs.update({f"short {name}": value for name, value in short_costs.items()})
    if not args.no_layer_skip:
        low, high = measured_exits[0], measured_exits[-1]
        for e in args.exit_layers:
            for t in (1, 2):
                a, b = costs[f"short e={low},T={t}"], costs[f"short e={high},T={t}"]
                costs[f"short e={e},T={t}"] = a if high == low else a + (b - a) * (e - low) / (high - low)
    for name, head in heads.items():  # one head step (T = 1) with the short prompts' cache
        costs[f"short head {name}"] = head_step_cost(model, head, SHORT_CACHE[0], SHORT_CACHE[1], args.cost_calls)
    print(f"forward cost ({time.perf_counter() - start:.0f} s): "
          + ", ".join(f"T={t} {costs[f'T={t}'] / costs['T=1']:.2f}x" for t in ts)
          + f" (T=1 {1e3 * costs['T=1']:.1f} ms); cache {SHORT_CACHE}: "
          + ", ".join(f"T={t} {costs[f'short T={t}'] / costs['short T=1']:.2f}x" for t in short_ts)
          + f" (T=1 {1e3 * costs['short T=1']:.1f} ms)", flush=True)

    # 2. Layer-skip: pick exit layer and k on two prompts by replayed tau and measured costs.
    sweep, chosen = None, None
    if not args.no_layer_skip:
        sweep_prompts = [picked["qa"][0], picked["mt_bench"][0]]
        sweep = dict(prompts=[p.question_id for p in sweep_prompts], exits=args.exit_layers, ks=args.layer_skip_k,
                     tau={}, predicted={}, draft_cost={})
        rounds = {(e, k): 0 for e in args.exit_layers for k in args.layer_skip_k}
        decode_tokens = 0
        for p in sweep_prompts:
            plain = run_jaxspec(model, p, Method("plain", "plain", "plain"), args.max_new_tokens, timing_stop,
                                chat=chat)
            compile_total += plain["compile_s"]
            ids = encode(model.tokenizer, p.text, chat)
            predictions = early_exit_argmax(model, ids + plain["tokens"], tuple(args.exit_layers))
            decode_tokens += len(plain["tokens"]) - 1
            for (e, k) in rounds:
                rounds[(e, k)] += replay_rounds(predictions[e], len(ids), plain["tokens"], k)
        for (e, k), n in rounds.items():
            tau = decode_tokens / n
            draft_round = costs[f"short e={e},T=2"] + (k - 1) * costs[f"short e={e},T=1"]
            sweep["tau"][(e, k)] = tau
            sweep["predicted"][(e, k)] = tau * costs["short T=1"] / (draft_round + costs[f"short T={k + 1}"])
        for e in args.exit_layers:
            sweep["draft_cost"][e] = costs[f"short e={e},T=1"] / costs["short T=1"]
        chosen = max(sweep["predicted"], key=sweep["predicted"].get)
        print("layer-skip sweep: " + ", ".join(f"e={e} k={k}: tau {sweep['tau'][(e, k)]:.2f} predicted "
                                              f"{sweep['predicted'][(e, k)]:.2f}x" for e, k in sweep["tau"])
              + f" -> exit layer {chosen[0]}, k={chosen[1]}", flush=True)

    methods = [Method("plain", "plain", "plain")]
    head_names = {"eagle3": "EAGLE-3", "mtp": "MTP"}
    methods += [Method(f"{head_names[name]} k={k}", f"{name}-{k}", name, k, draft=name)
                for name in heads for k in head_ks[name]]
    methods += [Method(f"{head_names[name]} tree {shape}", f"{name}-tree-{shape}", name, int(shape.split(",")[0]),
                       draft=name, tree=shape) for name in heads for shape in args.trees]
    methods += [Method(f"prompt lookup k={k}", f"ngram-{k}", "ngram", k) for k in args.k]
    methods += [Method(f"prompt lookup tree {shape}", f"ngram-tree-{shape}", "ngram", int(shape.split(",")[0]),
                       tree=shape) for shape in args.ngram_trees]
    if chosen:
        methods.append(Method(f"layer-skip e={chosen[0]} k={chosen[1]}", "layer_skip", "layer_skip", chosen[1],
                              chosen[0]))
    hf_methods = []
    hf = None
    if args.hf_prompts:
        hf = HF(checkpoints.resolve_model(args.model))
        hf.generate([1, 2, 3], 4)  # warm-up
        hf_methods = [Method("HF plain", "hf", "hf"),
                      Method(f"HF prompt lookup k={args.hf_k}", "hf-pld", "hf", args.hf_k)]

    # 3. Main run: per prompt, every method back to back.
    records, mismatches, incomplete = [], [], []
    total = sum(len(v) for v in picked.values())
    done = 0
    for group in GROUPS:
        for index, p in enumerate(picked[group]):
            ids = encode(model.tokenizer, p.text, chat)
            record = {"group": group, "qid": p.question_id, "prompt_tokens": len(ids)}
            for m in methods:
                r = run_jaxspec(model, p, m, args.max_new_tokens, timing_stop, heads=heads, chat=chat)
                compile_total += r["compile_s"]
                if not r["complete"]:
                    incomplete.append(f"{m.key} #{p.question_id}")
                if m.method != "plain":
                    diff = first_difference(r["tokens"], record["plain"]["tokens"])
                    r["exact"] = diff is None
                    if diff is not None:
                        mismatches.append((m.key, p.question_id, diff))
                        print(f"  MISMATCH {m.key} on #{p.question_id}: first difference at token {diff}", flush=True)
                record[m.key] = r
            if hf is not None and index < args.hf_prompts:
                record["hf"] = hf.generate(ids, args.max_new_tokens)
                record["hf-pld"] = hf.generate(ids, args.max_new_tokens, lookup=args.hf_k)
                record["hf-pld"]["exact"] = record["hf-pld"]["tokens"] == record["hf"]["tokens"]
            records.append(record)
            done += 1
            print(f"[{done}/{total}] {group:<14} #{p.question_id:<4} {len(ids):>5} tok  "
                  + "  ".join(f"{m.key} {record[m.key]['tps']:.1f}"
                              + (f" ({record[m.key]['tps'] / record['plain']['tps']:.2f}x, tau {record[m.key]['tau']:.2f})"
                                 if m.method != "plain" else "")
                              for m in methods)
                  + ("  " + "  ".join(f"{m.key} {record[m.key]['tps']:.1f}" for m in hf_methods)
                     if "hf" in record else "")
                  + f"  [{(time.perf_counter() - began) / 60:.1f} min]", flush=True)

    # 4. Sampling: plain vs the proposers at each temperature on the first `--sampled-prompts` of
    # each group (the same back-to-back order; drafts drawn from the draft's own distribution for
    # layer-skip, prompt lookup's are point masses), HF plain and HF prompt lookup beside them.
    sampled = []
    if args.temperatures and args.sampled_prompts:
        sample_methods = [Method("plain", "plain", "plain")]
        sample_methods += [Method(f"{head_names[name]} k={args.sampled_head_k}", f"{name}-{args.sampled_head_k}", name,
                                  args.sampled_head_k, draft=name) for name in heads]
        sample_methods += [Method(f"prompt lookup k={args.hf_k}", f"ngram-{args.hf_k}", "ngram", args.hf_k)]
        if chosen:
            sample_methods.append(Method(f"layer-skip e={chosen[0]} k={chosen[1]}", "layer_skip", "layer_skip",
                                         chosen[1], chosen[0]))
        for temperature in args.temperatures:
            for group in GROUPS:
                for index, p in enumerate(picked[group][: args.sampled_prompts]):
                    ids = encode(model.tokenizer, p.text, chat)
                    record = {"group": group, "qid": p.question_id, "temperature": temperature}
                    for m in sample_methods:
                        r = run_jaxspec(model, p, m, args.max_new_tokens, timing_stop, temperature=temperature,
                                        seed=p.question_id, heads=heads, chat=chat)
                        compile_total += r["compile_s"]
                        record[m.key] = r
                    if hf is not None and index < args.hf_prompts:
                        record["hf"] = hf.generate(ids, args.max_new_tokens, temperature=temperature, seed=p.question_id)
                        record["hf-pld"] = hf.generate(ids, args.max_new_tokens, lookup=args.hf_k,
                                                       temperature=temperature, seed=p.question_id)
                    sampled.append(record)
                    print(f"[t={temperature}] {group:<14} #{p.question_id:<4} "
                          + "  ".join(f"{m.key} {record[m.key]['tps']:.1f}"
                                      + (f" ({record[m.key]['tps'] / record['plain']['tps']:.2f}x, "
                                         f"tau {record[m.key]['tau']:.2f})" if m.method != "plain" else "")
                                      for m in sample_methods)
                          + ("  " + "  ".join(f"{key} {record[key]['tps']:.1f}" for key in ("hf", "hf-pld"))
                             if "hf" in record else "")
                          + f"  [{(time.perf_counter() - began) / 60:.1f} min]", flush=True)
        args.sample_methods = sample_methods

    if sweep and chosen:
        swept = [r for r in records if r["qid"] in sweep["prompts"] and "layer_skip" in r]
        sweep["measured_tau"] = median(r["layer_skip"]["tau"] for r in swept)
        sweep["measured_speedup"] = median(r["layer_skip"]["tps"] / r["plain"]["tps"] for r in swept)
    summaries = {}
    for group in GROUPS:
        group_records = [r for r in records if r["group"] == group]
        hf_ids = {p.question_id for p in picked[group][: args.hf_prompts]}
        summaries[group] = group_summary(group_records, methods + hf_methods, hf_ids)
    report = build_report(args, picked, methods, hf_methods, records, summaries, costs, sweep, chosen,
                          mismatches, incomplete, time.perf_counter() - began, compile_total,
                          sampling_report(args, sampled, bool(hf_methods)) if sampled else "")
    print()
    print(report)
    if args.plot is not None and args.plot != DEFAULT_PLOT:  # its own figure beside the full f32 run's
        report = report.replace("bench/spec_speedup.png", f"bench/{args.plot.name}")
    if not args.no_write:
        write_section(args.results, report, args.weight_format, args.section, args.model)
        if args.plot is not None:
            plot(args.plot, summaries, methods, hf_methods, costs, args)
        print(f"wrote {args.results}" + (f" and {args.plot}" if args.plot is not None else ""))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
