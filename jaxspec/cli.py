"""`python -m jaxspec.cli generate | score | info | convert | train-head`.

Bad input (a missing model, an out-of-range parameter) prints one line, in the CLI's own terms
(`--draft`, not `draft_params`), and exits with status 2. Generation defaults are
`jaxspec.GenerateOptions`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import signal
import sys

from jaxspec import api, checkpoints, compilation, distributed, sharding
from jaxspec.errors import InvalidRequestError, JaxspecError
from jaxspec.model import shard
from jaxspec.models import backends
from jaxspec.models.backends import Products
from jaxspec.models.quant import WeightFormat
from jaxspec.options import DEFAULT_DRAFT_TOKENS, GenerateOptions
from jaxspec.score import score
from jaxspec.spec.methods import DRAFT_SAMPLING, DRAFTERS, Method

EXIT_BAD_INPUT = 2
WEIGHT_FORMAT_FLAG = dict(
    choices=[f.value for f in WeightFormat], default=WeightFormat.AUTO.value,
    help="the model's weights: auto (default: f32 on CPU, bf16 on GPU), f32, bf16, int8 (W8A8 on CPU), or q4 "
         "(4-bit blocks, W4A8 on CPU); "
         "a draft follows the model's")
PRODUCTS_FLAG = dict(
    choices=[p.value for p in Products], default=Products.AUTO.value,
    help="which code computes the weight products: auto (default: the native CPU kernels for f32 and int8 "
         "weights on a CPU where they build, else XLA's), xla, or native")
DEFAULTS = GenerateOptions()


def _method_help() -> str:
    """--method's help, from the drafter registry."""
    return "speculation, default plain or inferred from --draft: " + "; ".join(
        f"{name}: {drafter.summary}" + (f", {drafter.draft_help}" if drafter.draft_help else "")
        for name, drafter in DRAFTERS.items())


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2, like every other bad
    input the CLI meets (argparse's own error prints the whole usage first). Subcommand parsers
    are built from the same class (argparse's add_subparsers default)."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command (its generate defaults are GenerateOptions's)."""
    parser = _OneLineParser(prog="python -m jaxspec.cli", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="stream a completion, then one stats line")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=api.DEFAULT_MODEL,
                     help="'smollm2-135m' (default), a .gguf file, an HF or a converted directory")
    gen.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    gen.add_argument("--temperature", type=float, default=DEFAULTS.temperature, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=DEFAULTS.top_p)
    gen.add_argument("--top-k", type=int, default=DEFAULTS.top_k)
    gen.add_argument("--min-p", type=float, default=DEFAULTS.min_p)
    gen.add_argument("--repetition-penalty", type=float, default=DEFAULTS.repetition_penalty)
    gen.add_argument("--seed", type=int, default=DEFAULTS.seed)
    gen.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    gen.add_argument("--method", choices=list(DRAFTERS), default=None, help=_method_help())
    gen.add_argument("-k", "--num-draft-tokens", type=int, default=DEFAULTS.num_draft_tokens,
                     help=f"draft tokens per round (default {DEFAULT_DRAFT_TOKENS}; a --tree drafts to its depth)")
    gen.add_argument("--draft", default=None,
                     help="a draft model (same vocabulary), an EAGLE-3 head directory or name "
                          "(eagle3-smollm2-135m), a trained MTP head directory, or for --method mtp the HF "
                          "directory whose MTP head to use")
    gen.add_argument("--tree", default=None, metavar="DEPTH,TOPK,NODES",
                     help="draft an EAGLE-2 dynamic tree instead of a chain of k: its depth, the children "
                          "expanded per node, and the nodes verified per round (e.g. 4,4,16)")
    gen.add_argument("--lookup-first", type=int, default=None, metavar="N",
                     help="with eagle3, mtp or assistant: rows whose last N tokens occurred earlier in their context "
                          "draft prompt lookup's continuation instead of the head's (N = 2 suits chains, 1 trees)")
    gen.add_argument("--draft-sampling", choices=DRAFT_SAMPLING, default=None,
                     help="at temperature > 0: drafts sampled from the draft's distribution (default) or its argmax")
    gen.add_argument("--kv-format", default=None, help="the target's KV cache: f32 (default), bf16, q8_0, q5_1, "
                     "or K,V such as q8_0,q5_1")
    gen.add_argument("--attention", default=DEFAULTS.attention.value,
                     help="auto (default: native on the native product backend, else reference), reference, native, pallas or interpret")
    gen.add_argument("--exit-layer", type=int, default=None,
                     help="with --method layer_skip: layers the draft keeps (default half)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=DEFAULTS.chat,
                     help="apply the model's chat template (default: on when the model has one)")
    gen.add_argument("--weight-format", **WEIGHT_FORMAT_FLAG)
    gen.add_argument("--products", **PRODUCTS_FLAG)
    gen.add_argument("-q", "--quiet", action="store_true", help="no 'preparing ... compiled' notices on stderr")
    gen.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="after the text, each token's log-prob and its N most likely alternatives")
    gen.add_argument("--regex", default=None, help="constrain the output to match this regular expression")
    gen.add_argument("--json-schema", default=None, metavar="FILE",
                     help="constrain the output to JSON valid under the schema in FILE")
    gen.add_argument("--choice", action="append", default=None,
                     help="constrain the output to one of these strings (repeatable)")
    gen.add_argument("--mesh", default=None, metavar="data=N,model=M",
                     help="shard over a device mesh: rows over 'data', heads/ffn/vocab over 'model' (jaxspec.shard)")
    gen.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                     help="multi-host: process 0's address (jax.distributed); with --num-processes and --process-id")
    gen.add_argument("--num-processes", type=int, default=None)
    gen.add_argument("--process-id", type=int, default=None)

    scorer = commands.add_parser("score", help="each token's log-probability under the model, and the perplexity")
    scorer.add_argument("text")
    scorer.add_argument("--model", default=api.DEFAULT_MODEL,
                        help="'smollm2-135m' (default), a .gguf file, an HF or a converted directory")
    scorer.add_argument("--json", action="store_true", help="one JSON object: the tokens, their log-probs, perplexity")
    scorer.add_argument("--weight-format", **WEIGHT_FORMAT_FLAG)
    scorer.add_argument("--products", **PRODUCTS_FLAG)

    info = commands.add_parser("info", help="describe a checkpoint from its headers, and this machine's product "
                                            "backends (native CPU kernels: built, instruction set, threads)")
    info.add_argument("model", nargs="?", default=api.DEFAULT_MODEL)

    convert = commands.add_parser("convert", help="convert a GGUF or HF checkpoint to a jaxspec directory")
    convert.add_argument("source")
    convert.add_argument("output")
    convert.add_argument("--overwrite", action="store_true")
    convert.add_argument("--weight-format", choices=[f.value for f in WeightFormat if f is not WeightFormat.AUTO],
                         default=WeightFormat.F32.value, help="how the directory stores the weights (default f32)")

    # Its flags follow CorpusPlan, whose module (and jaxspec.train's optax) loads only when it runs:
    # `_corpus_parser` reads what this parser leaves unparsed, --help included.
    commands.add_parser("corpus", add_help=False, help=CORPUS_HELP)

    head = commands.add_parser("train-head", help="train an EAGLE-3 or MTP draft head on the model's own answers")
    head.add_argument("--method", choices=("eagle3", "mtp"), default="eagle3")
    head.add_argument("--mtp-random-block", action="store_true",
                      help="MTP: start the head's block from random weights, not from the target's last layer")
    head.add_argument("--model", default=api.DEFAULT_MODEL, help="the target: a name, a .gguf file or a directory")
    head.add_argument("--weight-format", **dict(WEIGHT_FORMAT_FLAG, help=(
        "the target's weights while training: its features and answers come from this trunk, so train in "
        "the format the head will serve under (auto: f32 on CPU, bf16 on GPU; int8: W8A8 on CPU)")))
    head.add_argument("--out", required=True,
                      help="the run's directory: checkpoints, data, and the head (EAGLE-3: generate with --draft OUT)")
    head.add_argument("--prompts", default=None,
                      help='a JSONL file, one {"prompt": ...} or {"text": ...} per line (default: jaxspec\'s '
                           'self-instruct topic prompts, answered by the model)')
    head.add_argument("--data", nargs="+", default=None, metavar="FILE",
                      help="reuse already distilled data (skips self-distillation): another run's train_data.npz, "
                           "a corpus's dataset.npz, or several, concatenated in order (some rounds of a corpus)")
    head.add_argument("--num-prompts", type=int, default=640, help="self-instruct: topic prompts (stage 1)")
    head.add_argument("--num-passage-prompts", type=int, default=192,
                      help="self-instruct: prompts over the model's own stage-1 articles (stage 2)")
    head.add_argument("--distill-batch-size", type=int, default=32, help="rows per batched generate when distilling")
    head.add_argument("--answer-window", type=int, default=None, metavar="N",
                      help="with --data: train on each row's prompt and the N tokens after it (the opening of its "
                           "first answer), e.g. 128 where a corpus's long answers loop")
    head.add_argument("--steps", type=int, default=1000)
    head.add_argument("--batch-size", type=int, default=8)
    head.add_argument("--seq-len", type=int, default=256, help="training window: prompt + answer tokens")
    head.add_argument("--max-new-tokens", type=int, default=128, help="answer length when self-distilling")
    head.add_argument("--draft-vocab-size", type=int, default=None,
                      help="EAGLE-3: draft over the N most frequent answer tokens (default: the whole vocabulary)")
    head.add_argument("--draft-vocab-coverage", type=float, default=None,
                      help="EAGLE-3: the smallest draft vocabulary (a multiple of 256) covering this fraction of "
                           "the held-out answers' tokens, e.g. 0.95; instead of --draft-vocab-size")
    head.add_argument("--bucket-width", type=int, default=256,
                      help="batch rows of like length, cut to a multiple of this many positions (0: the whole "
                           "--seq-len window every batch)")
    head.add_argument("--lr", type=float, default=3e-4, help="peak AdamW learning rate")
    head.add_argument("--warmup-steps", type=int, default=50)
    head.add_argument("--ttt-steps", type=int, default=3, help="unrolled head steps per position (training-time test)")
    head.add_argument("--soft-labels", action="store_true",
                      help="learn the target's distribution over the draft vocabulary, not its argmax "
                           "(recomputes the target every step: no feature cache)")
    head.add_argument("--labels", choices=("target", "text"), default="target",
                      help="each position's label: the target's argmax (default), or the row's next token: for a "
                           "corpus the target wrote greedily in the --weight-format trained for (a feature pass "
                           "rounds differently from decoding under int8)")
    head.add_argument("--no-feature-cache", action="store_true",
                      help="recompute the target's features every step instead of caching them once on disk")
    head.add_argument("--feature-cache", default=None,
                      help="the feature cache's directory (default OUT/features); rows are found by their tokens, "
                           "so runs on any data may share one (a corpus's rounds are computed once)")
    head.add_argument("--head-dtype", choices=("float32", "bfloat16"), default="float32",
                      help="the written head's weights (bfloat16: half the bytes)")
    head.add_argument("--init-from", default=None, metavar="HEAD",
                      help="start from this head (a name or directory, e.g. an earlier run's --out) instead of "
                           "random weights; an EAGLE-3 head's lm_head rows carry over by target token")
    head.add_argument("--keep-draft-vocab", action="store_true",
                      help="with --init-from (EAGLE-3): the draft vocabulary holds every token of that head's, then "
                           "the data's most frequent others up to --draft-vocab-size / --draft-vocab-coverage, so "
                           "every lm_head row carries over")
    head.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32",
                      help="the head's products while training (bfloat16: bf16 products forward and backward, "
                           "float32 master weights and accumulation; faster on a CPU with AMX, slower on AVX2-only ones)")
    head.add_argument("--val-fraction", type=float, default=0.05)
    head.add_argument("--eval-every", type=int, default=100)
    head.add_argument("--save-every", type=int, default=200)
    head.add_argument("--seed", type=int, default=0)
    head.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                      help="apply the model's chat template to prompts (default: on when the model has one)")
    head.add_argument("--resume", action="store_true",
                      help="continue the run in --out with its saved settings and data (other settings are ignored)")
    head.add_argument("--keep-every", type=int, default=None, metavar="N",
                      help="besides the last two checkpoints, keep those at every multiple of N steps (give it again "
                           "with --resume), for --export-head")
    head.add_argument("--export-head", default=None, metavar="DEST",
                      help="train nothing: write the head of the run in --out at its latest checkpoint (or "
                           "--export-step) to DEST, to measure a run that has not finished or the heads along one")
    head.add_argument("--export-step", type=int, default=None, metavar="N", help="with --export-head: this checkpoint")
    return parser


# Python names in an API error message -> the flags that set them.
PYTHON_NAMES_TO_FLAGS = {
    "draft_params": "--draft", "num_draft_tokens": "--num-draft-tokens", "max_new_tokens": "--max-new-tokens",
    "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p", "repetition_penalty": "--repetition-penalty",
    "draft_sampling": "--draft-sampling", "kv_format": "--kv-format", "exit_layer": "--exit-layer",
    "temperature": "--temperature", "logprobs": "--logprobs", "json_schema": "--json-schema", "regex": "--regex",
    "choices": "--choice", "lookup_first": "--lookup-first",
}
_PYTHON_NAME = re.compile(r"\b(" + "|".join(map(re.escape, PYTHON_NAMES_TO_FLAGS)) + r")\b")
_METHOD_EQUALS = re.compile(r"method='(\w+)'")


def in_cli_terms(error: JaxspecError) -> str:
    """An API error's message with the Python option names it mentions (draft_params,
    method='eagle3') as the CLI's flags, each an exact name of PYTHON_NAMES_TO_FLAGS. An error
    about one flag's value (`InvalidRequestError.flag`: a DraftTree's top_k is part of --tree,
    not the sampling --top-k) is printed as written, marked as that flag's."""
    message = str(error)
    if isinstance(error, InvalidRequestError) and error.flag is not None:
        return f"{error.flag}: {message}"
    message = _METHOD_EQUALS.sub(r"--method \1", message)
    return _PYTHON_NAME.sub(lambda match: PYTHON_NAMES_TO_FLAGS[match.group(1)], message)


