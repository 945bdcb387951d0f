"""Speculation methods: the `Method` names and, for each, the builder of its proposer.

One name per method everywhere: `generate(method=...)`, the CLI's `--method`, `SpecStats.method`.
A builder checks the draft against the target on the host (vocabulary, hidden size, aux layers,
a hybrid draft's rollback ring) and returns a `Speculation`: the method, its proposer (static,
part of the compiled program) and the draft Model it runs. The proposer then builds the pytree
the jitted program receives as `draft_params` (`Speculation.draft_inputs`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from jaxspec.errors import InvalidRequestError, UnsupportedModelError
from jaxspec.model import Model, layer_skip
from jaxspec.models import assistant, eagle3, mtp, qwen35
from jaxspec.sampling import SamplerSpec
from jaxspec.spec import proposers
from jaxspec.spec.lookup_first import LookupFirst
from jaxspec.spec.tree import DraftTree

MAX_DRAFT_TOKENS = 32  # beyond this a round costs far more than any acceptance can repay
DRAFT_SAMPLING = ("sample", "argmax")


class Method(enum.StrEnum):
    PLAIN = "plain"  # no proposer: one token per target forward
    NGRAM = "ngram"  # prompt lookup, model-free
    DRAFT = "draft"  # a smaller model of the same vocabulary
    LAYER_SKIP = "layer_skip"  # the target's own first layers
    EAGLE3 = "eagle3"  # an EAGLE-3 head over the target's features
    MTP = "mtp"  # a multi-token-prediction head
    ASSISTANT = "assistant"  # Gemma 4's shared-KV assistant, reading the target's K/V

    @classmethod
    def parse(cls, name: "Method | str") -> "Method":
        try:
            return cls(name)
        except ValueError:
            raise InvalidRequestError(f"method must be one of {tuple(m.value for m in cls)}; got {name!r}") from None

    @classmethod
    def infer(cls, draft: Model | None) -> "Method":
        """The method a draft implies when none is named: its head type, or a plain draft model."""
        if draft is None:
            return cls.PLAIN
        config = getattr(draft, "config", None)
        if isinstance(config, eagle3.Eagle3Config):
            return cls.EAGLE3
        if isinstance(config, mtp.MtpConfig):
            return cls.MTP
        if isinstance(config, assistant.AssistantConfig):
            return cls.ASSISTANT
        return cls.LAYER_SKIP if getattr(draft, "exit_layer", None) is not None else cls.DRAFT


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftOptions:
    """The request's drafting settings a builder reads (already range-checked by GenerateOptions)."""

    num_draft_tokens: int  # k
    ngram_max: int
    ngram_min: int
    exit_layer: int | None
    draft_sampling: str | None  # "sample" | "argmax" | None (sample)
    tree: DraftTree | None = None  # draft a tree of this shape instead of a chain of k
    lookup_first: int | None = None  # n: rows whose last n tokens occurred earlier draft the lookup's continuation

    @property
    def num_draft(self) -> int:
        """The most drafts a round accepts: k, or the tree's depth."""
        return self.num_draft_tokens if self.tree is None else self.tree.depth


@dataclasses.dataclass(frozen=True)
class Speculation:
    """A resolved method: its proposer (None for plain) and the draft Model that proposer runs."""

    method: Method
    proposer: proposers.Proposer | None = None
    draft: Model | None = None

    @property
    def num_draft(self) -> int:  # k
        return 0 if self.proposer is None else self.proposer.num_draft

    def draft_inputs(self, target: Model) -> Any:
        """What the jitted program receives as `draft_params` (None without a proposer)."""
        if self.proposer is None:
            return None
        return self.proposer.draft_inputs(target.params, None if self.draft is None else self.draft.params)

    def context_limits(self, target: Model) -> list[tuple[str, int]]:
        """(whose, tokens) pairs a prompt + max_new_tokens + k must fit in."""
        limits = [("model's", target.config.max_position_embeddings)]
        drafter_limit = getattr(self.proposer, "context_limit", None)  # proposers.py: a drafter's own bound
        return limits + ([drafter_limit] if drafter_limit else [])


