"""The public API: `load`, `generate`, `stream`, and what they return.

Everything a request can get wrong is checked here, on the host, before anything is traced: a
bad prompt, token ids out of range, lengths past the context, sampling parameters out of range.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import checkpoints
from jaxspec.cache import KVFormat
from jaxspec.config import ModelConfig
from jaxspec.pallas.flash_decode import Attention, resolve_attention
from jaxspec.errors import InvalidRequestError
from jaxspec.sampling import SamplingParams, spec_for
from jaxspec.models import eagle3, mtp
from jaxspec.spec import loop, proposers
from jaxspec.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"
MIN_PROMPT_BUCKET = 16


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """What `load` returns and `generate` takes: config (static), params (arrays), tokenizer."""

    config: ModelConfig
    params: Any  # the trunk's params pytree (see jaxspec.models.llama)
    tokenizer: Tokenizer | None = None
    source: str | None = None


def load(name_or_path: str = DEFAULT_MODEL, *, use_cache: bool = True, progress: bool = False) -> Model:
    """Load a model: "smollm2-135m" (the default), a GGUF file, an HF or a converted directory; or a
    draft head: "eagle3-smollm2-135m" (shipped), an EAGLE-3 head or a trained MTP head directory."""
    path = checkpoints.resolve_model(name_or_path)
    head = _load_head_dir(path)
    if head is not None:
        return head
    ckpt = checkpoints.load_checkpoint(path, use_cache=use_cache, progress=progress)
    tokenizer = Tokenizer.from_checkpoint_source(ckpt.tokenizer_source)  # None: token-id prompts only
    return Model(config=ckpt.config, params=ckpt.params, tokenizer=tokenizer, source=str(ckpt.source))


def _load_head_dir(path) -> Model | None:
    """A draft head directory (EAGLE-3, or an MTP head trained by jaxspec.train) as a Model with
    no trunk and no tokenizer of its own; None when `path` is not one."""
    if checkpoints.is_eagle3_dir(path):
        config, params = checkpoints.load_eagle3(path)
    elif checkpoints.is_mtp_head_dir(path):
        config, params = checkpoints.load_mtp_head(path)
    else:
        return None
    return Model(config=config, params=params, source=str(path))


def load_mtp(model_or_path: "Model | str") -> Model:
    """The MTP head an HF checkpoint carries (num_nextn_predict_layers): pass the target's
    directory, or the target `Model` loaded from it; or a head directory written by
    `jaxspec.train`. Generate with it as `draft_params`."""
    source = model_or_path.source if isinstance(model_or_path, Model) else model_or_path
    if source is None:
        raise InvalidRequestError("this model has no source directory to read an MTP head from")
    path = checkpoints.resolve_model(source)
    if checkpoints.is_mtp_head_dir(path):  # a head trained by jaxspec.train, on its own
        return _load_head_dir(path)
    if not checkpoints.has_mtp(path):
        raise InvalidRequestError(
            f"{path} carries no MTP head: an HF directory whose config.json declares num_nextn_predict_layers")
    config, params = checkpoints.load_mtp(path)
    return Model(config=config, params=params, source=str(path))


@dataclasses.dataclass(frozen=True)
class SpecStats:
    """Where the time went and how speculation did. Decode figures exclude prefill; compile
    time is reported apart. With no proposer, rounds are plain decode steps (tau = 1)."""

    method: str  # one of METHODS
    num_draft_tokens: int  # k
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
    acceptance_by_position: tuple[float, ...]  # P(draft i accepted | proposed), i = 1..k

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
class GenerateResult:
    tokens: list[list[int]]  # generated ids per row (an EOS that ended the row included)
    text: list[str] | None  # decoded per row (None without a tokenizer), stop strings cut off
    finish_reason: list[str]  # "stop" | "length" | "capacity"
    stats: SpecStats


def layer_skip(model: Model, exit_layer: int) -> Model:
    """Self-speculation draft: the target's first `exit_layer` layers, then its final norm and
    head (LayerSkip; HF's `assistant_early_exit`). Shares the target's weight arrays."""
    layers = model.config.num_layers
    if not isinstance(exit_layer, (int, np.integer)) or not 1 <= exit_layer < layers:
        raise InvalidRequestError(f"exit_layer must be an integer in [1, {layers}); got {exit_layer!r}")
    params = dataclasses.replace(model.params, layers=model.params.layers[:exit_layer])
    config = dataclasses.replace(model.config, num_layers=int(exit_layer))
    return Model(config=config, params=params, tokenizer=model.tokenizer,
                 source=f"layer_skip({model.source}, exit_layer={exit_layer})")


def _bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def _as_batch(prompt, model: Model, chat: bool) -> list[list[int]]:
    """Normalise a prompt (str, list of str, ids, batch of ids) to a list of id lists."""
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, Sequence) or len(prompt) == 0:
        raise InvalidRequestError(f"prompt must be a non-empty string, list of strings or token ids; got {prompt!r:.80}")
    if all(isinstance(p, (int, np.integer)) for p in prompt):
        prompt = [list(prompt)]
    rows = []
    for index, item in enumerate(prompt):
        if isinstance(item, str):
            if model.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids, not text")
            if not item:
                raise InvalidRequestError(f"prompt {index} is an empty string")
            ids = model.tokenizer.encode_chat(item) if chat else model.tokenizer.encode(item)
        elif isinstance(item, (Sequence, np.ndarray)) and all(isinstance(t, (int, np.integer)) for t in item):
            ids = [int(t) for t in item]
        else:
            raise InvalidRequestError(f"prompt {index} must be a string or a list of token ids; got {item!r:.80}")
        if not ids:
            raise InvalidRequestError(f"prompt {index} is empty")
        bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt {index} has token id {bad[0]} outside the vocabulary [0, {model.config.vocab_size})")
        rows.append(ids)
    return rows


def _check_sampling(temperature, top_k, top_p, min_p, repetition_penalty) -> None:
    checks = [
        (temperature, lambda v: v >= 0 and math.isfinite(v), "temperature must be >= 0"),
        (top_p, lambda v: 0 < v <= 1, "top_p must be in (0, 1]"),
        (top_k, lambda v: v >= 0 and float(v).is_integer(), "top_k must be an integer >= 0 (0 disables)"),
        (min_p, lambda v: 0 <= v <= 1, "min_p must be in [0, 1]"),
        (repetition_penalty, lambda v: v > 0 and math.isfinite(v), "repetition_penalty must be > 0"),
    ]
    for value, ok, message in checks:
        for v in np.atleast_1d(np.asarray(value, dtype=np.float64)):
            if not ok(float(v)):
                raise InvalidRequestError(f"{message}; got {float(v)!r}")


METHODS = ("plain", "ngram", "draft", "layer_skip", "eagle3", "mtp")
MAX_DRAFT_TOKENS = 32  # beyond this a round costs far more than any acceptance can repay


@dataclasses.dataclass(frozen=True)
class _Prepared:
    rows: list[list[int]]
    request: loop.Request
    spec: loop.LoopSpec
    draft: Model | None
    method: str
    stop_strings: tuple[str, ...]


DRAFT_SAMPLING = ("sample", "argmax")


def _proposer(model: Model, draft_params, method, num_draft_tokens, ngram_max, ngram_min,
              exit_layer, draft_sampling, sampler) -> tuple[str, proposers.Proposer | None, Model | None]:
    """Resolve `method` (or infer it from `draft_params`) to a proposer and its draft model."""
    if method is None:
        if draft_params is None:
            method = "plain"
        else:
            method = {eagle3.Eagle3Config: "eagle3", mtp.MtpConfig: "mtp"}.get(
                type(getattr(draft_params, "config", None)), "draft")
    if method not in METHODS:
        raise InvalidRequestError(f"method must be one of {METHODS}; got {method!r}")
    if method == "plain":
        if draft_params is not None:
            raise InvalidRequestError("method='plain' takes no draft_params")
        return method, None, None
    k = num_draft_tokens
    if not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise InvalidRequestError(f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}]; got {k!r}")
    if draft_sampling not in (None, *DRAFT_SAMPLING):
        raise InvalidRequestError(f"draft_sampling must be one of {DRAFT_SAMPLING}; got {draft_sampling!r}")
    if method == "ngram":
        if draft_sampling == "sample":
            raise InvalidRequestError(
                "prompt lookup proposes copied tokens, not samples: it has no q for draft_sampling='sample'")
        if draft_params is not None:
            raise InvalidRequestError("method='ngram' (prompt lookup) takes no draft_params")
        if not (isinstance(ngram_min, int) and isinstance(ngram_max, int) and 1 <= ngram_min <= ngram_max <= 16):
            raise InvalidRequestError(f"need 1 <= ngram_min <= ngram_max <= 16; got {ngram_min}, {ngram_max}")
        return method, proposers.PromptLookup(num_draft=int(k), ngram_max=ngram_max, ngram_min=ngram_min), None
    if method == "eagle3":
        return method, _eagle3_proposer(model, draft_params, int(k), draft_sampling, sampler), draft_params
    if method == "mtp":
        if draft_params is None:  # the head the target's own checkpoint carries
            draft_params = load_mtp(model)
        return method, _mtp_proposer(model, draft_params, int(k), draft_sampling, sampler), draft_params
    if method == "layer_skip":
        if draft_params is None:
            draft_params = layer_skip(model, exit_layer if exit_layer is not None else model.config.num_layers // 2)
    elif draft_params is None:
        raise InvalidRequestError("method='draft' needs draft_params: a model from jaxspec.load")
    if not isinstance(draft_params, Model):
        raise InvalidRequestError(f"draft_params must be a jaxspec Model (from jaxspec.load); got {type(draft_params).__name__}")
    if draft_params.config.vocab_size != model.config.vocab_size:
        raise InvalidRequestError(
            f"the draft's vocabulary ({draft_params.config.vocab_size}) differs from the target's "
            f"({model.config.vocab_size}); a draft model must share the target's tokenizer")
    # At temperature > 0 drafts are sampled from the draft's own distribution unless asked for
    # argmax; greedy requests always draft argmax.
    sample = not sampler.greedy and draft_sampling != "argmax"
    proposer = proposers.DraftModel(num_draft=int(k), config=draft_params.config, sample=sample,
                                    sampler=sampler if sample else None)
    return method, proposer, draft_params


def _check_head(model: Model, head, config_class, method: str, name: str, how_to_load: str):
    """A draft head's config, checked against its target (hidden size, vocabulary) before tracing."""
    if not isinstance(head, Model) or not isinstance(head.config, config_class):
        raise InvalidRequestError(f"method={method!r} needs draft_params: an {name} head from {how_to_load}")
    cfg, target = head.config, model.config
    if cfg.dim != target.dim:
        raise InvalidRequestError(f"the {name} head's hidden_size ({cfg.dim}) differs from the target's ({target.dim})")
    if cfg.vocab_size != target.vocab_size:
        raise InvalidRequestError(
            f"the {name} head's vocabulary ({cfg.vocab_size}) differs from the target's ({target.vocab_size})")
    return cfg


def _eagle3_proposer(model: Model, head: Model | None, k: int, draft_sampling, sampler) -> proposers.Eagle3:
    cfg = _check_head(model, head, eagle3.Eagle3Config, "eagle3", "EAGLE-3", "jaxspec.load(HEAD_DIR)")
    layers = model.config.num_layers
    aux = cfg.resolved_aux_layers(layers)
    if len(aux) != 3 or any(not 0 <= i < layers for i in aux):
        raise InvalidRequestError(f"EAGLE-3 aux layer ids {aux} must be three layer indices in [0, {layers}) of the target")
    sample = not sampler.greedy and draft_sampling != "argmax"
    return proposers.Eagle3(num_draft=k, config=cfg, aux_layer_ids=tuple(aux), sample=sample,
                            sampler=sampler if sample else None)


def _mtp_proposer(model: Model, head: Model, k: int, draft_sampling, sampler) -> proposers.Mtp:
    cfg = _check_head(model, head, mtp.MtpConfig, "mtp", "MTP", "jaxspec.load_mtp(MODEL_DIR)")
    sample = not sampler.greedy and draft_sampling != "argmax"
    return proposers.Mtp(num_draft=k, config=cfg, target_layers=model.config.num_layers, sample=sample,
                         sampler=sampler if sample else None)


def lm_head_of(model: Model) -> jax.Array:
    """The target's output projection [V, D]: its embedding when tied. An MTP head speaks through it."""
    return model.params.embed if model.config.tie_embeddings else model.params.lm_head


def _draft_arguments(model: Model, prepared: "_Prepared"):
    """What the jitted program receives as draft_params: a draft trunk's params, or a head's
    params with the target's embedding (and, for MTP, its lm_head) beside them."""
    if prepared.draft is None:
        return None
    if prepared.method == "eagle3":
        return {"head": prepared.draft.params, "embed": model.params.embed}
    if prepared.method == "mtp":
        return {"head": prepared.draft.params, "embed": model.params.embed, "lm_head": lm_head_of(model)}
    return prepared.draft.params


def _prepare(model: Model, prompt, *, draft_params=None, method=None, num_draft_tokens=4, ngram_max=3,
             ngram_min=1, exit_layer=None, draft_sampling=None, max_new_tokens, temperature, top_k,
             top_p, min_p, repetition_penalty, seed, chat, stop, stop_token_ids, ignore_eos,
             kv_format=None, attention="auto") -> _Prepared:
    cfg = model.config
    attention = Attention.parse(attention)
    if attention is not Attention.AUTO:
        resolve_attention(attention)  # "pallas" off a GPU: a named error now, not at trace time
    if kv_format is not None:
        kv_format = KVFormat.parse(kv_format)
    if (kv_format is not None or attention is not Attention.AUTO) and not isinstance(cfg, ModelConfig):
        raise InvalidRequestError(
            f"kv_format and attention apply to Llama-family trunks; this model is {type(cfg).__name__}")
    if kv_format is not None:
        kv_format.check(cfg)
    _check_sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    sampler = spec_for(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                       repetition_penalty=repetition_penalty)
    method, proposer, draft = _proposer(model, draft_params, method, num_draft_tokens, ngram_max,
                                        ngram_min, exit_layer, draft_sampling, sampler)
    k = 0 if proposer is None else proposer.num_draft
    rows = _as_batch(prompt, model, chat)
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")
    longest = max(len(r) for r in rows)
    contexts = [("model's", cfg.max_position_embeddings)]
    if isinstance(proposer, proposers.Mtp):  # a sliding-window MTP block serves up to its window
        contexts.append(("MTP head's", proposer.config.block.max_position_embeddings))
    for whose, context in contexts:
        if longest + max_new_tokens + k > context:
            drafts = f" + num_draft_tokens ({k})" if k else ""
            raise InvalidRequestError(
                f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}){drafts} exceeds the {whose} "
                f"context of {context} tokens")
    if not isinstance(seed, (int, np.integer)):
        raise InvalidRequestError(f"seed must be an integer; got {seed!r}")

    stop_strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    stop_ids = set(int(t) for t in (stop_token_ids or ()))
    for t in stop_ids:
        if not 0 <= t < cfg.vocab_size:
            raise InvalidRequestError(f"stop token id {t} is outside the vocabulary [0, {cfg.vocab_size})")
    if not ignore_eos:
        eos = model.tokenizer.eos_token_ids if model.tokenizer is not None else cfg.eos_token_ids
        stop_ids |= set(eos)
    stop_sequences = []
    for text in stop_strings:
        if not text:
            raise InvalidRequestError("stop strings must be non-empty")
        if model.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; pass stop_token_ids instead")
        ids = tuple(model.tokenizer.encode(text, add_special_tokens=False))
        # On device we stop on the string's own tokenization; the text is cut on the host too,
        # which catches the string however it was tokenized.
        if len(ids) == 1:
            stop_ids.add(ids[0])
        elif ids:
            stop_sequences.append(ids)

    batch = len(rows)
    prompt_bucket = _bucket(longest, MIN_PROMPT_BUCKET)
    # Decode attention reads all S slots every step, so S is the prompt bucket plus a bucket of
    # the new tokens, not a power of two of the sum (1024 + 132 would otherwise become 2048).
    capacity = min(prompt_bucket + _bucket(max_new_tokens + k, MIN_PROMPT_BUCKET), cfg.max_position_embeddings)
    padded = np.zeros((batch, prompt_bucket), np.int32)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    request = loop.Request(
        prompt=jnp.asarray(padded),
        prompt_length=jnp.asarray([len(r) for r in rows], jnp.int32),
        max_new_tokens=jnp.full((batch,), max_new_tokens, jnp.int32),
        sampling=SamplingParams.create(batch, temperature=temperature, top_k=top_k, top_p=top_p,
                                       min_p=min_p, repetition_penalty=repetition_penalty),
        key=jax.random.PRNGKey(seed),
    )
    spec = loop.LoopSpec(
        cfg=cfg,
        capacity=capacity,
        sampler=sampler,
        stop_token_ids=tuple(sorted(stop_ids)),
        stop_sequences=tuple(stop_sequences),
        proposer=proposer,
        kv_format=kv_format,
        attention=attention.value,
    )
    return _Prepared(rows=rows, request=request, spec=spec, draft=draft, method=method,
                     stop_strings=stop_strings)