def _check_flags(args) -> None:
    """What only the CLI can get wrong: flags that only apply together."""
    if args.exit_layer is not None and args.method != Method.LAYER_SKIP:
        raise InvalidRequestError("--exit-layer applies to --method layer_skip only")
    if args.method is None:
        return
    drafter = DRAFTERS[args.method]
    if args.draft is None and drafter.draft_help is not None and drafter.default_draft is None:
        raise InvalidRequestError(f"--method {args.method} needs {drafter.draft_help}")
    if args.draft is not None and drafter.draft_help is None:
        raise InvalidRequestError(f"--method {args.method} takes no --draft")


def _generate(args) -> None:
    _check_flags(args)
    mesh_sizes = sharding.parse_mesh(args.mesh) if args.mesh is not None else None
    if args.coordinator is not None:  # before anything touches a device
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    elif args.num_processes is not None or args.process_id is not None:
        raise InvalidRequestError("--num-processes and --process-id go with --coordinator")
    main_process = distributed.is_main_process()
    compilation.set_compile_notices(not args.quiet and main_process)
    json_schema = None
    if args.json_schema is not None:
        try:
            with open(args.json_schema, encoding="utf-8") as file:
                json_schema = file.read()
        except (OSError, UnicodeDecodeError) as error:
            raise InvalidRequestError(f"--json-schema {args.json_schema}: cannot read it ({error})") from None
    kv_format = args.kv_format
    if kv_format is not None and "," in kv_format:
        kv_format = tuple(kv_format.split(",", 1))
    # Checked before anything loads: a bad flag costs no model load.
    options = GenerateOptions(
        method=args.method, num_draft_tokens=args.num_draft_tokens, tree=args.tree, exit_layer=args.exit_layer,
        lookup_first=args.lookup_first,
        draft_sampling=args.draft_sampling, kv_format=kv_format, attention=args.attention,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, chat=args.chat,
        stop=args.stop, logprobs=args.logprobs, regex=args.regex, json_schema=json_schema, choices=args.choice)
    model = api.load(args.model, weight_format=args.weight_format, products=args.products, progress=main_process)
    if mesh_sizes is not None:
        model = shard(model, sharding.make_mesh(**mesh_sizes))  # a draft follows the target's mesh
    load_draft = DRAFTERS[args.method].load_draft if args.method is not None else None
    draft = None
    if args.draft is not None:
        draft = load_draft(args.draft) if load_draft else api.load(args.draft, progress=main_process)
    stream = api.stream(model, draft, args.prompt, options=options)
    for text in stream:
        if main_process:  # under a multi-host mesh, every process runs the loop and one prints
            print(text, end="", flush=True)
    if not main_process:
        return
    if stream.result.logprobs is not None:
        _print_logprobs(stream.result.logprobs[0])
    stats = stream.result.stats
    speculation = ""
    if stats.method != "plain" and stats.rounds == 0:  # the prefill's token ended the row: nothing was verified
        shape = f"k={stats.num_draft_tokens}" if stats.tree is None else f"tree {stats.tree}"
        speculation = f"{stats.drafter} {shape}: no verify round, "
    elif stats.method != "plain" and stats.tree is None:
        speculation = (f"{stats.drafter} k={stats.num_draft_tokens}: tau {stats.tau:.2f}, "
                       f"acceptance {stats.acceptance_rate:.0%}, ")
    elif stats.method != "plain":
        depths = " ".join(f"{n}:{rounds}" for n, rounds in enumerate(stats.accepted_depths))
        speculation = (f"{stats.drafter} tree {stats.tree}: tau {stats.tau:.2f}, accepted depth "
                       f"{stats.mean_accepted:.2f} per round (rounds by depth {depths}), ")
    rate = f"{stats.decode_tokens_per_second:.1f} tok/s decode" if stats.decode_tokens else "no decode step"
    print(
        f"\n[{stats.new_tokens} tokens, {rate}, {speculation}"
        f"prefill {stats.prompt_tokens} tokens in {stats.prefill_seconds:.2f} s, "
        f"compile {stats.compile_seconds:.1f} s, finish: {stream.result.finish_reason[0]}]",
        file=sys.stderr,
    )


