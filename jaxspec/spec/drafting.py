"""What a drafter declares, and the registry of drafters: one `Drafter` per speculation method.

A drafter is one module (`jaxspec.spec.drafters`) that registers a `Drafter`: its method name,
its builder (which checks a draft against the target on the host and returns a `Speculation`:
the method, its proposer and the draft Model it runs), how a draft Model or a head directory is
recognised as its own, and its capabilities the request is checked against before building.
What the proposer can do in the loop (trees, abstaining, a context limit) is a field of the
`Proposer` protocol (jaxspec.spec.proposers). `Method` names come from the registry: the API's
`method=`, the CLI's `--method` choices, `SpecStats.method` and the "unknown method" error.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, ClassVar

from jaxspec.errors import InvalidRequestError
from jaxspec.model import Model
from jaxspec.sampling import SamplerSpec
from jaxspec.spec.proposers import Proposer
from jaxspec.spec.tree import DraftTree

MAX_DRAFT_TOKENS = 32  # beyond this a round costs far more than any acceptance can repay
DRAFT_SAMPLING = ("sample", "argmax")


class Method(str):
    """A speculation method: the name of a registered drafter. Each registered method is also a
    class attribute in upper case (`Method.EAGLE3 == "eagle3"`), and `parse` returns that one
    object for its name, so methods compare with `is`."""

    PLAIN: ClassVar[Method]
    NGRAM: ClassVar[Method]
    DRAFT: ClassVar[Method]
    LAYER_SKIP: ClassVar[Method]
    EAGLE3: ClassVar[Method]
    MTP: ClassVar[Method]
    ASSISTANT: ClassVar[Method]

    @property
    def value(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, name: "Method | str") -> "Method":
        drafter = DRAFTERS.get(name) if isinstance(name, str) else None
        if drafter is None:
            raise InvalidRequestError(f"method must be one of {names()}; got {name!r}")
        return drafter.method

    @classmethod
    def infer(cls, draft: Model | None) -> "Method":
        """The method a draft implies when none is named: the first drafter (in registration
        order) that claims it; None: plain decoding."""
        if draft is None:
            return cls.PLAIN
        if not isinstance(draft, Model):
            raise InvalidRequestError(
                f"draft_params must be a jaxspec Model (from jaxspec.load); got {type(draft).__name__}")
        for drafter in DRAFTERS.values():
            if drafter.claims is not None and drafter.claims(draft):
                return drafter.method
        raise InvalidRequestError(f"no drafter takes a draft of type {type(draft).__name__}; pass method=")


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
    proposer: Proposer | None = None
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
        drafter_limit = None if self.proposer is None else self.proposer.context_limit
        return limits + ([drafter_limit] if drafter_limit else [])


# build(target, draft or None, options, sampler) -> Speculation, checked on the host
Builder = Callable[[Model, "Model | None", DraftOptions, SamplerSpec], Speculation]


@dataclasses.dataclass(frozen=True)
class HeadCheckpoint:
    """A head directory `jaxspec.load` recognises: `is_dir(path)` says whether `path` is one,
    `load(path)` reads it as (config, params)."""

    is_dir: Callable[[os.PathLike], bool]
    load: Callable[[os.PathLike], tuple[Any, Any]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Drafter:
    """A speculation method as its module registers it."""

    name: str  # the method's name
    build: Builder
    summary: str  # one line for the CLI's help
    # Whether a loaded draft Model runs under this method when none is named (Method.infer).
    claims: Callable[[Model], bool] | None = None
    checkpoint: HeadCheckpoint | None = None  # a head directory of its own that `jaxspec.load` reads
    # What the CLI's --draft takes for it; None: the method takes no --draft.
    draft_help: str | None = None
    # How a --draft path loads for it; None: as `jaxspec.load` reads it.
    load_draft: Callable[[str], Model] | None = None
    # The draft when the request names the method but passes none (MTP: the head the target
    # carries); None: the builder decides (and the CLI requires --draft where it takes one).
    default_draft: Callable[[Model], Model] | None = None
    # Its state follows the verified tokens alone, so a round drafted by a prompt lookup in front
    # of it (lookup_first) leaves it as right as one it drafted.
    follows_lookup: bool = False
    # Why lookup_first cannot stand in front of it (when follows_lookup is False).
    lookup_first_refusal: str = "a draft model's KV cache follows its own drafts, not the lookup's"

    @property
    def method(self) -> Method:
        return _METHODS[self.name]


DRAFTERS: dict[str, Drafter] = {}  # by name, in registration order
_METHODS: dict[str, Method] = {}


def register(drafter: Drafter) -> Drafter:
    """Add a drafter (a module does this at import). Its name becomes a `Method`."""
    if not (drafter.name.isidentifier() and drafter.name.islower()):
        raise InvalidRequestError(f"a drafter's name is a lower-case identifier; got {drafter.name!r}")
    if drafter.name in DRAFTERS and DRAFTERS[drafter.name] != drafter:
        raise InvalidRequestError(f"a drafter named {drafter.name!r} is already registered")
    method = _METHODS.setdefault(drafter.name, Method(drafter.name))
    setattr(Method, drafter.name.upper(), method)
    DRAFTERS[drafter.name] = drafter
    return drafter


def unregister(name: str) -> None:
    """Remove a drafter registered at run time (a test's)."""
    DRAFTERS.pop(name, None)
    if name in _METHODS:
        delattr(Method, name.upper())
        del _METHODS[name]


def names() -> tuple[str, ...]:
    return tuple(DRAFTERS)


def drafter_of(method: Method | str) -> Drafter:
    return DRAFTERS[Method.parse(method)]


# ----------------------------------------------------------------------------------------------
# Checks builders share
# ----------------------------------------------------------------------------------------------


def draft_sampling(sampler: SamplerSpec, options: DraftOptions) -> dict:
    """A model drafter's `sample` and `sampler` fields: whether it draws its drafts (and reports q)
    rather than taking its argmax, and the request's sampler when it does.

    At temperature > 0 drafts are drawn from the draft's own distribution unless asked for
    argmax; greedy requests always draft argmax. A tree's drafts are always its drafter's top_k
    (multi-draft verification needs point masses)."""
    if options.tree is not None and options.draft_sampling == "sample":
        raise InvalidRequestError("a draft tree expands each node's top_k children, not samples; "
                                  "draft_sampling='sample' applies to chains (tree=None)")
    sample = options.tree is None and not sampler.greedy and options.draft_sampling != "argmax"
    return dict(sample=sample, sampler=sampler if sample else None)


def check_tree_top_k(options: DraftOptions, vocab: int, whose: str) -> None:
    """A tree expands each node's top_k children: the drafter must have that many tokens."""
    if options.tree is not None and options.tree.top_k > vocab:
        raise InvalidRequestError(f"tree top_k ({options.tree.top_k}) exceeds the {vocab} tokens the {whose} "
                                  f"drafts from")


def refuse_draft(method: str, draft: Model | None) -> None:
    if draft is not None:
        raise InvalidRequestError(f"method={method!r} takes no draft_params")
