"""KV cache and weight formats: quality and memory on the default model, and the decode kernel's speed.

    . .venv/bin/activate && python bench/kv_formats.py            # quality + memory -> RESULTS.md
    . .venv/bin/activate && python bench/kv_formats.py timing     # kernel vs XLA (a GPU; --tiny on CPU)

Quality (default model, SmolLM2-135M-Instruct, float32 weights): for each K/V format,
- perplexity of the model on Spec-Bench passages (the first `--passages` texts of the
  summarization and rag categories, alternating, cut to `--passage-tokens` tokens) scored in one
  forward that writes the passage to a cache of that format and attends over it, so every
  position reads quantized K/V of everything before it;
- greedy decoding of `--new-tokens` tokens (chat template, EOS ignored) on one Spec-Bench prompt
  per category, each format against float32 KV: the first token where the outputs differ.
Weight formats (a second quality table): float32, bfloat16, int8 and q4 weights
(`jaxspec.load(weight_format=...)`) with float32 KV, and int8 weights with q8_0 and with q5_1 KV,
on the same passages and prompts: perplexity per passage and over all of them, its change vs
float32 weights, and the first token where greedy output differs from float32 weights with
float32 KV. Rows with float32 KV are scored by `jaxspec.score` (teacher-forced log-probs, the
same quantity as the one-forward scoring above: the section reports how closely the two agree
on float32 weights and KV); rows with a quantized KV format by the one-forward scoring, which
writes the passage into a cache of that format. The aims: int8 weights within +1.0% of float32,
q4 within +4.0%.
Memory: KV bytes per token (all layers) per format, and the longest context that fits a 1 GB
(10^9 bytes) KV budget at batch 1 and 8.
The tables replace the `## KV formats (bench/kv_formats.py)` section of bench/RESULTS.md.

Timing (`timing`): the Pallas decode kernel against the XLA reference on one attention call at
B=8, S=8192, N=32, K=8, H=128 (T=1, every row full) per format, and the HBM roofline: the
packed K/V bytes the call must read over the bandwidth (H200: 4.8 TB/s; --hbm-gbps). With
--tiny (CPU) the sizes shrink and the kernel runs in the Pallas interpreter: that checks the
plumbing only; its times mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from forward_cost import median_seconds, require_gpu_or_tiny  # noqa: E402  (bench/ is on sys.path)
from jaxspec.cache import KVCache, KVFormat  # noqa: E402
from jaxspec.models import llama  # noqa: E402
from jaxspec.pallas import kv_quant  # noqa: E402
from jaxspec.pallas.flash_decode import flash_decode, flash_decode_reference  # noqa: E402
from results_md import add_output_options, replace_section  # noqa: E402

DEFAULT_QUESTIONS = HERE / "data" / "spec_bench" / "question.jsonl"
SECTION = "## KV formats (bench/kv_formats.py)"
RERUN = ". .venv/bin/activate && python bench/kv_formats.py"
FORMATS = [("f32", "f32"), ("bf16", "bf16"), ("q8_0", "q8_0"), ("q8_0", "q5_1"), ("q5_1", "q5_1")]
# The weight table's rows: (weight format, K/V format). The first is the reference, and equals
# the KV table's first row.
WEIGHT_ROWS = [("f32", ("f32", "f32")), ("bf16", ("f32", "f32")), ("int8", ("f32", "f32")), ("q4", ("f32", "f32")),
               ("int8", ("q8_0", "q8_0")), ("int8", ("q5_1", "q5_1"))]
# percent: how far each quantized weight format's perplexity may rise over float32 weights' (f32 KV)
PERPLEXITY_AIMS = {"int8": 1.0, "q4": 4.0}
# jaxspec.score (chunked through the cache) and the one-forward scoring compute the same
# log-probs; on float32 weights and KV they must agree to float rounding, this relative.
SCORING_TOLERANCE = 1e-5
PASSAGE_CATEGORIES = ("summarization", "rag")
PROMPT_CATEGORIES = ("writing", "coding", "math_reasoning", "translation", "qa")
BUDGET_BYTES = 10**9


def load_questions(path: pathlib.Path) -> list[dict]:
    if not path.is_file():
        sys.exit(f"{path}: no such file; pass --questions PATH to Spec-Bench's question.jsonl")
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def passages(questions, count: int) -> list[str]:
    by_category = {c: [q["turns"][0] for q in questions if q["category"] == c] for c in PASSAGE_CATEGORIES}
    texts = []
    for i in range(count):
        category = PASSAGE_CATEGORIES[i % len(PASSAGE_CATEGORIES)]
        texts.append(by_category[category][i // len(PASSAGE_CATEGORIES)])
    return texts


def prompts(questions) -> list[tuple[str, str]]:
    found = {}
    for q in questions:
        if q["category"] in PROMPT_CATEGORIES and q["category"] not in found:
            found[q["category"]] = q["turns"][0]
    return [(c, found[c]) for c in PROMPT_CATEGORIES]


# --- quality -----------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("cfg", "kv_format"))
def passage_nll(params, tokens, lengths, *, cfg, kv_format):
    """Summed next-token NLL and token count per row; tokens [B, P] right-padded to `lengths`."""
    cache = KVCache.create(cfg, tokens.shape[0], tokens.shape[1], kv_format=kv_format)
    logits, _, _ = llama.forward(params, cfg, tokens, cache, attention="reference")
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)  # float32 whatever the weights
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]  # [B, P-1]
    scored = jnp.arange(tokens.shape[1] - 1)[None, :] < (lengths - 1)[:, None]
    return jnp.sum(jnp.where(scored, nll, 0.0), axis=1), jnp.sum(scored, axis=1)


@functools.partial(jax.jit, static_argnames=("cfg", "kv_format", "new_tokens"))
def greedy(params, tokens, lengths, *, cfg, kv_format, new_tokens):
    """Plain greedy decoding of `new_tokens` per row over a cache in `kv_format`. -> [B, N]"""
    batch, prompt_size = tokens.shape
    cache = KVCache.create(cfg, batch, prompt_size + new_tokens, kv_format=kv_format)
    logits, _, cache = llama.forward(params, cfg, tokens, cache, logit_indices=(lengths - 1)[:, None],
                                     attention="reference")
    cache = cache.set_length(lengths)
    first = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)

    def step(carry, _):
        token, cache = carry
        logits, _, cache = llama.forward(params, cfg, token[:, None], cache, attention="reference")
        cache = cache.advance(jnp.ones_like(cache.length))
        following = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return (following, cache), following

    _, rest = jax.lax.scan(step, (first, cache), None, length=new_tokens - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def _padded(rows: list[list[int]], size: int) -> tuple[jax.Array, jax.Array]:
    out = np.zeros((len(rows), size), np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return jnp.asarray(out), jnp.asarray([len(r) for r in rows], jnp.int32)


def first_difference(a, b) -> int | None:
    diff = np.nonzero(np.asarray(a) != np.asarray(b))[0]
    return int(diff[0]) if diff.size else None


def quality_inputs(args, tokenizer) -> dict:
    """The passages (right-padded [P, L] and lengths) and greedy prompts ([B, bucket] and lengths)."""
    questions = load_questions(args.questions)
    passage_ids = [tokenizer.encode(text)[: args.passage_tokens] for text in passages(questions, args.passages)]
    prompt_list = prompts(questions)
    prompt_ids = [tokenizer.encode_chat(text) for _, text in prompt_list]
    bucket = 1 << (max(len(p) for p in prompt_ids) - 1).bit_length()
    info = dict(passage_tokens=[len(p) for p in passage_ids], prompts=[c for c, _ in prompt_list],
                prompt_tokens=[len(p) for p in prompt_ids])
    return dict(passage_ids=passage_ids, passages=_padded(passage_ids, max(len(p) for p in passage_ids)),
                prompts=_padded(prompt_ids, bucket), info=info)


def one_forward_perplexity(params, cfg, inputs, kv_format: KVFormat) -> dict:
    """Perplexity over all passages' tokens and per passage, all passages in one forward that
    writes them to a cache in `kv_format`."""
    nll, count = passage_nll(params, *inputs["passages"], cfg=cfg, kv_format=kv_format)
    per_passage = [float(np.exp(n / c)) for n, c in zip(np.asarray(nll), np.asarray(count))]
    return dict(ppl=float(np.exp(np.sum(nll) / np.sum(count))), per_passage=per_passage)


def harness_row(args, params, cfg, inputs, kv_format: KVFormat) -> tuple[dict, np.ndarray]:
    """Perplexity by the one-forward scoring over a cache in `kv_format`, and greedy outputs [B, N]."""
    outputs = np.asarray(greedy(params, *inputs["prompts"], cfg=cfg, kv_format=kv_format, new_tokens=args.new_tokens))
    return one_forward_perplexity(params, cfg, inputs, kv_format), outputs


def quality(args, model, inputs) -> tuple[list[dict], dict]:
    """The KV table's rows (float32 weights), and each format's greedy outputs by K/V pair."""
    rows, outputs = [], {}
    for pair in FORMATS:
        kv_format = KVFormat.parse(pair)
        start = time.perf_counter()
        row, outputs[pair] = harness_row(args, model.params, model.config, inputs, kv_format)
        rows.append(dict(row, format=kv_format, seconds=time.perf_counter() - start))
        print(f"{kv_format}: ppl {row['ppl']:.4f} {['%.3f' % p for p in row['per_passage']]} "
              f"({rows[-1]['seconds']:.0f} s)", flush=True)
    reference = outputs[FORMATS[0]]
    for row, pair in zip(rows, FORMATS):
        row["divergence"] = [first_difference(ours, ref) for ours, ref in zip(outputs[pair], reference)]
    return rows, outputs


def weight_quality(args, model, inputs, kv_rows: list[dict], kv_outputs: dict) -> tuple[list[dict], float]:
    """The weight table's rows, and the largest relative difference between jaxspec.score and the
    one-forward scoring on float32 weights and KV (per passage and over all passages).

    `model` has float32 weights (the KV table's). Rows with float32 KV are scored by
    `jaxspec.score`; rows with a quantized KV format by the one-forward scoring, which is the
    only one that can store K/V in that format."""
    import jaxspec

    f32_kv = KVFormat.parse(("f32", "f32"))
    reference = kv_outputs[FORMATS[0]]  # float32 weights, float32 KV
    rows, models, agreement = [], {"f32": model}, None
    for weight_format, pair in WEIGHT_ROWS:
        kv_format = KVFormat.parse(pair)
        start = time.perf_counter()
        if weight_format not in models:
            models[weight_format] = jaxspec.load(weight_format=weight_format)
        model = models[weight_format]
        if kv_format == f32_kv:
            result = jaxspec.score(model, inputs["passage_ids"])
            logprobs = np.concatenate(result.logprobs)
            row = dict(ppl=float(np.exp(-np.mean(logprobs, dtype=np.float64))),
                       per_passage=[float(p) for p in result.perplexity], scored_by="`jaxspec.score`")
            if weight_format == "f32":
                one_forward = kv_rows[0]  # the same weights and KV, scored in one forward
                agreement = max(abs(a / b - 1) for a, b in zip([row["ppl"], *row["per_passage"]],
                                                               [one_forward["ppl"], *one_forward["per_passage"]]))
                outputs = reference
            else:
                # Scored both ways: the same tokens in other shapes (chunks vs one forward) show
                # how far the format's figure moves with how the tokens are batched.
                one_forward = one_forward_perplexity(model.params, model.config, inputs, kv_format)
                outputs = np.asarray(greedy(model.params, *inputs["prompts"], cfg=model.config, kv_format=kv_format,
                                            new_tokens=args.new_tokens))
            row["one_forward_ppl"] = one_forward["ppl"]
        else:
            row, outputs = harness_row(args, model.params, model.config, inputs, kv_format)
            row.update(scored_by="one forward", one_forward_ppl=row["ppl"])
        row.update(weights=weight_format, format=kv_format,
                   weight_mb=sum(leaf.nbytes for leaf in jax.tree.leaves(model.params)) / 1e6,
                   divergence=[first_difference(ours, ref) for ours, ref in zip(outputs, reference)],
                   seconds=time.perf_counter() - start)
        rows.append(row)
        print(f"{weight_format} weights, {kv_format} KV: ppl {row['ppl']:.4f} "
              f"{['%.3f' % p for p in row['per_passage']]}, one forward {row['one_forward_ppl']:.4f} "
              f"({row['seconds']:.0f} s)", flush=True)
    print(f"jaxspec.score vs one-forward scoring on f32 weights and KV: largest relative difference {agreement:.1e}",
          flush=True)
    if agreement > SCORING_TOLERANCE:
        print(f"WARNING: the two scorings differ by more than {SCORING_TOLERANCE:.0e} on the same weights and KV; "
              "the weight table mixes them, so its rows are not comparable to that precision", flush=True)
    return rows, agreement


def memory_rows(cfg) -> list[dict]:
    rows = []
    for pair in FORMATS:
        kv_format = KVFormat.parse(pair)
        per_token = kv_format.bytes_per_token(cfg)
        rows.append(dict(format=kv_format, per_token=per_token,
                         context_1=BUDGET_BYTES // per_token, context_8=BUDGET_BYTES // (8 * per_token)))
    return rows


def weight_table(rows: list[dict], agreement: float) -> str:
    """The weight formats' quality table, and how it was scored."""
    f32 = rows[0]["ppl"]
    lines = [f"Weight formats, on the same passages and prompts; perplexity and greedy divergence against float32 "
             f"weights with float32 KV. Scored by `jaxspec.score` (teacher-forced log-probs, chunked through the "
             f"cache) where the KV is float32, else by the one-forward scoring of the table above over a cache in "
             f"the row's KV format; on float32 weights and KV the two agree to {agreement:.0e} relative. Rows "
             f"scored by `jaxspec.score` are scored in one forward too (last column): the same tokens run in other "
             f"shapes, so a gap there is how far the format's figure moves with how tokens are batched.", ""]
    lines.append("| weights | K / V | weights MB | perplexity | vs f32 | per passage "
                 "| greedy: first divergence per prompt | scored by | perplexity, one forward |")
    lines.append("|---|---|---:|---:|---:|---|---|---|---:|")
    for row in rows:
        passages_text = " ".join(f"{p:.2f}" for p in row["per_passage"])
        divergence = " ".join("-" if d is None else str(d) for d in row["divergence"])
        lines.append(f"| {row['weights']} | {row['format']} | {row['weight_mb']:.0f} | {row['ppl']:.3f} "
                     f"| {100 * (row['ppl'] / f32 - 1):+.2f}% | {passages_text} | {divergence} | {row['scored_by']} "
                     f"| {row['one_forward_ppl']:.3f} |")
    lines.append("")
    for weights, aim in PERPLEXITY_AIMS.items():
        row = next(row for row in rows if row["weights"] == weights)  # its first row: f32 KV
        change = 100 * (row["ppl"] / f32 - 1)
        verdict = "within" if change <= aim else "outside"
        lines.append(f"{weights} weights (f32 KV): {change:+.2f}% perplexity vs float32 weights, {verdict} the aim "
                     f"of +{aim:.1f}%.")
    lines.append("")
    return "\n".join(lines)


def build_section(args, cfg, quality_rows, info, weight_rows, agreement, memory) -> str:
    f32 = quality_rows[0]["ppl"] if quality_rows else None
    lines = [SECTION, ""]
    lines.append(f"Rerun: `{RERUN}`. Default model (SmolLM2-135M-Instruct: L={cfg.num_layers}, "
                 f"K={cfg.num_kv_heads}, H={cfg.head_dim}; float32 weights unless a row says otherwise); "
                 f"XLA reference attention, CPU.")
    lines.append("")
    if quality_rows:
        lines.append(f"Quality. Perplexity over {len(info['passage_tokens'])} Spec-Bench passages "
                     f"({', '.join(PASSAGE_CATEGORIES)}; {sum(info['passage_tokens'])} tokens, each cut to "
                     f"<= {args.passage_tokens}), every position attending over K/V stored in the format. "
                     f"Greedy: {args.new_tokens} tokens on one prompt per category "
                     f"({', '.join(info['prompts'])}; chat template, EOS ignored); first token index (0-based) "
                     f"where the output differs from float32 KV, '-' if never.")
        lines.append("")
        lines.append("| K / V | perplexity | vs f32 | per passage | greedy: first divergence per prompt |")
        lines.append("|---|---:|---:|---|---|")
        for row in quality_rows:
            delta = f"{100 * (row['ppl'] / f32 - 1):+.2f}%"
            passages_text = " ".join(f"{p:.2f}" for p in row["per_passage"])
            divergence = " ".join("-" if d is None else str(d) for d in row["divergence"])
            lines.append(f"| {row['format']} | {row['ppl']:.3f} | {delta} | {passages_text} | {divergence} |")
        lines.append("")
    if weight_rows:
        lines.append(weight_table(weight_rows, agreement))
    lines.append(f"Memory. KV bytes per token (all {cfg.num_layers} layers, K and V) and the longest context "
                 f"a 1 GB (10^9 B) KV budget holds.")
    lines.append("")
    lines.append("| K / V | bytes/token | vs f32 | max context, batch 1 | max context, batch 8 |")
    lines.append("|---|---:|---:|---:|---:|")
    base = memory[0]["per_token"]
    for row in memory:
        lines.append(f"| {row['format']} | {row['per_token']:,} | {row['per_token'] / base:.3f} | "
                     f"{row['context_1']:,} | {row['context_8']:,} |")
    lines.append("")
    lines.append(f"The model's own context is {cfg.max_position_embeddings:,} tokens; the budget columns "
                 "say how far the KV alone would stretch.")
    return "\n".join(lines) + "\n"


# --- kernel timing -----------------------------------------------------------------------------


def timing(args) -> str:
    interpret = require_gpu_or_tiny(args.tiny)
    if args.tiny:
        batch, capacity, num_heads, num_kv_heads, head_dim, repeats = 2, 256, 4, 2, 64, 3
    else:
        batch, capacity, num_heads, num_kv_heads, head_dim, repeats = 8, 8192, 32, 8, 128, 20
    group, steps = num_heads // num_kv_heads, 1
    keys_q = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys_q[0], (batch, steps, num_kv_heads, group, head_dim), jnp.float32)
    k = jax.random.normal(keys_q[1], (batch, num_kv_heads, capacity, head_dim), jnp.float32)
    v = jax.random.normal(keys_q[2], (batch, num_kv_heads, capacity, head_dim), jnp.float32)
    lengths = jnp.full((batch,), capacity - steps, jnp.int32)
    kernel = jax.jit(functools.partial(flash_decode, interpret=interpret, block_s=args.block_s,
                                       split_size=args.split_size))
    reference = jax.jit(flash_decode_reference)
    rows = []
    for pair in FORMATS:
        kv_format = KVFormat.parse(pair)
        keys = kv_quant.quantize_reference(k, kv_format.keys)
        values = kv_quant.quantize_reference(v, kv_format.values)
        kv_bytes = kv_quant.nbytes(keys) + kv_quant.nbytes(values)
        ours = kernel(q, keys, values, lengths)
        error = float(jnp.max(jnp.abs(ours - reference(q, keys, values, lengths))))
        kernel_s = median_seconds(kernel, q, keys, values, lengths, repeats=repeats)
        reference_s = median_seconds(reference, q, keys, values, lengths, repeats=repeats)
        roofline_s = kv_bytes / (args.hbm_gbps * 1e9)
        rows.append((str(kv_format), kv_bytes, kernel_s, reference_s, roofline_s, error))
        print(f"{kv_format}: kernel {kernel_s * 1e6:.0f} us, reference {reference_s * 1e6:.0f} us, "
              f"max |diff| {error:.2e}", flush=True)
    mode = "Pallas interpreter on CPU: plumbing check, times meaningless" if interpret else jax.devices()[0].device_kind
    lines = [f"Decode attention, B={batch} S={capacity} N={num_heads} K={num_kv_heads} H={head_dim} T={steps}, "
             f"every row full ({mode}); roofline = packed K/V bytes / {args.hbm_gbps:.0f} GB/s",
             "",
             "| K / V | KV MB | kernel us | XLA ref us | kernel GB/s | of roofline | ref / kernel | max diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, kv_bytes, kernel_s, reference_s, roofline_s, error in rows:
        lines.append(f"| {name} | {kv_bytes / 1e6:.1f} | {kernel_s * 1e6:.0f} | {reference_s * 1e6:.0f} | "
                     f"{kv_bytes / kernel_s / 1e9:.0f} | {roofline_s / kernel_s:.0%} | "
                     f"{reference_s / kernel_s:.2f}x | {error:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", default="quality", choices=("quality", "memory", "timing"),
                        help="quality: both tables (default); memory: the memory table only; timing: kernel")
    parser.add_argument("--questions", type=pathlib.Path, default=DEFAULT_QUESTIONS)
    parser.add_argument("--passages", type=int, default=4)
    parser.add_argument("--passage-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--no-weights", action="store_true", help="quality: the KV formats only, no weight table")
    parser.add_argument("--tiny", action="store_true", help="timing: small sizes, interpreter on CPU")
    parser.add_argument("--hbm-gbps", type=float, default=4800.0, help="timing: HBM bandwidth (H200: 4800)")
    parser.add_argument("--block-s", type=int, default=64)
    parser.add_argument("--split-size", type=int, default=512)
    add_output_options(parser)
    args = parser.parse_args(argv)

    if args.command == "timing":
        print(timing(args), end="")
        return 0

    import jaxspec

    model = jaxspec.load(weight_format="f32")
    quality_rows, info, weight_rows, agreement = [], {}, [], None
    if args.command == "quality":
        inputs = quality_inputs(args, model.tokenizer)
        info = inputs["info"]
        quality_rows, kv_outputs = quality(args, model, inputs)
        if not args.no_weights:
            weight_rows, agreement = weight_quality(args, model, inputs, quality_rows, kv_outputs)
    section = build_section(args, model.config, quality_rows, info, weight_rows, agreement, memory_rows(model.config))
    print(section, end="")
    if not args.no_write and args.command == "quality":  # the memory table alone is only printed
        replace_section(args.results, SECTION, section)
        print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