def _print_logprobs(logprobs) -> None:
    """One line per generated token: the token, its log-prob, then the alternatives, best first
    (as text where the model has a tokenizer, else as ids)."""
    print("\n\nlog-probs (token, log-prob, then the most likely tokens there):")
    for entry in logprobs:
        shown = [repr(text) for text in entry.top_text] or [str(token) for token, _ in entry.top]
        alternatives = ", ".join(f"{name} {value:.4f}" for name, (_, value) in zip(shown, entry.top))
        own = repr(entry.text) if entry.text is not None else str(entry.token)
        print(f"  {own:>16} {entry.logprob:9.4f}" + (f"   | {alternatives}" if alternatives else ""))


def _score(args) -> None:
    model = api.load(args.model, weight_format=args.weight_format, products=args.products, progress=True)
    result = score(model, args.text)
    # The first token is context only; each later one is scored given everything before it.
    scored = [{"id": int(token), "text": model.tokenizer.decode([token], skip_special_tokens=False),
               "logprob": float(logprob)} for token, logprob in zip(result.tokens[0][1:], result.logprobs[0])]
    perplexity = float(result.perplexity[0])
    if args.json:
        print(json.dumps({"tokens": scored, "perplexity": perplexity}))
        return
    for token in scored:
        print(f"{token['logprob']:10.4f}  {json.dumps(token['text'], ensure_ascii=False)}")
    print(f"perplexity {perplexity:.4f} over {len(scored)} tokens")


