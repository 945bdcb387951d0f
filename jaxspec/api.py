"""The public API: `load`, `generate`, `stream`, and what they return.

Everything a request can get wrong is checked on the host before anything is traced:
`GenerateOptions` checks the settings on their own, `prepare` checks them against the model
(prompt, token ids, lengths against the context, the draft against the target). Running a
prepared request is two jitted calls, prefill then the decode loop, each timed on the host;
compile time is measured apart (`jaxspec.compilation`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import checkpoints, compilation, models
from jaxspec import grammar as grammar_lib
from jaxspec.cache import KVFormat
from jaxspec.errors import InvalidRequestError, check_text, is_integer
from jaxspec.model import Model, check_trunk, layer_skip, lm_head_of, on_mesh_of, with_weight_format
from jaxspec.models import backends, quant
from jaxspec.models.backends import Products
from jaxspec.models.layers import AttentionParams, MlpParams, fuse_projections
from jaxspec.models.quant import WeightFormat
from jaxspec.options import GenerateOptions
from jaxspec.sampling import SamplingParams
from jaxspec.sharding import Plan, to_host
from jaxspec.spec import loop
from jaxspec.spec.drafters import mtp as mtp_drafter
from jaxspec.spec.drafting import DRAFTERS, drafter_of
from jaxspec.spec.methods import Method, Speculation, build
from jaxspec.tokenizer import Tokenizer

__all__ = ["DEFAULT_MODEL", "GenerateOptions", "GenerateResult", "Method", "Model", "Prepared", "SpecStats",
           "Stream", "TokenLogprob", "generate", "layer_skip", "lm_head_of", "load", "load_mtp", "prepare", "stream"]

DEFAULT_MODEL = "smollm2-135m"
# Lengths are bucketed so nearby values share one compiled program: prompts to a power of two
# (at least 16), max_new_tokens to a power of two of at least 128 (so 1..128 new tokens is one
# program; decode attention reads every slot, so the buckets stay powers of two, not one size).
MIN_PROMPT_BUCKET = 16
MIN_NEW_TOKENS_BUCKET = 128
MIN_STOP_IDS_BUCKET = 8  # stop token ids (EOS included) travel as a padded array
ROUND_ROOM = 64  # cache slots past the new tokens' bucket come in blocks of this many (prepare)

Message = Mapping[str, Any]  # {"role": "user" | "assistant" | "system" | ..., "content": str}
Prompt = (str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | Sequence[Message]
          | Sequence[Sequence[Message]])


class _Required:
    """The default of `prompt`: it follows the optional `draft_params` (so `generate(model,
    draft, prompt)` and `generate(model, prompt=...)` both work), where Python cannot mark an
    argument required. A call that leaves it out is refused by name (`_check_prompt_given`)."""

    def __repr__(self) -> str:
        return "<required>"


REQUIRED = _Required()


def load(name_or_path: str = DEFAULT_MODEL, *, weight_format: WeightFormat | str = WeightFormat.AUTO,
         products: Products | str = Products.AUTO, use_cache: bool = True, progress: bool = False) -> Model:
    """Load a model: "smollm2-135m" (the default), a GGUF file, an HF or a converted directory; or a
    draft head: "eagle3-smollm2-135m" (shipped), an EAGLE-3 head or a trained MTP head directory.

    `weight_format` (jaxspec.models.quant): "f32", "bf16", "int8" (W8A8 on CPU, W8A16 on GPU), "q4"
    (4-bit blocks, W4A8 on CPU), or
    "auto": f32 on CPU and bf16 on GPU (a converted directory: the format it stores). A draft
    loaded with "auto" runs in its target's format. Q/K/V and gate/up are fused into one product
    each (`layers.fuse_projections`).

    `products` (jaxspec.models.backends): which code computes the weight products. "auto": the
    native CPU kernels for f32, int8 and q4 weights on a CPU where they build, else XLA's; "xla";
    "native" (refused by name where it cannot serve). The Model's `products` says which it got.
    """
    weight_format = WeightFormat.parse(weight_format)
    products = Products.parse(products)
    for flag_name, value in (("use_cache", use_cache), ("progress", progress)):
        if not isinstance(value, bool):
            raise InvalidRequestError(f"load's {flag_name} must be True or False; got {value!r:.40}")
    path = checkpoints.resolve_model(name_or_path)
    head = _load_head_dir(path, weight_format)
    if head is not None:
        return head
    ckpt = checkpoints.load_checkpoint(path, use_cache=use_cache, progress=progress, weight_format=weight_format)
    tokenizer = ckpt.tokenizer  # a GGUF's, built from its header; None: from the source, or ids only
    if tokenizer is None:
        tokenizer = Tokenizer.from_checkpoint_source(ckpt.tokenizer_source, origin=ckpt.source)
    config, source, loaded = ckpt.config, str(ckpt.source), [ckpt.params]
    del ckpt  # `loaded` holds the only reference to the weights: _lay_out frees them as it goes
    return Model(config=config, params=_lay_out(loaded, products), tokenizer=tokenizer, source=source,
                 weight_format=weight_format)


def _lay_out(loaded: list, products: Products) -> Any:
    """The params `loaded` holds (its only reference; the list is emptied) with q/k/v and gate/up
    fused (`fuse_projections`) and every linear weight laid out for `products`, one attention or
    MLP block (or one weight outside them) at a time, each loaded piece dropped as soon as its
    replacement is built (`quant.map_linear_consuming`): a load then peaks near one copy of the
    weights, not three (loaded, fused, laid out)."""
    products = backends.resolve(products, quant.format_of(loaded[0]))

    def lay_out(piece: Any) -> Any:
        if isinstance(piece, AttentionParams | MlpParams):
            return backends.apply(fuse_projections(piece), products)
        return backends.apply_weight(piece, products)

    return quant.map_linear_consuming(loaded, lay_out, whole=(AttentionParams, MlpParams))


def _load_head_dir(path, weight_format: WeightFormat = WeightFormat.AUTO) -> Model | None:
    """A draft head directory of a registered drafter (an EAGLE-3 head, a Gemma 4 assistant, an MTP
    head trained by jaxspec.train) as a Model with no trunk and no tokenizer of its own; None when
    `path` is none. In AUTO it stays float32 until it runs beside a target (`with_weight_format`)."""
    checkpoint = next((d.checkpoint for d in DRAFTERS.values() if d.checkpoint and d.checkpoint.is_dir(path)), None)
    if checkpoint is None:
        return None
    config, params = checkpoint.load(path)
    if weight_format is not WeightFormat.AUTO:
        params = quant.convert(params, weight_format)
    return Model(config=config, params=fuse_projections(params), source=str(path), weight_format=weight_format)


def load_mtp(model_or_path: "Model | str") -> Model:
    """The MTP head an HF checkpoint carries (num_nextn_predict_layers): pass the target's
    directory, or the target `Model` loaded from it; or a head directory written by
    `jaxspec.train`. Generate with it as `draft_params`."""
    return mtp_drafter.load_head(model_or_path)


@dataclasses.dataclass(frozen=True)
class SpecStats:
    """Where the time went and how speculation did. Decode figures exclude prefill; compile
    time is reported apart. With no proposer, rounds are plain decode steps (tau = 1)."""

    method: str  # a Method value: "plain", "ngram", "draft", "layer_skip", "eagle3" or "mtp"
    num_draft_tokens: int  # k: the most drafts a round accepts (a tree's depth)
    rows: int
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float
    target_forwards: int  # decode forwards of the target: loop iterations, all rows at once
    rounds: int  # verify forwards summed over rows
    proposed: int  # real draft tokens proposed, summed over rows and rounds
    accepted: int  # draft tokens accepted
    multi_token_rounds: int  # rounds that committed more than one token
    acceptance_by_position: tuple[float, ...]  # P(draft i accepted | proposed), i = 1..k (a tree: depth i reached)
    accepted_depths: tuple[int, ...] = ()  # rounds (summed over rows) that accepted exactly n drafts, n = 0..k
    tree: str | None = None  # the draft tree's "depth,top_k,num_nodes"; None: a chain of k
    lookup_first: int | None = None  # the n-gram order prompt lookup drafted at, ahead of the method's drafter

    @property
    def drafter(self) -> str:
        """The method, with "+lookup" where prompt lookup drafted first (lookup_first)."""
        return self.method if self.lookup_first is None else f"{self.method}+lookup{self.lookup_first}"

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per round (tau - 1): a tree's accepted depth."""
        return self.accepted / self.rounds if self.rounds else math.nan

    @property
    def decode_tokens(self) -> int:
        # Each row's first token comes from the prefill forward; the rest from rounds.
        return self.new_tokens - self.rows

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else math.nan

    @property
    def tau(self) -> float:
        """Mean accepted length: committed tokens per round, the bonus token included."""
        return self.decode_tokens / self.rounds if self.rounds else math.nan

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else math.nan


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-prob (natural log) under the target's final distribution: the
    sampling processors (repetition penalty, temperature with 0 counted as 1, top-k / top-p /
    min-p, filtered tokens at -inf) and a grammar's mask applied, as `jaxspec.sampling.log_probs`
    computes it. At temperature 1 with no processors and no grammar it is the model's own
    log-softmax, which `jaxspec.score` reports for the same text."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the `logprobs` most likely (token id, log-prob) there, best first
    # The token's own text and each alternative's (special tokens spelled out; a token holding part
    # of a UTF-8 character reads U+FFFD); None and () for a model without a tokenizer.
    text: str | None = None
    top_text: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    tokens: list[list[int]]  # generated ids per row (an EOS that ended the row included)
    text: list[str] | None  # decoded per row (None without a tokenizer), stop strings cut off
    finish_reason: list[str]  # "stop" | "length" | "capacity"
    stats: SpecStats
    logprobs: list[list[TokenLogprob]] | None = None  # per row, per token in `tokens`; with logprobs=N