def _samples_drafts(sampler: SamplerSpec, options: DraftOptions) -> bool:
    # At temperature > 0 drafts are drawn from the draft's own distribution unless asked for
    # argmax; greedy requests always draft argmax. A tree's drafts are always its drafter's
    # top_k (multi-draft verification needs point masses).
    if options.tree is not None:
        if options.draft_sampling == "sample":
            raise InvalidRequestError("a draft tree expands each node's top_k children, not samples; "
                                      "draft_sampling='sample' applies to chains (tree=None)")
        return False
    return not sampler.greedy and options.draft_sampling != "argmax"


def _check_tree_top_k(options: DraftOptions, vocab: int, whose: str) -> None:
    """A tree expands each node's top_k children: the drafter must have that many tokens."""
    if options.tree is not None and options.tree.top_k > vocab:
        raise InvalidRequestError(f"tree top_k ({options.tree.top_k}) exceeds the {vocab} tokens the {whose} "
                                  f"drafts from")


def _refuse_hybrid_tree(config: Any, whose: str, options: DraftOptions) -> None:
    """Trees need an attention-only trunk: a recurrent layer keeps one state per position, and a
    tree's siblings share a position. A sliding-window trunk needs the tree shallower than its
    window (`flash_decode.mask_visible` leaves a node's ancestors to the tree mask alone)."""
    if options.tree is None:
        return
    if isinstance(config, qwen35.Qwen35Config):
        raise UnsupportedModelError(
            f"the {whose} is a Qwen3.5 hybrid: its DeltaNet layers carry one recurrent state per position, "
            f"not per tree node, so draft trees are not supported; use a chain (tree=None)")
    window = getattr(getattr(config, "sliding", None), "window", None)
    if window is not None and options.tree.depth >= window:
        raise InvalidRequestError(f"a draft tree of depth {options.tree.depth} reaches past the {whose}'s sliding "
                                  f"window of {window} positions; use a depth below {window}")


def _refuse_draft(method: Method, draft: Model | None) -> None:
    if draft is not None:
        raise InvalidRequestError(f"method={method.value!r} takes no draft_params")


def _plain(target: Model, draft: Model | None, options: DraftOptions, sampler: SamplerSpec) -> Speculation:
    _refuse_draft(Method.PLAIN, draft)
    if options.tree is not None:
        raise InvalidRequestError("a draft tree needs a proposer: pass a method other than 'plain'")
    return Speculation(Method.PLAIN)


def _ngram(target: Model, draft: Model | None, options: DraftOptions, sampler: SamplerSpec) -> Speculation:
    _refuse_draft(Method.NGRAM, draft)
    if options.draft_sampling == "sample":
        raise InvalidRequestError(
            "prompt lookup proposes copied tokens, not samples: it has no q for draft_sampling='sample'")
    proposer = proposers.PromptLookup(num_draft=options.num_draft, ngram_max=options.ngram_max,
                                      ngram_min=options.ngram_min, tree=options.tree)
    return Speculation(Method.NGRAM, proposer)


def _with_rollback_ring(config: Any, k: int) -> Any:
    """A hybrid (Qwen3.5) draft runs k + 1 positions past its context's length - 2 each round and
    is set back to the new length - 2: k positions back for a row that committed one token, k + 1
    for a row that already finished (its context no longer grows, yet the batch drafts on). Its
    state ring must hold those k + 2 states, and its T = 2 catch-up forward must record both."""
    if not isinstance(config, qwen35.Qwen35Config):
        return config
    return dataclasses.replace(config, rollback_states=max(config.rollback_states, k + 2),
                               recorded_steps=max(config.recorded_steps, 2))


