"""Plain greedy decoding: jaxspec per weight format vs transformers and llama.cpp, and the roofline.

    . .venv/bin/activate && python bench/decode.py
    . .venv/bin/activate && python bench/decode.py --max-new-tokens 8 --repeats 1 --no-write   # plumbing
    . .venv/bin/activate && python bench/decode.py --model gemma3-270m --bf16-repeats 0   # Gemma-3-270M

Default model (SmolLM2-135M-Instruct Q4_1 GGUF; `--model` picks another of MODELS, e.g. gemma3-270m:
Gemma-3-270M, the pretrained base model, Q4_K_M GGUF, fed plain prompts without its chat
template), batch 1, 128 greedy tokens (`ignore_eos=True`) on 5 Spec-Bench prompts from different
categories, chat template on (for the default model). Engines:
- jaxspec in each of `--formats` (default f32,f32/xla,int8,int8/xla,bf16), each loaded with
  `jaxspec.load(weight_format=..., products=...)`: the GGUF dequantized to float32, then kept as
  float32, converted to bfloat16, or quantized to int8 per row (W8A8 products on CPU), its
  products computed by the native CPU kernels (the default where they build) or by XLA (`/xla`).
  The first bf16 / int8 load converts and caches; later ones restore. Each row's tokens are
  compared with the first float32 row's: the first token index where they differ, per prompt.
- transformers `generate` on the same GGUF in float32 (the reference for token equality) and in
  bfloat16, both greedy, exactly 128 tokens with EOS treated as an ordinary token (`--no-hf`
  skips both).
- llama.cpp through llama-cpp-python (`--no-llama-cpp` skips it) on the same GGUF file, its
  weights as stored (Q4_1, the embedding Q8_0), `n_threads=2` (`--llama-threads`), fed the
  same chat-templated token ids as jaxspec (`Llama.generate`), so prompt lengths match. Greedy
  (`temp=0, top_k=1`) with EOS suppressed by the processor `logit_bias={token_eos: -1000}`
  installs, so it always decodes exactly N tokens; where the model's argmax is EOS, llama.cpp's
  tokens differ from jaxspec's from there on (the speed does not). Its decode time is timed like HF's: wall time
  of an N-token call minus a 1-token call (prefill + first token), each from an empty cache
  (`Llama.reset()`, no prefix reuse), over N - 1 tokens.
Engines run interleaved (prompt by prompt, side by side) so that drift on a shared machine hits
them alike; every figure is a median. On a loaded machine the run is bounded: no new pass after
--max-seconds, and each bf16 row (jaxspec's and HF's: XLA CPU and torch have no fast bf16
product here) runs --bf16-repeats passes and stops after a call slower than --slow-call. The
result table replaces the model's own section of bench/RESULTS.md, `## Plain decoding
(bench/decode.py)` for the default model and e.g. `## Gemma-3-270M: plain decoding
(bench/decode.py --model gemma3-270m)` for Gemma (other sections are kept).

llama-cpp-python is optional (`pip install -e '.[bench]'`). Its default build targets the build
machine's own CPU and segfaults on this one; build it portable:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF" pip install llama-cpp-python==0.3.36

It is loaded with `verbose=True` (verbose=False crashed on this machine), so its load log goes
to stderr. Its threads wait for each other at every op by spinning (OpenMP): when other jobs
take a core, n_threads=2 collapses (seconds per token seen here at load average 3); run the
benchmark on a quiet machine, or set OMP_WAIT_POLICY=passive (the header records it).

Roofline: one decode step reads every weight once (the whole params pytree: every layer plus the
tied embedding as LM head; for Gemma-3-270M the 262,144-token embedding is most of it), so tokens/s <= bandwidth / weight bytes, per engine in its own
format (llama.cpp: the GGUF's tensor bytes). Bandwidth is measured here, two ways: a 1 GiB
float32 `np.copyto` ((read + written bytes) / time) and a jax GEMV `W @ x` with W float32
[8192, 16384] (W bytes / time).
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import subprocess
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from results_md import add_output_options, isa_heading, load_variant, peer_versions, replace_section, run_stamp, weight_formats  # bench/ is on sys.path when a bench script runs

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_QUESTIONS = HERE / "data" / "spec_bench" / "question.jsonl"
SECTION = "## Plain decoding (bench/decode.py)"


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """What the benchmark needs to know about one model `--model` names."""

    title: str  # the model and its file, in the report's header
    chat: bool  # prompts through the tokenizer's chat template (an instruction-tuned model) or plain
    section: str  # its own RESULTS.md section


DEFAULT_MODEL = "smollm2-135m"
MODELS = {
    DEFAULT_MODEL: ModelSettings("SmolLM2-135M-Instruct Q4_1 GGUF", chat=True, section=SECTION),
    "gemma3-270m": ModelSettings(
        "Gemma-3-270M (the pretrained base model, not instruction-tuned) Q4_K_M GGUF", chat=False,
        section="## Gemma-3-270M: plain decoding (bench/decode.py --model gemma3-270m)"),
}
# One prompt (the first in file order) from each of these categories.
CATEGORIES = ("writing", "coding", "math_reasoning", "translation", "qa")
RERUN = ". .venv/bin/activate && python bench/decode.py"
# Every other engine's tokens are compared with these, prompt by prompt: the first float32 row
# (its name carries its backend, so `main` sets it once the rows are loaded).
REFERENCE = "jaxspec f32"
LLAMA_CPP = "llama.cpp"
# Rows bounded by --bf16-repeats and --slow-call: neither XLA CPU nor torch has a fast bf16 product.
BOUNDED = ("jaxspec bf16 xla", "HF transformers bf16")
LLAMA_CPP_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON '
                   '-DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF" pip install llama-cpp-python==0.3.36')


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


class Peer(abc.ABC):
    """A peer engine timed from outside: `_generate(ids, n)` returns n greedy tokens and the call's
    wall seconds; decode speed is (N - 1) tokens over an N-token call minus a 1-token call
    (prefill + the first token)."""

    name: str

    @abc.abstractmethod
    def _generate(self, ids: list[int], new_tokens: int) -> tuple[list[int], float]:
        """n greedy tokens after `ids`, and the call's wall seconds."""

    def run(self, ids: list[int], new_tokens: int) -> dict:
        _, prefill = self._generate(ids, 1)  # prefill + the first token
        tokens, total = self._generate(ids, new_tokens)
        assert len(tokens) == new_tokens, (self.name, len(tokens))
        return dict(tokens=tokens, e2e=new_tokens / total,
                    decode=(new_tokens - 1) / (total - prefill) if total > prefill else float("nan"),
                    prefill_s=prefill)