def _is_conversation(item) -> bool:
    """Whether `item` is a list of chat messages (its first element a mapping)."""
    return isinstance(item, Sequence) and not isinstance(item, str | bytes | bytearray) and bool(item) and (
        isinstance(item[0], Mapping))


def _conversation_ids(messages, model: Model, index: int, add_generation_prompt: bool) -> list[int]:
    """A conversation's ids through the model's chat template, each message checked by name."""
    if model.tokenizer is None or not model.tokenizer.chat_template:
        raise InvalidRequestError(f"prompt {index} is a list of messages, but this model's tokenizer has no chat "
                                  "template: pass the text (or token ids) instead")
    for turn, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"prompt {index}, message {turn} must be a dict with 'role' and 'content'; "
                                      f"got {message!r:.60}")
        for field in ("role", "content"):
            if not isinstance(message.get(field), str):
                raise InvalidRequestError(f"prompt {index}, message {turn} needs a string {field!r}; got "
                                          f"{message.get(field)!r:.60}")
            check_text(message[field], f"prompt {index}, message {turn}'s {field}")
    return model.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)


def prompt_ids(prompt, model: Model, chat: bool | None, *, add_generation_prompt: bool = True) -> list[list[int]]:
    """A prompt as a list of id lists. A prompt is a string, a list of {"role", "content"}
    messages (a conversation), token ids, or a batch of any of these. Strings are tokenized (with
    the chat template when `chat`; None: when the model's tokenizer has one); a conversation
    always goes through the chat template, whatever `chat` (ending with the assistant's cue
    unless `add_generation_prompt` is False); ids are checked against the vocabulary.
    InvalidRequestError names what is wrong."""
    if chat is None:
        chat = model.tokenizer is not None and bool(model.tokenizer.chat_template)
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if isinstance(prompt, bytes | bytearray):  # a Sequence of ints to Python, never token ids
        raise InvalidRequestError("prompt is bytes; pass a str (decode it first) or a list of token ids")
    if isinstance(prompt, Mapping):
        raise InvalidRequestError("prompt is one message; a conversation is a list of messages: [{'role': 'user', "
                                  "'content': ...}]")
    if isinstance(prompt, str) or _is_conversation(prompt):
        prompt = [prompt]
    if not isinstance(prompt, Sequence) or len(prompt) == 0:
        raise InvalidRequestError(f"prompt must be a non-empty string, list of messages or token ids, or a batch "
                                  f"of them; got {prompt!r:.80}")
    if all(is_integer(p) for p in prompt):
        prompt = [list(prompt)]
    rows = []
    for index, item in enumerate(prompt):
        if _is_conversation(item):
            ids = _conversation_ids(item, model, index, add_generation_prompt)
        elif isinstance(item, str):
            if model.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids, not text")
            if not item:
                raise InvalidRequestError(f"prompt {index} is an empty string")
            check_text(item, f"prompt {index}")
            ids = model.tokenizer.encode_chat(item) if chat else model.tokenizer.encode(item)
        elif (isinstance(item, (Sequence, np.ndarray)) and not isinstance(item, bytes | bytearray)
              and all(is_integer(t) for t in item)):
            ids = [int(t) for t in item]
        else:
            raise InvalidRequestError(f"prompt {index} must be a string, a list of messages or a list of token ids; "
                                      f"got {item!r:.80}")
        if not ids:
            raise InvalidRequestError(f"prompt {index} is empty")
        bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt {index} has token id {bad[0]} outside the vocabulary [0, {model.config.vocab_size})")
        rows.append(ids)
    return rows