def _draft_model(method: Method, target: Model, draft: Model, options: DraftOptions,
                 sampler: SamplerSpec) -> Speculation:
    if not isinstance(draft, Model):
        raise InvalidRequestError(
            f"draft_params must be a jaxspec Model (from jaxspec.load); got {type(draft).__name__}")
    if isinstance(draft.config, (eagle3.Eagle3Config, mtp.MtpConfig, assistant.AssistantConfig)):
        raise InvalidRequestError(f"method={method.value!r} needs a draft model; this draft is a "
                                  f"{Method.infer(draft).value} head (use method={Method.infer(draft).value!r})")
    if draft.config.vocab_size != target.config.vocab_size:
        raise InvalidRequestError(
            f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
            f"({target.config.vocab_size}); a draft model must share the target's tokenizer")
    _refuse_hybrid_tree(draft.config, "draft", options)
    _check_tree_top_k(options, draft.config.vocab_size, "draft model")
    k = options.num_draft
    sample = _samples_drafts(sampler, options)
    proposer = proposers.DraftModel(num_draft=k, config=_with_rollback_ring(draft.config, k), sample=sample,
                                    sampler=sampler if sample else None, tree=options.tree, name=method.value)
    return Speculation(method, proposer, draft)


def _draft(target: Model, draft: Model | None, options: DraftOptions, sampler: SamplerSpec) -> Speculation:
    if draft is None:
        raise InvalidRequestError("method='draft' needs draft_params: a model from jaxspec.load")
    return _draft_model(Method.DRAFT, target, draft, options, sampler)


def _layer_skip(target: Model, draft: Model | None, options: DraftOptions, sampler: SamplerSpec) -> Speculation:
    if draft is None:
        exit_layer = options.exit_layer if options.exit_layer is not None else target.config.num_layers // 2
        draft = layer_skip(target, exit_layer)
    elif options.exit_layer is not None:
        raise InvalidRequestError("pass exit_layer or a layer-skip draft_params, not both")
    return _draft_model(Method.LAYER_SKIP, target, draft, options, sampler)


def _check_head(target: Model, head: Model | None, config_class: type, method: Method, name: str,
                how_to_load: str) -> Any:
    """A draft head's config, checked against its target (hidden size, vocabulary)."""
    if not isinstance(head, Model) or not isinstance(head.config, config_class):
        raise InvalidRequestError(f"method={method.value!r} needs draft_params: an {name} head from {how_to_load}")
    cfg, target_cfg = head.config, target.config
    if cfg.dim != target_cfg.dim:
        raise InvalidRequestError(
            f"the {name} head's hidden_size ({cfg.dim}) differs from the target's ({target_cfg.dim})")
    if cfg.vocab_size != target_cfg.vocab_size:
        raise InvalidRequestError(
            f"the {name} head's vocabulary ({cfg.vocab_size}) differs from the target's ({target_cfg.vocab_size})")
    return cfg


def _eagle3(target: Model, head: Model | None, options: DraftOptions, sampler: SamplerSpec) -> Speculation:
    cfg = _check_head(target, head, eagle3.Eagle3Config, Method.EAGLE3, "EAGLE-3", "jaxspec.load(HEAD_DIR)")
    layers = target.config.num_layers
    aux = cfg.resolved_aux_layers(layers)
    if len(aux) != 3 or any(not 0 <= i < layers for i in aux):
        raise InvalidRequestError(
            f"EAGLE-3 aux layer ids {aux} must be three layer indices in [0, {layers}) of the target")
    _check_tree_top_k(options, cfg.draft_vocab_size, "EAGLE-3 head")
    sample = _samples_drafts(sampler, options)
    proposer = proposers.Eagle3(num_draft=options.num_draft, config=cfg, aux_layer_ids=tuple(aux),
                                sample=sample, sampler=sampler if sample else None, tree=options.tree)
    return Speculation(Method.EAGLE3, proposer, head)