class HF(Peer):
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


class LlamaCpp(Peer):
    """llama.cpp (llama-cpp-python) on the GGUF file itself, fed token ids, greedy, EOS suppressed."""

    def __init__(self, path: pathlib.Path, threads: int, context: int):
        import gguf
        import llama_cpp

        self.llama_cpp, self.name = llama_cpp, LLAMA_CPP
        # verbose=True: verbose=False crashed on this machine.
        self.llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_ctx=context, verbose=True)
        eos = self.llm.token_eos()

        def suppress_eos(input_ids, scores):  # what create_completion's logit_bias={eos: -1000} installs
            biased = np.copy(scores)
            biased[eos] += -1000.0
            return biased

        self.processors = llama_cpp.LogitsProcessorList([suppress_eos])
        self.weight_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)

    def _generate(self, ids: list[int], new_tokens: int) -> tuple[list[int], float]:
        # From an empty cache each time: generate() would otherwise reuse the previous call's prompt.
        self.llm.reset()
        tokens = []
        start = time.perf_counter()
        for token in self.llm.generate(ids, top_k=1, temp=0.0, logits_processor=self.processors):
            tokens.append(int(token))
            if len(tokens) == new_tokens:
                break
        return tokens, time.perf_counter() - start


def load_llama_cpp(path: pathlib.Path, threads: int, context: int) -> LlamaCpp | None:
    """The llama.cpp engine, or None (with how to install it) when llama_cpp is missing."""
    if importlib.util.find_spec("llama_cpp") is None:
        print(f"llama.cpp row skipped: llama_cpp is not installed. Install it portable with\n  {LLAMA_CPP_BUILD}",
              flush=True)
        return None
    return LlamaCpp(path, threads, context)


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    """The prompt's ids as jaxspec.generate(chat=chat) builds them."""
    return tokenizer.encode_chat(text) if chat else tokenizer.encode(text)