# Compiled programs, keyed by everything that shapes them (the static spec and array shapes).
_compiled: dict[Any, Any] = {}


def _shape_key(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((leaf.shape, str(leaf.dtype)) for leaf in leaves)


def _compile(fn, *args, spec) -> tuple[Any, float]:
    key = (fn, spec, _shape_key(args))
    if key in _compiled:
        return _compiled[key], 0.0
    start = time.perf_counter()
    compiled = fn.lower(*args, spec=spec).compile()
    _compiled[key] = compiled
    return compiled, time.perf_counter() - start


def _cut_at_stop(text: str, stop_strings: tuple[str, ...]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _generated(state: loop.DecodeState, rows: int) -> list[list[int]]:
    history = np.asarray(state.tokens)
    starts, counts = np.asarray(state.prompt_length), np.asarray(state.num_generated)
    return [history[row, starts[row]: starts[row] + counts[row]].tolist() for row in range(rows)]


def _stats(prepared: _Prepared, state: loop.DecodeState, *, prefill_seconds, decode_seconds,
           compile_seconds, rows) -> SpecStats:
    counters = jax.device_get(state.stats)
    proposed_at, accepted_at = counters.proposed_at, counters.accepted_at
    return SpecStats(
        method=prepared.method,
        num_draft_tokens=prepared.spec.num_draft,
        rows=rows,
        prompt_tokens=sum(len(r) for r in prepared.rows[:rows]),
        new_tokens=int(np.asarray(state.num_generated)[:rows].sum()),
        prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds,
        compile_seconds=compile_seconds,
        target_forwards=int(state.target_forwards),
        rounds=int(counters.rounds.sum()),
        proposed=int(counters.proposed.sum()),
        accepted=int(counters.accepted.sum()),
        multi_token_rounds=int(counters.multi_token_rounds.sum()),
        acceptance_by_position=tuple(float(a / p) if p else math.nan for a, p in zip(accepted_at, proposed_at)),
    )


def _finish(model: Model, prepared: _Prepared, tokens: list[list[int]], reasons: list[str],
            stats: SpecStats) -> GenerateResult:
    texts = None
    if model.tokenizer is not None:
        texts = []
        for row, ids in enumerate(tokens):
            text, was_cut = _cut_at_stop(model.tokenizer.decode(ids), prepared.stop_strings)
            texts.append(text)
            if was_cut:
                reasons[row] = "stop"
    return GenerateResult(tokens=tokens, text=texts, finish_reason=reasons, stats=stats)


def generate(
    model: Model,
    draft_params: Model | None = None,
    prompt: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] = "",
    *,
    method: str | None = None,
    num_draft_tokens: int = 4,
    ngram_max: int = 3,
    ngram_min: int = 1,
    exit_layer: int | None = None,
    draft_sampling: str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    seed: int = 0,
    chat: bool = False,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    kv_format: str | tuple[str, str] | None = None,
    attention: str = "auto",
) -> GenerateResult:
    """Generate from `model` as one on-device program (prefill + `lax.while_loop`).

    `prompt` is a string, a list of strings (a batch), token ids, or a batch of token ids.
    Speculation: `method` is "ngram" (prompt lookup), "draft" (`draft_params`, a model sharing
    the vocabulary), "layer_skip" (the target's first `exit_layer` layers; default half),
    "eagle3" (`draft_params`, an EAGLE-3 head), "mtp" (`draft_params` from `load_mtp`, by default
    the head the target's own checkpoint carries), or inferred from `draft_params`;
    `num_draft_tokens` (k) per round. Greedy speculative output equals plain greedy output token
    for token.
    Sampling at temperature > 0 with the given filters and `seed` (same seed, same output);
    with a proposer, verification is lossless rejection sampling, and draft models draw their
    drafts from their own distribution (`draft_sampling="sample"`, the default) or propose
    their argmax (`"argmax"`).
    Rows stop at EOS, a stop token or string, or `max_new_tokens`.
    KV cache: `kv_format` stores the target's K and V as "f32" (default), "bf16", "q8_0" or
    "q5_1", one name for both or a (K, V) pair such as ("q8_0", "q5_1"); `attention` is "auto"
    (the Pallas kernel on GPU, the XLA reference elsewhere), "reference", "pallas" or "interpret".
    """
    prepared = _prepare(model, prompt, draft_params=draft_params, method=method,
                        num_draft_tokens=num_draft_tokens, ngram_max=ngram_max, ngram_min=ngram_min,
                        exit_layer=exit_layer, draft_sampling=draft_sampling,
                        max_new_tokens=max_new_tokens, temperature=temperature,
                        top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                        seed=seed, chat=chat, stop=stop, stop_token_ids=stop_token_ids,
                        ignore_eos=ignore_eos, kv_format=kv_format, attention=attention)
    draft = _draft_arguments(model, prepared)
    program, compile_seconds = _compile(loop.run_jit, model.params, draft, prepared.request, spec=prepared.spec)
    loop._prefill_done_at.clear()
    start = time.perf_counter()
    state = jax.block_until_ready(program(model.params, draft, prepared.request))
    end = time.perf_counter()
    prefill_done = loop._prefill_done_at[-1] if loop._prefill_done_at else start

    rows = len(prepared.rows)
    reasons = [loop.FINISH_NAMES[int(r)] for r in np.asarray(state.finish_reason)]
    stats = _stats(prepared, state, prefill_seconds=prefill_done - start, decode_seconds=end - prefill_done,
                   compile_seconds=compile_seconds, rows=rows)
    return _finish(model, prepared, _generated(state, rows), reasons, stats)


class Stream:
    """Iterates over text (or, without a tokenizer, token ids) as tokens are committed.

    After iteration, `.result` holds the `GenerateResult`. One prompt; any method.
    """

    def __init__(self, model: Model, prompt, draft_params=None, **kwargs):
        self._model = model
        self._prepared = _prepare(model, prompt, draft_params=draft_params, **kwargs)
        if len(self._prepared.rows) != 1:
            raise InvalidRequestError("stream() takes one prompt; use generate() for a batch")
        self.result: GenerateResult | None = None

    def __iter__(self) -> Iterator[str | int]:
        model, prepared = self._model, self._prepared
        args = (model.params, _draft_arguments(model, prepared))
        prefill, compile_prefill = _compile(loop.prefill_jit, *args, prepared.request, spec=prepared.spec)
        state_shape = jax.eval_shape(functools.partial(loop.prefill, spec=prepared.spec), *args,
                                     prepared.request)
        step, compile_step = _compile(loop.round_step_jit, *args, state_shape, prepared.request,
                                      spec=prepared.spec)
        decoder = model.tokenizer.stream_decoder() if model.tokenizer is not None else None
        # Text not yet yielded: with stop strings, the tail that could begin one is held back.
        hold = max((len(s) for s in prepared.stop_strings), default=1) - 1
        unsent, emitted, stopped_by_string = "", 0, False

        start = time.perf_counter()
        state = jax.block_until_ready(prefill(*args, prepared.request))
        prefill_done = time.perf_counter()
        while True:
            new = _generated(state, 1)[0][emitted:]
            emitted += len(new)
            if decoder is None:
                yield from new
            else:
                unsent += "".join(decoder.feed(token) for token in new)
                unsent, stopped_by_string = _cut_at_stop(unsent, prepared.stop_strings)
                ready = len(unsent) if stopped_by_string else len(unsent) - hold
                if ready > 0:
                    yield unsent[:ready]
                    unsent = unsent[ready:]
            if stopped_by_string or not bool(state.running[0]):
                break
            state = step(*args, state, prepared.request)
        if decoder is not None and not stopped_by_string:
            unsent += decoder.flush()  # a trailing incomplete character, if generation ended mid-way
        if unsent:
            yield unsent
        end = time.perf_counter()
        reasons = ["stop" if stopped_by_string else loop.FINISH_NAMES[int(state.finish_reason[0])]]
        stats = _stats(prepared, state, prefill_seconds=prefill_done - start, decode_seconds=end - prefill_done,
                       compile_seconds=compile_prefill + compile_step, rows=1)
        self.result = _finish(model, prepared, _generated(state, 1), reasons, stats)


def stream(model: Model, prompt, draft_params: Model | None = None, **kwargs) -> Stream:
    """Like `generate` for one prompt (any method), but yields text deltas as they are committed."""
    return Stream(model, prompt, draft_params, **{**_GENERATE_DEFAULTS, **kwargs})


_GENERATE_DEFAULTS = dict(max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                          repetition_penalty=1.0, seed=0, chat=False, stop=None, stop_token_ids=None,
                          ignore_eos=False, kv_format=None, attention="auto")