CORPUS_HELP = "build (or resume) a draft head's training corpus: prompts, the model's answers, second turns"


def _corpus_parser() -> tuple[argparse.ArgumentParser, tuple[str, ...]]:
    """The corpus command's parser, and the names of its CorpusPlan flags (one per field: --magpie,
    --math, --prompts-file, --seq-len, ...; unset, each takes the plan's default)."""
    from jaxspec.train.corpus import CorpusPlan

    corpus = _OneLineParser(prog="python -m jaxspec.cli corpus", description=CORPUS_HELP)
    corpus.add_argument("--model", default=api.DEFAULT_MODEL, help="the target: a name, a .gguf file or a directory")
    corpus.add_argument("--out", required=True, help="the corpus directory (rerun the same command to resume)")
    corpus.add_argument("--weight-format", **WEIGHT_FORMAT_FLAG)
    corpus.add_argument("--status", action="store_true", help="print which stages are done and exit")
    kinds = {"int": int, "float": float, "str": str}
    fields = dataclasses.fields(CorpusPlan)
    for field in fields:
        kind = next(kind for word, kind in kinds.items() if word in str(field.type))
        flags = ["--" + field.name.replace("_", "-")] + (["--prompts"] if field.name == "prompts_file" else [])
        corpus.add_argument(*flags, dest=field.name, type=kind, default=None,
                            help=f"CorpusPlan.{field.name} (default {field.default})")
    return corpus, tuple(field.name for field in fields)