def run_jaxspec(model, text: str, new_tokens: int, chat: bool) -> dict:
    import jaxspec

    start = time.perf_counter()
    result = jaxspec.generate(model, None, text, chat=chat, max_new_tokens=new_tokens, ignore_eos=True)
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


def paired_ratio(runs: dict, name: str, reference: str, key: str) -> str:
    """Median of `name`'s figure over `reference`'s, each call paired with the reference's call on
    the same prompt in the same pass ("-" when the reference did not run)."""
    if reference not in runs:
        return "-"
    return f"{median(a / b for a, b in zip(runs[name][key], runs[reference][key])):.2f}x"


def build_report(args, prompts, prompt_lengths, runs, weight_bytes, bandwidths, startup, agreement,
                 matches, mismatches, machine) -> str:
    copy_bw, gemv_bw = bandwidths
    engines = list(runs)
    n = len(prompts)
    jx = runs[REFERENCE]
    settings = MODELS[args.model]
    lines = []
    lines.append(f"{isa_heading(settings.section)}\n")
    has_hf = any(name.startswith("HF ") for name in runs)
    versions = [peer_versions()] if has_hf else []
    weights = ["jaxspec" + (" and HF dequantize" if has_hf else " dequantizes")
               + " it to float32 (jaxspec then converts to its weight format)"]
    if LLAMA_CPP in runs:
        versions.append(f"llama-cpp-python {machine['llama_cpp_version']} (n_threads={args.llama_threads}, "
                        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')})")
        weights.append("llama.cpp runs it as stored")
    lines.append(
        run_stamp(machine["load"], commit=machine["commit"],
                  detail=f"engines interleaved prompt by prompt, medians over {n} prompts x "
                         f"{machine['passes']} pass(es){_bounded_note(runs, n)}")
        + f" {', '.join([f'jax {jax.__version__}', *versions])}. {settings.title}: "
        f"{', '.join(weights)}; batch 1, {args.max_new_tokens} greedy tokens (`ignore_eos`"
        f"{'; llama.cpp suppresses EOS instead' if LLAMA_CPP in runs else ''}), "
        f"{'chat template' if settings.chat else 'plain prompts (chat=False: no chat template, a base model)'}, "
        f"Spec-Bench prompts: "
        + ", ".join(f"{c} #{qid} ({k} tokens)" for (c, qid, _), k in zip(prompts, prompt_lengths))
        + f". Total benchmark run {machine['seconds']:.0f} s.\n")
    lines.append(f"Rerun: `{RERUN}{''.join(' ' + shlex.quote(a) for a in args.argv)}`\n")
    lines.append("jaxspec load / first-call compile: " + ", ".join(
        f"{fmt} {load_s:.1f} s / {compile_s:.1f} s" for fmt, (load_s, compile_s) in startup.items()) + ".\n")
    lines.append("| engine | decode tok/s | end-to-end tok/s | decode vs HF f32 | end-to-end vs HF f32 "
                 "| decode vs llama.cpp | weight MB/token | roofline % (copy BW) | roofline % (GEMV BW) "
                 f"| same tokens as HF f32 | first difference vs {REFERENCE}, per prompt |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name in engines:
        r = runs[name]
        dec, e2e = median(r["decode"]), median(r["e2e"])
        wb = weight_bytes[name]
        lines.append(
            f"| {name} | {dec:.1f} | {e2e:.1f} | {paired_ratio(runs, name, 'HF transformers f32', 'decode')} "
            f"| {paired_ratio(runs, name, 'HF transformers f32', 'e2e')} "
            f"| {paired_ratio(runs, name, LLAMA_CPP, 'decode')} | {wb / 1e6:.0f} "
            f"| {100 * dec / (copy_bw / wb):.0f}% | {100 * dec / (gemv_bw / wb):.0f}% "
            f"| {matches.get(name, '-')} | {agreement.get(name, '(reference)')} |")
    lines.append("")
    lines.append("First difference: the 0-based index of the first token where the engine's greedy output "
                 f"differs from {REFERENCE}'s on that prompt, '-' if all tokens agree.\n")
    if mismatches:
        lines.append("Token mismatches vs HF f32: " + "; ".join(mismatches) + ".\n")
    wb = weight_bytes[REFERENCE]
    lines.append("| bandwidth | GB/s | f32 roofline tok/s (" + f"{wb / 1e6:.0f} MB/token) |")
    lines.append("|---|---:|---:|")
    lines.append(f"| copy: `np.copyto` 1 GiB float32, (read + written) / time | {copy_bw / 1e9:.1f} "
                 f"| {copy_bw / wb:.1f} |")
    lines.append(f"| GEMV: jax `W @ x`, W float32 [8192, 16384], W bytes / time | {gemv_bw / 1e9:.1f} "
                 f"| {gemv_bw / wb:.1f} |")
    lines.append("")
    prefill_engines = [name for name in (REFERENCE, "HF transformers f32", LLAMA_CPP) if name in runs]
    lines.append("| prompt | tokens | " + " | ".join(f"{name} decode tok/s" for name in engines) + " | "
                 + " | ".join(f"{name} prefill s" for name in prefill_engines) + " |")
    lines.append("|---|---:|" + "---:|" * (len(engines) + len(prefill_engines)))
    for i, ((cat, qid, _), plen) in enumerate(zip(prompts, prompt_lengths)):
        def sel(name, key, fmt):  # runs are repeat-major: prompt i is every n-th entry
            values = runs[name][key][i::n]
            return format(median(values), fmt) if values else "-"

        lines.append(f"| {cat} #{qid} | {plen} | " + " | ".join(sel(name, "decode", ".1f") for name in engines)
                     + " | " + " | ".join(sel(name, "prefill_s", ".2f") for name in prefill_engines) + " |")
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
    others = [name for name in engines if name != REFERENCE]
    per_engine = "; ".join(f"{name} {median(runs[name]['decode']) * weight_bytes[name] / 1e9:.1f} GB/s of its "
                           f"{weight_bytes[name] / 1e6:.0f} MB" for name in others)
    lines.append(
        "What bounds it: a batch-1 decode step is a chain of matrix-vector products over "
        f"{wb / 1e6:.0f} MB of float32 weights, each read once, so memory bandwidth bounds it. jaxspec "
        f"decodes at {jx_dec:.1f} tok/s = {streamed / 1e9:.1f} GB/s of weights against "
        f"{gemv_bw / 1e9:.1f} GB/s for a bare jax GEMV and {copy_bw / 1e9:.1f} GB/s for a copy, {verdict}. "
        "Going faster needs fewer bytes per token (bf16 or quantized weights with a fast kernel) or "
        "more tokens per weight read (batching, speculation)."
        + (f" Weight bytes streamed per second by the others at their decode rate: {per_engine}." if others else "")
        + "\n")
    if max(machine["load"]) > 2.5:  # the benchmark alone keeps both cores busy (load ~2)
        lines.append(
            f"Caveat: other jobs were running (load average up to {max(machine['load']):.1f} on "
            f"{os.cpu_count()} cores). torch's OpenMP threads slow down far more than XLA's when a core "
            "is taken away, and llama.cpp's (which wait for each other at every op) most of all, so the HF "
            "and llama.cpp rows (and the ratios) are worse than on a quiet machine; rerun when idle before "
            "relying on them.\n")
    return "\n".join(lines)


def _bounded_note(runs, num_prompts: int) -> str:
    notes = []
    for name in BOUNDED:
        done = len(runs.get(name, {}).get("decode", []))
        if not done:
            continue
        if done < num_prompts:
            notes.append(f"{name} on the first {done} prompt(s) only (slower than --slow-call)")
        else:
            notes.append(f"{name} {done // num_prompts} pass(es)")
    return "".join(f", {note}" for note in notes)


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


def write_section(path: pathlib.Path, section: str, model: str = DEFAULT_MODEL) -> None:
    """Replace this script's section of RESULTS.md for `model`, keep the rest."""
    replace_section(path, isa_heading(MODELS[model].section), section)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS),
                        help=f"the model (default {DEFAULT_MODEL}); each has its own RESULTS.md section")
    parser.add_argument("--questions", type=pathlib.Path, default=DEFAULT_QUESTIONS,
                        help=f"Spec-Bench question.jsonl (default: {DEFAULT_QUESTIONS})")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts (default 2)")
    parser.add_argument("--formats", type=weight_formats, default=["f32", "f32/xla", "int8", "int8/xla", "bf16"],
                        help="jaxspec weight formats, each optionally /xla or /native (the product backend), "
                             "comma separated, f32 among them (default f32,f32/xla,int8,int8/xla,bf16)")
    parser.add_argument("--bf16-repeats", type=int, default=1,
                        help="passes for the bfloat16 rows, jaxspec's and HF's (default 1; 0 skips both)")
    parser.add_argument("--max-seconds", type=float, default=420,
                        help="start no new pass after this many seconds (default 420)")
    parser.add_argument("--slow-call", type=float, default=60,
                        help="drop a bf16 row after a call of it slower than this (default 60 s)")
    parser.add_argument("--no-hf", action="store_true", help="no transformers rows")
    parser.add_argument("--no-llama-cpp", action="store_true", help="no llama.cpp row")
    parser.add_argument("--llama-threads", type=int, default=2, help="llama.cpp n_threads (default 2)")
    add_output_options(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if not any(variant.partition("/")[0] == "f32" for variant in args.formats):
        parser.error("--formats must include f32: the reference for token agreement and the roofline")
    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be >= 2: decode time is what follows the first token")
    if args.bf16_repeats == 0:
        args.formats = [fmt for fmt in args.formats if not fmt.startswith("bf16")]
    began = time.perf_counter()
    load_before = os.getloadavg()

    from jaxspec import checkpoints

    settings = MODELS[args.model]
    prompts = pick_prompts(args.questions)
    # Bandwidth is measured before and after the decoding runs; the median of all samples is used.
    copy_samples, gemv_samples = copy_bandwidth(), gemv_bandwidth()
    print(f"bandwidth: copy {median(copy_samples) / 1e9:.1f} GB/s, GEMV {median(gemv_samples) / 1e9:.1f} GB/s",
          flush=True)

    global REFERENCE
    models, weight_bytes, startup = {}, {}, {}
    for variant in args.formats:
        start = time.perf_counter()
        label, model = load_variant(variant, args.model)
        load_s = time.perf_counter() - start
        name = f"jaxspec {label}"
        if label.startswith("f32") and not any(other.startswith("jaxspec f32") for other in models):
            REFERENCE = name
        models[name] = model
        weight_bytes[name] = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))
        # Warm up: the first call compiles (reported); one call per distinct prompt bucket so that
        # no timed call compiles.
        compile_s, warmed = None, set()
        for _, _, text in prompts:
            bucket = max(16, 1 << (len(encode(model.tokenizer, text, settings.chat)) - 1).bit_length())
            if bucket not in warmed:
                warmed.add(bucket)
                r = run_jaxspec(model, text, args.max_new_tokens, settings.chat)
                compile_s = r["compile_s"] if compile_s is None else compile_s
        startup[label] = (load_s, compile_s)
        print(f"{name}: load {load_s:.1f} s, first-call compile {compile_s:.1f} s", flush=True)
    tokenizer = models[REFERENCE].tokenizer
    ids = [encode(tokenizer, text, settings.chat) for _, _, text in prompts]
    prompt_lengths = [len(i) for i in ids]

    engines = {name: (lambda i, model=model: run_jaxspec(model, prompts[i][2], args.max_new_tokens, settings.chat))
               for name, model in models.items()}
    path = checkpoints.resolve_model(args.model)
    if not args.no_hf:
        import torch
        import transformers

        transformers.logging.set_verbosity_error()

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
    llama_cpp_version = None
    if not args.no_llama_cpp:
        context = -(-(max(prompt_lengths) + args.max_new_tokens) // 256) * 256  # whole 256-slot blocks
        llama = load_llama_cpp(path, args.llama_threads, context)
        if llama is not None:
            llama_cpp_version = llama.llama_cpp.__version__
            engines[LLAMA_CPP] = lambda i: llama.run(ids[i], args.max_new_tokens)
            weight_bytes[LLAMA_CPP] = llama.weight_bytes
            llama._generate(ids[0], 4)  # warm-up

    runs = {name: {"decode": [], "e2e": [], "prefill_s": [], "tokens": []} for name in engines}
    # On a loaded machine the bf16 rows and HF slow down badly; keep the run bounded: a bf16 call
    # slower than --slow-call seconds ends that row, and no new pass starts after --max-seconds.
    passes, stopped = 0, set()
    for rep in range(args.repeats):
        if rep and time.perf_counter() - began > args.max_seconds:
            print(f"  stopping after {rep} pass(es): over --max-seconds {args.max_seconds:.0f}", flush=True)
            break
        passes += 1
        for i, (cat, qid, _) in enumerate(prompts):
            for name, fn in engines.items():
                if name in stopped or (name in BOUNDED and rep >= args.bf16_repeats):
                    continue
                call_began = time.perf_counter()
                r = fn(i)
                if name in BOUNDED and time.perf_counter() - call_began > args.slow_call:
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

    # Same tokens? Every jaxspec format must agree with itself across repeats. Each engine is
    # compared, on its first pass, with HF f32 (whole outputs) and with jaxspec f32 (where the
    # first difference falls).
    n = len(prompts)
    for name in models:
        tokens = runs[name]["tokens"]
        for k in range(n, len(tokens)):
            assert tokens[k] == tokens[k % n], f"{name} not deterministic on prompt {k % n}"
    agreement = {}
    reference = runs[REFERENCE]["tokens"][:n]
    for name in runs:
        if name == REFERENCE:
            continue
        ours = runs[name]["tokens"][:n]
        cells = []
        for i in range(n):
            diff = first_difference(ours[i], reference[i]) if i < len(ours) else "n/a"
            cells.append("-" if diff is None else str(diff))
        agreement[name] = " ".join(cells)
    print(f"first difference vs {REFERENCE} per prompt: {agreement}")
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
                    note = (f"{name} on {prompts[i][0]} #{prompts[i][1]}: first difference at "
                            f"token {diff} ({ours[diff] if diff < len(ours) else None} vs "
                            f"{ref[diff] if diff < len(ref) else None})")
                    mismatches.append(note)
                    print("  " + note)
            matches[name] = f"{same}/{min(n, len(runs[name]['tokens']))}"
        print(f"identical greedy tokens vs HF f32: {matches}")

    machine = dict(load=(load_before[0], os.getloadavg()[0]), commit=_commit(),
                   seconds=time.perf_counter() - began, passes=passes, llama_cpp_version=llama_cpp_version)
    report = build_report(args, prompts, prompt_lengths, runs, weight_bytes, bandwidths, startup, agreement,
                          matches, mismatches, machine)
    print()
    print(report)
    if not args.no_write:
        write_section(args.results, report, args.model)
        print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
