"""Plain (non-speculative) greedy decoding: jaxspec vs transformers, and the memory roofline.

    . .venv/bin/activate && python bench/decode.py

Default model (SmolLM2-135M-Instruct Q4_1 GGUF, dequantized to float32), batch 1, 128 greedy
tokens (`ignore_eos=True`) on 5 Spec-Bench prompts from different categories, chat template on.
Peers: transformers `generate` on the same GGUF in float32 (the reference for token equality)
and in bfloat16, both greedy, exactly 128 tokens with EOS treated as an ordinary token. Engines
run interleaved (prompt by prompt, side by side) so that drift on a shared machine hits them
alike; every figure is a median. On a loaded machine the run is bounded: no new pass after
--max-seconds, and the bf16 row stops after a call slower than --slow-call. The result table
replaces the `## Plain decoding (bench/decode.py)` section of bench/RESULTS.md (other sections
are kept).

Roofline: one decode step reads every weight once (the whole params pytree: 30 layers plus the
tied embedding as LM head), so tokens/s <= bandwidth / weight bytes. Bandwidth is measured here,
two ways: a 1 GiB float32 `np.copyto` ((read + written bytes) / time) and a jax GEMV `W @ x` with
W float32 [8192, 16384] (W bytes / time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from results_md import peer_versions, replace_section  # bench/ is on sys.path when a bench script runs

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_QUESTIONS = HERE / "data" / "spec_bench" / "question.jsonl"
DEFAULT_RESULTS = HERE / "RESULTS.md"
SECTION = "## Plain decoding (bench/decode.py)"
# One prompt (the first in file order) from each of these categories.
CATEGORIES = ("writing", "coding", "math_reasoning", "translation", "qa")
RERUN = ". .venv/bin/activate && python bench/decode.py"


def pick_prompts(path: pathlib.Path) -> list[tuple[str, int, str]]:
    """(category, question_id, first turn) for the first question of each of CATEGORIES."""
    if not path.is_file():
        sys.exit(f"{path}: no such file; pass --questions PATH to Spec-Bench's question.jsonl")
    found: dict[str, tuple[str, int, str]] = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            q = json.loads(line)
            if q["category"] in CATEGORIES and q["category"] not in found:
                found[q["category"]] = (q["category"], q["question_id"], q["turns"][0])
    missing = [c for c in CATEGORIES if c not in found]
    if missing:
        sys.exit(f"{path}: no question in categories {missing}")
    return [found[c] for c in CATEGORIES]


# ---------------------------------------------------------------------------------------------
# Bandwidth
# ---------------------------------------------------------------------------------------------


def copy_bandwidth(gib: float = 1.0, repeats: int = 5) -> list[float]:
    """Bytes read + written per second by np.copyto of a `gib` GiB float32 array, per call."""
    n = int(gib * 2**30) // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    del src, dst
    return [2 * n * 4 / t for t in times]


def gemv_bandwidth(rows: int = 8192, cols: int = 16384, repeats: int = 8) -> list[float]:
    """W bytes per second read by a jitted float32 `W @ x`, per call."""
    w = jax.random.normal(jax.random.PRNGKey(0), (rows, cols), jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(1), (cols,), jnp.float32)
    gemv = jax.jit(lambda w, x: w @ x)
    jax.block_until_ready(gemv(w, x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(gemv(w, x))
        times.append(time.perf_counter() - start)
    del w, x
    return [rows * cols * 4 / t for t in times]


# ---------------------------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class HF:
    """transformers `generate` on the same GGUF (dequantized by transformers' own code)."""

    def __init__(self, model, name: str):
        import torch

        self.torch, self.model, self.name = torch, model.eval(), name
        # Exactly N tokens, EOS generated like any other token (jaxspec's `ignore_eos`). Not
        # `min_new_tokens`: that masks EOS's logit, so greedy HF would pick the runner-up wherever
        # the model ends its answer, and the tokens would no longer be the model's argmax.
        model.generation_config.eos_token_id = None
        model.config.eos_token_id = None
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def _generate(self, ids: list[int], new_tokens: int) -> tuple[list[int], float]:
        torch = self.torch
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),  # else HF masks pad-id tokens in the prompt
                do_sample=False,
                max_new_tokens=new_tokens,
                pad_token_id=0,
            )
            seconds = time.perf_counter() - start
        return out[0, len(ids):].tolist(), seconds

    def run(self, ids: list[int], new_tokens: int) -> dict:
        _, prefill = self._generate(ids, 1)  # prefill + the first token
        tokens, total = self._generate(ids, new_tokens)
        assert len(tokens) == new_tokens, (self.name, len(tokens))
        return dict(tokens=tokens, e2e=new_tokens / total,
                    decode=(new_tokens - 1) / (total - prefill) if total > prefill else float("nan"),
                    prefill_s=prefill)