def _corpus(argv: list[str]) -> None:
    from jaxspec.train import corpus

    parser, plan_fields = _corpus_parser()
    args = parser.parse_args(argv)
    if args.status:
        print(json.dumps(corpus.corpus_status(args.out), indent=2))
        return
    given = {name: getattr(args, name) for name in plan_fields if getattr(args, name) is not None}
    plan = corpus.CorpusPlan(**given)
    model = api.load(args.model, weight_format=args.weight_format, progress=True)
    manifest = corpus.build_corpus(model, args.out, plan, progress=True)
    print(json.dumps(manifest, indent=2))


def _train_head(args) -> int:
    from jaxspec import train  # optax and orbax load only for training

    if args.export_head is not None:
        train.saved_run(args.out)  # a directory without a run is named before the target loads
        model = api.load(args.model, weight_format=args.weight_format, progress=True)
        path = train.export_head(model, args.out, args.export_head, step=args.export_step, head_dtype=args.head_dtype)
        print(f"exported the head of {args.out} -> {path}")
        return 0
    if args.export_step is not None:
        raise InvalidRequestError("--export-step names the checkpoint --export-head writes: give --export-head DEST")
    if args.prompts is not None and args.data is not None:
        raise InvalidRequestError("--prompts and --data both give the training data: pass one")
    prompts = None if args.resume or args.prompts is None else train.read_prompts_jsonl(args.prompts)
    if args.answer_window is not None and args.data is None:
        raise InvalidRequestError("--answer-window cuts the rows of --data: give --data FILE")
    if args.answer_window is not None and args.answer_window < 1:
        raise InvalidRequestError(f"--answer-window must be an integer >= 1; got {args.answer_window}")
    data = None if args.resume or args.data is None else train.load_datasets(args.data)
    if data is not None and args.answer_window is not None:
        data = data.cut_after_prompt(args.answer_window)
    config = None if args.resume else train.TrainConfig(
        method=args.method, steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr,
        warmup_steps=args.warmup_steps, ttt_steps=args.ttt_steps, soft_labels=args.soft_labels,
        labels=args.labels, cache_features=not (args.no_feature_cache or args.soft_labels),
        draft_vocab_size=args.draft_vocab_size, draft_vocab_coverage=args.draft_vocab_coverage,
        mtp_block_from_last_layer=not args.mtp_random_block, bucket_width=args.bucket_width,
        init_from=args.init_from, keep_init_vocab=args.keep_draft_vocab, compute_dtype=args.compute_dtype,
        val_fraction=args.val_fraction,
        eval_every=args.eval_every, save_every=args.save_every, seed=args.seed)
    result, stats = train.train_head(args.model, args.out, config, prompts=prompts, data=data, seq_len=args.seq_len,
                                     max_new_tokens=args.max_new_tokens, num_prompts=args.num_prompts,
                                     num_passage_prompts=args.num_passage_prompts,
                                     distill_batch_size=args.distill_batch_size, chat=args.chat, resume=args.resume,
                                     feature_dir=args.feature_cache, head_dtype=args.head_dtype,
                                     keep_every=args.keep_every, weight_format=args.weight_format)
    summary = f"{result.config.method.value} head: {result.step} steps"
    if result.validation is not None:
        summary += (f", validation loss {result.validation['loss']:.3f}, top-1 {result.validation['top1']:.3f} "
                    f"({result.validation['top1_new']:.3f} on new text)")
    if stats is not None:
        summary += (f"; tau {stats.tau:.2f} (k={stats.num_draft_tokens}, acceptance {stats.acceptance_rate:.0%}) "
                    f"on {stats.rows} held-out prompts")
    if result.interrupted is None:
        print(f"{summary} -> {result.head_path}")
        return 0
    # The resume command names what the run's directory does not keep: the target and where the features are.
    given = {"--model": args.model if args.model != api.DEFAULT_MODEL else None,
             "--weight-format": args.weight_format if args.weight_format != WeightFormat.AUTO.value else None,
             "--feature-cache": args.feature_cache, "--keep-every": args.keep_every, "--out": args.out}
    again = " ".join(f"{flag} {shlex.quote(str(value))}" for flag, value in given.items() if value is not None)
    print(f"{summary} of {result.config.steps}, stopped by {result.interrupted} and checkpointed; continue with: "
          f"python -m jaxspec.cli train-head {again} --resume")
    return 128 + signal.Signals[result.interrupted].value  # the shell's code for a run a signal ended


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unparsed = parser.parse_known_args(argv)
    if unparsed and args.command != "corpus":  # the corpus command parses its own (`_corpus_parser`)
        parser.error(f"unrecognized arguments: {' '.join(unparsed)}")
    try:
        if args.command == "generate":
            _generate(args)
        elif args.command == "score":
            _score(args)
        elif args.command == "info":
            print(json.dumps(checkpoints.info(args.model) | {"products": backends.describe_machine()}, indent=2))
        elif args.command == "convert":
            out = checkpoints.convert(args.source, args.output, overwrite=args.overwrite, progress=True,
                                      weight_format=args.weight_format)
            print(f"converted {args.source} -> {out}")
        elif args.command == "corpus":
            _corpus(unparsed)
        elif args.command == "train-head":
            return _train_head(args)
    except JaxspecError as error:
        message = in_cli_terms(error) if args.command == "generate" else str(error)
        print(f"error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