def _mtp(target: Model, head: Model | None, options: DraftOptions, sampler: SamplerSpec) -> Speculation:
    cfg = _check_head(target, head, mtp.MtpConfig, Method.MTP, "MTP", "jaxspec.load_mtp(MODEL_DIR)")
    _check_tree_top_k(options, cfg.vocab_size, "MTP head")
    sample = _samples_drafts(sampler, options)
    proposer = proposers.Mtp(num_draft=options.num_draft, config=cfg, target_layers=target.config.num_layers,
                             sample=sample, sampler=sampler if sample else None, tree=options.tree)
    return Speculation(Method.MTP, proposer, head)


def _assistant(target: Model, head: Model | None, options: DraftOptions, sampler: SamplerSpec) -> Speculation:
    if not isinstance(head, Model) or not isinstance(head.config, assistant.AssistantConfig):
        raise InvalidRequestError("method='assistant' needs draft_params: a Gemma 4 assistant from "
                                  "jaxspec.load(ASSISTANT_DIR)")
    assistant.check_target(head.config, target.config)
    _check_tree_top_k(options, head.config.vocab_size, "assistant")
    sample = _samples_drafts(sampler, options)
    proposer = proposers.SharedKVAssistant(num_draft=options.num_draft, config=head.config,
                                           target_config=target.config, sample=sample,
                                           sampler=sampler if sample else None, tree=options.tree)
    return Speculation(Method.ASSISTANT, proposer, head)


Builder = Callable[[Model, "Model | None", DraftOptions, SamplerSpec], Speculation]

BUILDERS: dict[Method, Builder] = {
    Method.PLAIN: _plain,
    Method.NGRAM: _ngram,
    Method.DRAFT: _draft,
    Method.LAYER_SKIP: _layer_skip,
    Method.EAGLE3: _eagle3,
    Method.MTP: _mtp,
    Method.ASSISTANT: _assistant,
}


def build(method: Method, target: Model, draft: Model | None, options: DraftOptions,
          sampler: SamplerSpec) -> Speculation:
    """Check `draft` against `target` for `method` and build its proposer (host side, no tracing)."""
    if options.exit_layer is not None and method is not Method.LAYER_SKIP:
        raise InvalidRequestError(f"exit_layer applies to method='layer_skip' only; method is {method.value!r}")
    _refuse_hybrid_tree(target.config, "target", options)
    speculation = BUILDERS[method](target, draft, options, sampler)
    if options.lookup_first is None:
        return speculation
    return _with_lookup_first(speculation, options)


# Drafters whose state follows the verified tokens alone, so a round drafted by the lookup
# leaves them as right as one they drafted (jaxspec.spec.lookup_first).
LOOKUP_FIRST_METHODS = (Method.EAGLE3, Method.MTP, Method.ASSISTANT)


def check_lookup_first(method: Method) -> None:
    """Refuse lookup_first for a method whose drafter cannot stand behind a prompt lookup."""
    if method in LOOKUP_FIRST_METHODS:
        return
    why = {Method.PLAIN: "plain decoding has no drafter to fall back on",
           Method.NGRAM: "the method already is prompt lookup (ngram_min sets its shortest n-gram)"}.get(
        method, "a draft model's KV cache follows its own drafts, not the lookup's")
    raise InvalidRequestError(f"lookup_first applies to methods {', '.join(m.value for m in LOOKUP_FIRST_METHODS)}; "
                              f"method={method.value!r}: {why}")


def _with_lookup_first(speculation: Speculation, options: DraftOptions) -> Speculation:
    """Put a prompt lookup of n-grams from max(ngram_max, n) down to n = lookup_first in front of
    the method's drafter: rows where it matches draft its continuation, the others the model's."""
    check_lookup_first(speculation.method)
    n = options.lookup_first
    # A chain of k (a tree's depth) either way: under a tree it is grafted onto the drafter's.
    lookup = proposers.PromptLookup(num_draft=options.num_draft, ngram_max=max(options.ngram_max, n), ngram_min=n)
    return dataclasses.replace(speculation, proposer=LookupFirst(lookup=lookup, model=speculation.proposer))