def run_jaxspec(model, text: str, new_tokens: int) -> dict:
    import jaxspec

    start = time.perf_counter()
    result = jaxspec.generate(model, None, text, chat=True, max_new_tokens=new_tokens, ignore_eos=True)
    total = time.perf_counter() - start
    stats = result.stats
    assert stats.new_tokens == new_tokens, stats
    return dict(tokens=result.tokens[0], e2e=new_tokens / total, decode=stats.decode_tokens_per_second,
                prefill_s=stats.prefill_seconds, compile_s=stats.compile_seconds)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def median(values) -> float:
    return statistics.median(values)


def build_report(args, prompts, prompt_lengths, runs, weight_bytes, bandwidths, compile_s, load_s,
                 matches, mismatches, machine) -> str:
    copy_bw, gemv_bw = bandwidths
    engines = list(runs)
    jx = runs["jaxspec f32"]
    hf = runs.get("HF transformers f32")
    lines = []
    lines.append(f"{SECTION}\n")
    lines.append(
        f"{datetime.date.today().isoformat()}, jaxspec {machine['commit']}; {platform.machine()}, "
        f"{os.cpu_count()} cores, shared (1-minute load average {machine['load'][0]:.1f} at the start, "
        f"{machine['load'][1]:.1f} at the end; engines interleaved prompt by prompt, medians over "
        f"{len(prompts)} prompts x {machine['passes']} pass(es){_bf16_note(runs, len(prompts))}); "
        f"jax {jax.__version__}, {peer_versions()}. SmolLM2-135M-Instruct Q4_1 GGUF "
        f"dequantized to float32, batch 1, {args.max_new_tokens} greedy tokens (`ignore_eos`), chat "
        f"template, Spec-Bench prompts: "
        + ", ".join(f"{c} #{qid} ({n} tokens)" for (c, qid, _), n in zip(prompts, prompt_lengths))
        + f". Total benchmark run {machine['seconds']:.0f} s.\n")
    lines.append(f"Rerun: `{RERUN}`\n")
    lines.append("| engine | decode tok/s | end-to-end tok/s | decode vs HF f32 | end-to-end vs HF f32 "
                 "| weight MB/token | roofline % (copy BW) | roofline % (GEMV BW) | same tokens as HF f32 |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in engines:
        r = runs[name]
        dec, e2e = median(r["decode"]), median(r["e2e"])
        # Ratios pair each call with the reference's call on the same prompt, same pass.
        ratio_dec = f'{median(a / b for a, b in zip(r["decode"], hf["decode"])):.2f}x' if hf else "-"
        ratio_e2e = f'{median(a / b for a, b in zip(r["e2e"], hf["e2e"])):.2f}x' if hf else "-"
        wb = weight_bytes[name]
        lines.append(
            f"| {name} | {dec:.1f} | {e2e:.1f} | {ratio_dec} | {ratio_e2e} | {wb / 1e6:.0f} "
            f"| {100 * dec / (copy_bw / wb):.0f}% | {100 * dec / (gemv_bw / wb):.0f}% "
            f"| {matches.get(name, '-')} |")
    lines.append("")
    if mismatches:
        lines.append("Token mismatches: " + "; ".join(mismatches) + ".\n")
    wb = weight_bytes["jaxspec f32"]
    lines.append("| bandwidth | GB/s | f32 roofline tok/s (" + f"{wb / 1e6:.0f} MB/token) |")
    lines.append("|---|---:|---:|")
    lines.append(f"| copy: `np.copyto` 1 GiB float32, (read + written) / time | {copy_bw / 1e9:.1f} "
                 f"| {copy_bw / wb:.1f} |")
    lines.append(f"| GEMV: jax `W @ x`, W float32 [8192, 16384], W bytes / time | {gemv_bw / 1e9:.1f} "
                 f"| {gemv_bw / wb:.1f} |")
    lines.append("")
    lines.append("| prompt | tokens | jaxspec decode tok/s | HF f32 decode tok/s | HF f32 end-to-end tok/s "
                 "| jaxspec prefill s | HF f32 prefill s |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    n = len(prompts)
    for i, ((cat, qid, _), plen) in enumerate(zip(prompts, prompt_lengths)):
        def sel(r, key, fmt):  # runs are repeat-major: prompt i is every n-th entry
            return format(median(r[key][i::n]), fmt) if r else "-"

        lines.append(f"| {cat} #{qid} | {plen} | {sel(jx, 'decode', '.1f')} | {sel(hf, 'decode', '.1f')} "
                     f"| {sel(hf, 'e2e', '.1f')} | {sel(jx, 'prefill_s', '.2f')} | {sel(hf, 'prefill_s', '.2f')} |")
    lines.append("")
    jx_dec = median(jx["decode"])
    streamed = jx_dec * wb  # weight bytes per second the decode loop streams
    if streamed >= 0.7 * gemv_bw:
        verdict = ("so it runs close to the rate a bare GEMV streams memory here: memory-bandwidth "
                   "bound")
    else:
        verdict = ("so about {:.0f}% of each step goes to something other than streaming weights at "
                   "the GEMV rate (per-op overheads, attention over the cache, the LM head's argmax)"
                   ).format(100 * (1 - streamed / gemv_bw))
    lines.append(
        "What bounds it: a batch-1 decode step is a chain of matrix-vector products over "
        f"{wb / 1e6:.0f} MB of float32 weights, each read once, so memory bandwidth bounds it. jaxspec "
        f"decodes at {jx_dec:.1f} tok/s = {streamed / 1e9:.1f} GB/s of weights against "
        f"{gemv_bw / 1e9:.1f} GB/s for a bare jax GEMV and {copy_bw / 1e9:.1f} GB/s for a copy, {verdict}. "
        "Going faster needs fewer bytes per token (bf16 or quantized weights with a fast kernel) or "
        "more tokens per weight read (batching, speculation).\n")
    if max(machine["load"]) > 2.5:  # the benchmark alone keeps both cores busy (load ~2)
        lines.append(
            f"Caveat: other jobs were running (load average up to {max(machine['load']):.1f} on "
            f"{os.cpu_count()} cores). torch's OpenMP threads slow down far more than XLA's when a core "
            "is taken away, so the HF rows (and the ratios) are worse than on a quiet machine; "
            "rerun when idle before relying on them.\n")
    return "\n".join(lines)


def _bf16_note(runs, num_prompts: int) -> str:
    done = len(runs.get("HF transformers bf16", {}).get("decode", []))
    if not done:
        return ""
    if done < num_prompts:
        return f", HF bf16 on the first {done} prompt(s) only (slower than --slow-call)"
    return f", HF bf16 {done // num_prompts} pass(es)"


def _commit() -> str:
    """The checked-out commit, marked `+dirty` when jaxspec/ has uncommitted changes."""
    try:
        def git(*a):
            return subprocess.run(["git", *a], cwd=HERE.parent, capture_output=True, text=True,
                                  check=True).stdout.strip()

        dirty = git("status", "--porcelain", "--", "jaxspec")
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "(not a git checkout)"


def write_section(path: pathlib.Path, section: str) -> None:
    """Replace this script's section of RESULTS.md, keep the rest."""
    replace_section(path, SECTION, section)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=pathlib.Path, default=DEFAULT_QUESTIONS,
                        help=f"Spec-Bench question.jsonl (default: {DEFAULT_QUESTIONS})")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts (default 2)")
    parser.add_argument("--bf16-repeats", type=int, default=1,
                        help="passes for the HF bfloat16 row (default 1; 0 skips it)")
    parser.add_argument("--max-seconds", type=float, default=420,
                        help="start no new pass after this many seconds (default 420)")
    parser.add_argument("--slow-call", type=float, default=60,
                        help="drop the HF bf16 row after a call slower than this (default 60 s)")
    parser.add_argument("--no-hf", action="store_true", help="jaxspec and bandwidth only")
    parser.add_argument("--results", type=pathlib.Path, default=DEFAULT_RESULTS)
    parser.add_argument("--no-write", action="store_true", help="print the table, leave RESULTS.md alone")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    load_before = os.getloadavg()

    import jaxspec
    from jaxspec import checkpoints

    prompts = pick_prompts(args.questions)
    # Bandwidth is measured before and after the decoding runs; the median of all samples is used.
    copy_samples, gemv_samples = copy_bandwidth(), gemv_bandwidth()
    print(f"bandwidth: copy {median(copy_samples) / 1e9:.1f} GB/s, GEMV {median(gemv_samples) / 1e9:.1f} GB/s",
          flush=True)

    start = time.perf_counter()
    model = jaxspec.load()
    load_s = time.perf_counter() - start
    weight_bytes = {"jaxspec f32": sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))}
    ids = [model.tokenizer.encode_chat(text) for _, _, text in prompts]
    prompt_lengths = [len(i) for i in ids]

    # Warm up: the first call compiles (reported); one call per distinct prompt bucket so that no
    # timed call compiles.
    compile_s = None
    warmed = set()
    for (_, _, text), n in zip(prompts, prompt_lengths):
        bucket = max(16, 1 << (n - 1).bit_length())
        if bucket not in warmed:
            warmed.add(bucket)
            r = run_jaxspec(model, text, args.max_new_tokens)
            compile_s = r["compile_s"] if compile_s is None else compile_s
    print(f"jaxspec: load {load_s:.1f} s, first-call compile {compile_s:.1f} s", flush=True)

    engines = {"jaxspec f32": lambda i: run_jaxspec(model, prompts[i][2], args.max_new_tokens)}
    if not args.no_hf:
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        path = checkpoints.default_model_path()

        def hf_load(dtype):
            return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)

        hf32 = HF(hf_load(torch.float32), "HF f32")
        engines["HF transformers f32"] = lambda i: hf32.run(ids[i], args.max_new_tokens)
        weight_bytes["HF transformers f32"] = hf32.weight_bytes
        hf32._generate(ids[0], 4)  # warm-up
        if args.bf16_repeats > 0:
            hf16 = HF(hf_load(torch.bfloat16), "HF bf16")  # keeps RoPE buffers float32, unlike .to()
            engines["HF transformers bf16"] = lambda i: hf16.run(ids[i], args.max_new_tokens)
            weight_bytes["HF transformers bf16"] = hf16.weight_bytes
            hf16._generate(ids[0], 4)

    runs = {name: {"decode": [], "e2e": [], "prefill_s": [], "tokens": []} for name in engines}
    # On a loaded machine HF slows down badly; keep the run bounded: a bf16 call slower than
    # --slow-call seconds ends the bf16 row, and no new pass starts after --max-seconds.
    passes, stopped = 0, set()
    for rep in range(args.repeats):
        if rep and time.perf_counter() - began > args.max_seconds:
            print(f"  stopping after {rep} pass(es): over --max-seconds {args.max_seconds:.0f}", flush=True)
            break
        passes += 1
        for i, (cat, qid, _) in enumerate(prompts):
            for name, fn in engines.items():
                if name in stopped or (name == "HF transformers bf16" and rep >= args.bf16_repeats):
                    continue
                call_began = time.perf_counter()
                r = fn(i)
                if name == "HF transformers bf16" and time.perf_counter() - call_began > args.slow_call:
                    stopped.add(name)
                    print(f"  {name}: a call took over --slow-call {args.slow_call:.0f} s; no more of it",
                          flush=True)
                for key in ("decode", "e2e", "prefill_s", "tokens"):
                    runs[name][key].append(r[key])
                print(f"  [{rep + 1}/{args.repeats}] {cat:<15} {name:<22} decode {r['decode']:6.1f} tok/s  "
                      f"end-to-end {r['e2e']:6.1f} tok/s", flush=True)

    copy_samples += copy_bandwidth()
    gemv_samples += gemv_bandwidth()
    bandwidths = (median(copy_samples), median(gemv_samples))
    print(f"bandwidth (all samples): copy {bandwidths[0] / 1e9:.1f} GB/s "
          f"[{min(copy_samples) / 1e9:.1f}-{max(copy_samples) / 1e9:.1f}], GEMV {bandwidths[1] / 1e9:.1f} GB/s "
          f"[{min(gemv_samples) / 1e9:.1f}-{max(gemv_samples) / 1e9:.1f}]", flush=True)

    # Same tokens? Compare each engine with HF f32 (the reference), first repeat; jaxspec must also
    # agree with itself across repeats.
    n = len(prompts)
    jx_tokens = runs["jaxspec f32"]["tokens"]
    for k in range(n, len(jx_tokens)):
        assert jx_tokens[k] == jx_tokens[k % n], f"jaxspec not deterministic on prompt {k % n}"
    matches, mismatches = {}, []
    if "HF transformers f32" in runs:
        reference = runs["HF transformers f32"]["tokens"][:n]
        for name in runs:
            if name == "HF transformers f32":
                continue
            same = 0
            for i, (ours, ref) in enumerate(zip(runs[name]["tokens"][:n], reference)):
                diff = first_difference(ours, ref)
                if diff is None:
                    same += 1
                else:
                    note = (f"{name} vs HF f32 on {prompts[i][0]} #{prompts[i][1]}: first difference at "
                            f"token {diff} ({ours[diff] if diff < len(ours) else None} vs "
                            f"{ref[diff] if diff < len(ref) else None})")
                    mismatches.append(note)
                    print("  " + note)
            matches[name] = f"{same}/{min(n, len(runs[name]['tokens']))}"
        print(f"identical greedy tokens vs HF f32: {matches}")

    machine = dict(load=(load_before[0], os.getloadavg()[0]), commit=_commit(),
                   seconds=time.perf_counter() - began, passes=passes)
    report = build_report(args, prompts, prompt_lengths, runs, weight_bytes, bandwidths, compile_s, load_s,
                          matches, mismatches, machine)
    print()
    print(report)
    if not args.no_write:
        write_section(args.results, report)
        print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