def _bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A checked request, ready to run: the prompts as rows of ids, the per-call arrays, the
    static loop spec (changing any of it compiles a new program) and the resolved method."""

    rows: list[list[int]]
    request: loop.Request
    spec: loop.LoopSpec
    speculation: Speculation
    options: GenerateOptions

    @property
    def shape_summary(self) -> str:
        """What the compiled program is specialised to, for the compile notice."""
        batch, prompt_bucket = self.request.prompt.shape
        method = self.speculation.method.value
        k = f" k={self.spec.num_draft}" if self.spec.num_draft else ""
        if self.spec.tree is not None:
            k = f" tree {self.spec.tree}"
        return f"{method}{k}, batch {batch}, prompts up to {prompt_bucket} tokens, {self.spec.capacity} cache slots"


def _stop_ids_and_sequences(model: Model,
                            options: GenerateOptions) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Token ids that end a row, and multi-token stop sequences matched on device."""
    cfg = model.config
    stop_ids = set(options.stop_token_ids)
    for t in stop_ids:
        if t >= cfg.vocab_size:
            raise InvalidRequestError(f"stop token id {t} is outside the vocabulary [0, {cfg.vocab_size})")
    if not options.ignore_eos:
        stop_ids |= set(model.tokenizer.eos_token_ids if model.tokenizer is not None else cfg.eos_token_ids)
    sequences = []
    if options.stop and model.tokenizer is None:
        raise InvalidRequestError("stop strings need a tokenizer; pass stop_token_ids instead")
    for text in options.stop:
        ids = tuple(model.tokenizer.encode(text, add_special_tokens=False))
        # On device we stop on the string's own tokenization; the text is cut on the host too,
        # which catches the string however it was tokenized.
        if len(ids) == 1:
            stop_ids.add(ids[0])
        elif ids:
            sequences.append(ids)
    return tuple(sorted(stop_ids)), tuple(sequences)


def memory_bytes() -> int:
    """The memory a KV cache can live in: the default device's (a GPU's bytes_limit), else the
    host's physical memory."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_cache_fits(cfg, kv_format: KVFormat | None, batch: int, capacity: int, plan: Plan | None = None) -> None:
    """Refuse a request whose target KV cache alone exceeds the memory it would be allocated in:
    a long context and a large max_new_tokens would otherwise fail (or take the machine down)
    deep inside the compiled program. On a mesh, what one device holds of it."""
    kv_format = kv_format or KVFormat()
    needed = batch * capacity * kv_format.bytes_per_token(cfg)
    if plan is not None:
        needed //= plan.data_size * plan.axis_size("kv_heads")
    available = memory_bytes()
    if needed > available:
        raise InvalidRequestError(
            f"the KV cache for {batch} row(s) x {capacity} slots needs {needed / 2**30:.1f} GiB, more than the "
            f"{available / 2**30:.1f} GiB this device has; lower max_new_tokens or the batch, or pick a smaller "
            f"kv_format (q8_0, q5_1)")


def _check_prompt_given(draft_params, prompt) -> None:
    """Refuse a call with no prompt, naming where it goes; a prompt passed second, in the draft's
    place (`generate(model, "Hi")`), is named as that."""
    if prompt is not REQUIRED:
        return
    if draft_params is not None and not isinstance(draft_params, Model):
        raise InvalidRequestError(
            f"no prompt given, and draft_params is a {type(draft_params).__name__}, not a Model: the second "
            "argument is the draft; pass the prompt by name, generate(model, prompt=...), or third, "
            "generate(model, None, prompt)")
    raise InvalidRequestError("no prompt given: pass it by name, generate(model, prompt=...), or third, "
                              "generate(model, draft_params, prompt)")


def prepare(model: Model, draft_params: Model | None = None, prompt: Prompt = REQUIRED, *,
            options: GenerateOptions | None = None, **overrides) -> Prepared:
    """Check a request against `model` and build what the jitted program takes; raises
    InvalidRequestError (or the error the draft or the KV format names) before any tracing.
    Arguments as `generate`'s; `options`, or the GenerateOptions fields as keyword arguments."""
    _check_prompt_given(draft_params, prompt)
    if options is None:
        options = GenerateOptions.from_kwargs(**overrides)
    elif overrides:
        options = dataclasses.replace(options, **overrides)
    if not isinstance(model, Model):
        raise InvalidRequestError(f"model must be a jaxspec Model (from jaxspec.load); got {type(model).__name__}")
    check_trunk(model, "the target")
    cfg = model.config
    if options.kv_format is not None:
        options.kv_format.check(cfg)
    method = options.method if options.method is not None else Method.infer(draft_params)
    default_draft = drafter_of(method).default_draft
    if draft_params is None and default_draft is not None:  # e.g. the MTP head the target's checkpoint carries
        draft_params = default_draft(model)
    if isinstance(draft_params, Model):
        draft_params = on_mesh_of(with_weight_format(draft_params, model), model)
    plan = model.sharding
    sampler = options.sampler
    speculation = build(method, model, draft_params, options.draft_options, sampler)
    k = speculation.num_draft
    rows = prompt_ids(prompt, model, options.chat)
    longest, max_new_tokens = max(len(r) for r in rows), int(options.max_new_tokens)
    # A round writes k + 1 slots (a tree: 1 + num_nodes, or its drafter's scratch slots), padded
    # to the weights' token lanes where the trunk takes filler tokens (a recurrent one does not).
    lanes = model.products.token_lanes if models.family_of(cfg).takes_filler_tokens else 1
    round_width = loop.round_width(speculation.proposer, lanes)
    reach = k if options.tree is None else round_width - 1
    for whose, context in speculation.context_limits(model):
        if longest + max_new_tokens + reach > context:
            drafts = f" + num_draft_tokens ({k})" if k else ""
            if options.tree is not None:
                drafts = f" + the tree's {reach} slots per round (tree {options.tree})"
            raise InvalidRequestError(
                f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}){drafts} exceeds the {whose} "
                f"context of {context} tokens")
    stop_token_ids, stop_sequences = _stop_ids_and_sequences(model, options)
    grammars = _grammars(model, options, len(rows))  # compiled on the host, before anything is traced

    # On a mesh the batch is padded to whole "data" shards with one-token rows that end at once.
    data_rows = 1 if plan is None else plan.data_size
    batch = -(-len(rows) // data_rows) * data_rows
    sampling = options.sampling_rows(len(rows), batch)  # a per-row list of another length: refused by name
    stop_ids = np.full((_bucket(len(stop_token_ids), MIN_STOP_IDS_BUCKET),), -1, np.int32)  # -1 never matches
    stop_ids[: len(stop_token_ids)] = stop_token_ids
    prompt_bucket = _bucket(longest, MIN_PROMPT_BUCKET)
    # Decode attention reads all S slots every step, so S is the prompt bucket plus a bucket of
    # the new tokens plus room for a round's writes, not a power of two of the sum (1024 + 132
    # would become 2048). The room is whole blocks of ROUND_ROOM slots, so plain decoding and a
    # speculative run of up to ROUND_ROOM - 1 drafts share S: attention sums over all S slots, and
    # a step's logits are bitwise a verify's only at the same S (width-invariant products).
    room = -(-round_width // ROUND_ROOM) * ROUND_ROOM
    capacity = min(prompt_bucket + _bucket(max_new_tokens, MIN_NEW_TOKENS_BUCKET) + room, cfg.max_position_embeddings)
    _check_cache_fits(cfg, options.kv_format, batch, capacity, plan)
    padded = np.zeros((batch, prompt_bucket), np.int32)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    filler_rows = batch - len(rows)
    request = loop.Request(
        prompt=jnp.asarray(padded),
        prompt_length=jnp.asarray([len(r) for r in rows] + [1] * filler_rows, jnp.int32),
        max_new_tokens=jnp.asarray([max_new_tokens] * len(rows) + [1] * filler_rows, jnp.int32),
        sampling=SamplingParams.create(batch, **sampling),
        key=jax.random.PRNGKey(options.seed),
        stop_token_ids=jnp.asarray(stop_ids),
    )
    if grammars is not None:
        table, starts = grammar_lib.build_table(grammars + [None] * filler_rows, cfg.vocab_size)
        request = request.replace(grammar=table, grammar_start=jnp.asarray(starts, jnp.int32))
    if plan is not None:
        request = _placed(request, plan)
    spec = loop.LoopSpec(
        cfg=cfg,
        capacity=capacity,
        sampler=sampler,
        stop_sequences=stop_sequences,
        proposer=speculation.proposer,
        kv_format=options.kv_format,
        attention=options.attention.value,
        token_lanes=lanes,
        sharding=plan,
        draft_sharding=draft_params.sharding if isinstance(draft_params, Model) else None,
        logprobs=options.logprobs,
    )
    return Prepared(rows=rows, request=request, spec=spec, speculation=speculation, options=options)


def _grammars(model: Model, options: GenerateOptions, rows: int) -> list | None:
    """Each row's compiled grammar (None for a free row), or None when no row has one."""
    if not options.constrained:
        return None
    if model.tokenizer is None:
        raise InvalidRequestError("constrained generation (regex, json_schema, choices) needs the model's tokenizer")
    compiled = []
    for row_grammar in options.grammars(rows):
        if row_grammar is None:
            compiled.append(None)
            continue
        kind, source = row_grammar
        compiled.append(grammar_lib.compile_grammar(model.tokenizer, model.config.vocab_size, **{kind: source}))
    return compiled


def _placed(request: loop.Request, plan: Plan) -> loop.Request:
    """The request on the plan's mesh: per-row arrays by rows over "data", the key and the stop
    ids on every device. From host copies, so every process of a multi-host mesh places the
    same values."""
    host = to_host(request)
    per_row = (host.prompt, host.prompt_length, host.max_new_tokens, host.sampling)
    prompt, prompt_length, max_new_tokens, sampling = jax.device_put(
        per_row, jax.tree.map(lambda leaf: plan.rows(leaf.ndim), per_row))
    key, stop_token_ids, grammar = jax.device_put((host.key, host.stop_token_ids, host.grammar), plan.replicated)
    grammar_start = None if host.grammar_start is None else jax.device_put(host.grammar_start, plan.rows(1))
    return loop.Request(prompt=prompt, prompt_length=prompt_length, max_new_tokens=max_new_tokens,
                        sampling=sampling, key=key, stop_token_ids=stop_token_ids, grammar=grammar,
                        grammar_start=grammar_start)


def _cut_at_stop(text: str, stop_strings: tuple[str, ...]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _stats(prepared: Prepared, state: loop.DecodeState, *, prefill_seconds, decode_seconds,
           compile_seconds, rows) -> SpecStats:
    counters, num_generated, target_forwards = to_host((state.stats, state.num_generated, state.target_forwards))
    proposed_at, accepted_at = counters.proposed_at, counters.accepted_at
    return SpecStats(
        method=prepared.speculation.method.value,
        num_draft_tokens=prepared.spec.num_draft,
        rows=rows,
        prompt_tokens=sum(len(r) for r in prepared.rows[:rows]),
        new_tokens=int(num_generated[:rows].sum()),
        prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds,
        compile_seconds=compile_seconds,
        target_forwards=int(target_forwards),
        rounds=int(counters.rounds.sum()),
        proposed=int(counters.proposed.sum()),
        accepted=int(counters.accepted.sum()),
        multi_token_rounds=int(counters.multi_token_rounds.sum()),
        acceptance_by_position=tuple(float(a / p) if p else math.nan for a, p in zip(accepted_at, proposed_at)),
        accepted_depths=tuple(int(n) for n in counters.accepted_hist),
        tree=None if prepared.spec.tree is None else str(prepared.spec.tree),
        lookup_first=prepared.options.lookup_first,
    )


def _logprobs(state: loop.DecodeState, rows: int, tokenizer: Tokenizer | None) -> list[list[TokenLogprob]] | None:
    """Each of the first `rows` rows' generated tokens with their log-probs (and, with a tokenizer,
    their texts), copied to the host."""
    if state.logprobs is None:
        return None
    history, starts, counts, logprobs = to_host((state.tokens, state.prompt_length, state.num_generated,
                                                 state.logprobs))

    def text(token: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([token], skip_special_tokens=False)

    result = []
    for row in range(rows):
        entries = []
        for at in range(starts[row], starts[row] + counts[row]):
            token, top_ids = int(history[row, at]), [int(t) for t in logprobs.top_ids[row, at]]
            entries.append(TokenLogprob(
                token=token, logprob=float(logprobs.chosen[row, at]),
                top=tuple(zip(top_ids, map(float, logprobs.top_logprobs[row, at]))), text=text(token),
                top_text=() if tokenizer is None else tuple(map(text, top_ids))))
        result.append(entries)
    return result


def _finish(model: Model, prepared: Prepared, tokens: list[list[int]], reasons: list[str],
            stats: SpecStats, logprobs: list[list[TokenLogprob]] | None = None) -> GenerateResult:
    texts = None
    if model.tokenizer is not None and jax.process_index() == 0:  # multi-host: process 0 detokenizes
        texts = []
        for row, ids in enumerate(tokens):
            text, was_cut = _cut_at_stop(model.tokenizer.decode(ids), prepared.options.stop)
            texts.append(text)
            if was_cut:
                reasons[row] = "stop"
    return GenerateResult(tokens=tokens, text=texts, finish_reason=reasons, stats=stats, logprobs=logprobs)


def _timed(call, what: str):
    """Run `call()` to completion: (its result, run seconds, compile seconds within it)."""
    with compilation.CompileWatch(what) as watch:
        start = time.perf_counter()
        result = jax.block_until_ready(call())
        elapsed = time.perf_counter() - start
    return result, max(elapsed - watch.seconds, 0.0), watch.seconds


def generate(model: Model, draft_params: Model | None = None, prompt: Prompt = REQUIRED,
             **options) -> GenerateResult:
    """Generate from `model` on device: one jitted prefill, then one jitted `lax.while_loop`.

    `prompt` (required: third, `generate(model, draft, prompt)`, or by name,
    `generate(model, prompt=...)`) is a string, a conversation (a list of {"role", "content"}
    messages), token ids, or a batch (a list) of any of these. A string goes through the model's
    chat template where its tokenizer has one (`chat=None`, the default, as in the CLI);
    `chat=False` encodes it raw. A conversation always goes through the template (a model
    without one refuses it by name).
    `options` are the fields of `GenerateOptions`, which holds their defaults and checks them.
    Speculation: `method` is "ngram" (prompt lookup), "draft" (`draft_params`, a model sharing
    the vocabulary), "layer_skip" (the target's first `exit_layer` layers; default half),
    "eagle3" (`draft_params`, an EAGLE-3 head), "mtp" (`draft_params` from `load_mtp`, by default
    the head the target's own checkpoint carries), or inferred from `draft_params`;
    `num_draft_tokens` (k, default 4) per round, or a `tree` (it drafts to its depth);
    `lookup_first=n` puts prompt lookup in front of an eagle3, mtp or assistant drafter (rows
    whose last n tokens occurred earlier draft the lookup's continuation). Greedy speculative
    output equals plain greedy output token for token.
    Sampling at temperature > 0 with the given filters and `seed` (same seed, same output);
    with a proposer, verification is lossless rejection sampling, and draft models draw their
    drafts from their own distribution (`draft_sampling="sample"`, the default) or propose
    their argmax (`"argmax"`).
    Rows stop at EOS, a stop token or string, or `max_new_tokens`.
    KV cache: `kv_format` stores the target's K and V as "f32" (default), "bf16", "q8_0" or
    "q5_1", one name for both or a (K, V) pair such as ("q8_0", "q5_1"); `attention` is "auto"
    (jaxspec.cpu's native kernel where the weights run on the native CPU backend, XLA's attention
    elsewhere), "reference", "native", or the Pallas kernel by name, "pallas" (GPU) or "interpret".
    The first call for a shape compiles (a `preparing ...` line on stderr says how long, and
    whether the program came from the disk cache: `jaxspec.compilation`); compiled programs
    persist on disk across runs.
    """
    prepared = prepare(model, draft_params, prompt, **options)
    compilation.enable_persistent_cache()
    draft = prepared.speculation.draft_inputs(model)
    args, spec = (model.params, draft), prepared.spec
    state, prefill_seconds, compile_prefill = _timed(
        lambda: loop.prefill_in_two(*args, prepared.request, spec=spec), f"prefill [{prepared.shape_summary}]")
    state, decode_seconds, compile_decode = _timed(
        lambda: loop.decode_jit(*args, state, prepared.request, spec=spec), f"decode loop [{prepared.shape_summary}]")

    rows = len(prepared.rows)
    reasons = [loop.FINISH_NAMES[int(r)] for r in to_host(state.finish_reason)[:rows]]
    stats = _stats(prepared, state, prefill_seconds=prefill_seconds, decode_seconds=decode_seconds,
                   compile_seconds=compile_prefill + compile_decode, rows=rows)
    return _finish(model, prepared, loop.generated_tokens(state, rows), reasons, stats,
                   _logprobs(state, rows, model.tokenizer))


class Stream:
    """Iterates over text (or, without a tokenizer, token ids) as tokens are committed.

    After iteration, `.result` holds the `GenerateResult`. One prompt; any method. Each round
    copies only its newly committed tokens to the host.
    """

    def __init__(self, model: Model, draft_params: Model | None = None, prompt: Prompt = REQUIRED, **options):
        self._model = model
        self._prepared = prepare(model, draft_params, prompt, **options)
        if len(self._prepared.rows) != 1:
            raise InvalidRequestError("stream() takes one prompt; use generate() for a batch")
        self.result: GenerateResult | None = None

    def __iter__(self) -> Iterator[str | int]:
        model, prepared = self._model, self._prepared
        compilation.enable_persistent_cache()
        args, spec, request = (model.params, prepared.speculation.draft_inputs(model)), prepared.spec, prepared.request
        stop_strings = prepared.options.stop
        decoder = model.tokenizer.stream_decoder() if model.tokenizer is not None else None
        # Text not yet yielded: with stop strings, the tail that could begin one is held back.
        hold = max((len(s) for s in stop_strings), default=1) - 1
        unsent, stopped_by_string = "", False
        generated: list[int] = []

        state, prefill_seconds, compile_seconds = _timed(
            lambda: loop.prefill_in_two(*args, request, spec=spec), f"prefill [{prepared.shape_summary}]")
        decode_seconds = 0.0

        def round_after(state):
            nonlocal decode_seconds, compile_seconds
            (state, committed), seconds, compiling = _timed(
                lambda: loop.stream_step_jit(*args, state, request, spec=spec),
                f"decode round [{prepared.shape_summary}]")
            decode_seconds, compile_seconds = decode_seconds + seconds, compile_seconds + compiling
            committed = to_host(committed)  # k + 1 tokens, not the [1, S] history
            return state, committed.tokens[0, : committed.count[0]].tolist(), bool(committed.running[0])

        pending, running = to_host((state.pending, state.running))
        new, running = [int(pending[0])], bool(running[0])
        if running:
            # The first round runs (compiling its program) before any text is shown, so both
            # programs' compile notices come before the answer instead of inside its first line.
            state, first_round, running = round_after(state)
            new += first_round
        while True:
            generated += new
            if decoder is None:
                yield from new
            else:
                unsent += "".join(decoder.feed(token) for token in new)
                unsent, stopped_by_string = _cut_at_stop(unsent, stop_strings)
                ready = len(unsent) if stopped_by_string else len(unsent) - hold
                if ready > 0:
                    yield unsent[:ready]
                    unsent = unsent[ready:]
            if stopped_by_string or not running:
                break
            state, new, running = round_after(state)
        if decoder is not None and not stopped_by_string:
            unsent += decoder.flush()  # a trailing incomplete character, if generation ended mid-way
        if unsent:
            yield unsent
        reasons = ["stop" if stopped_by_string else loop.FINISH_NAMES[int(to_host(state.finish_reason)[0])]]
        stats = _stats(prepared, state, prefill_seconds=prefill_seconds, decode_seconds=decode_seconds,
                       compile_seconds=compile_seconds, rows=1)
        logprobs = _logprobs(state, 1, model.tokenizer)
        if logprobs is not None:  # a stop string can end the stream before the state's last token
            logprobs = [logprobs[0][: len(generated)]]
        self.result = _finish(model, prepared, [generated], reasons, stats, logprobs)


def stream(model: Model, draft_params: Model | None = None, prompt: Prompt = REQUIRED, **options) -> Stream:
    """Like `generate` (the same arguments) for one prompt (any method), but yields text deltas as
    they are committed. `options` are the fields of `GenerateOptions`."""
    return Stream(model, draft_params, prompt, **options)
