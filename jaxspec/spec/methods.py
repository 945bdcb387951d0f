"""Speculation methods: a request's method, resolved through the drafter registry into a proposer.

One name per method everywhere: `generate(method=...)`, the CLI's `--method`, `SpecStats.method`;
the names are the registered drafters' (jaxspec.spec.drafting, jaxspec.spec.drafters). `build`
checks the target's trunk can verify the request's draft shape, runs the method's builder (which
checks the draft against the target on the host) and puts a prompt lookup in front when asked
(jaxspec.spec.lookup_first). The proposer then builds the pytree the jitted program receives as
`draft_params` (`Speculation.draft_inputs`).
"""

from __future__ import annotations

import dataclasses

from jaxspec import models
from jaxspec.errors import InvalidRequestError
from jaxspec.model import Model
from jaxspec.sampling import SamplerSpec
from jaxspec.spec import drafters  # noqa: F401  (registers the built-in drafters)
from jaxspec.spec.drafting import (DRAFT_SAMPLING, DRAFTERS, MAX_DRAFT_TOKENS, DraftOptions, Method,  # noqa: F401
                                   Speculation, drafter_of)
from jaxspec.spec.lookup_first import LookupFirst


def build(method: Method, target: Model, draft: Model | None, options: DraftOptions,
          sampler: SamplerSpec) -> Speculation:
    """Check `draft` against `target` for `method` and build its proposer (host side, no tracing)."""
    method = Method.parse(method)
    if options.exit_layer is not None and method is not Method.LAYER_SKIP:
        raise InvalidRequestError(f"exit_layer applies to method='layer_skip' only; method is {method.value!r}")
    if options.tree is not None:
        models.family_of(target.config).check_tree(target.config, options.tree.depth, "target")
    speculation = DRAFTERS[method].build(target, draft, options, sampler)
    if options.lookup_first is None:
        return speculation
    return _with_lookup_first(speculation, options)


def check_lookup_first(method: Method) -> None:
    """Refuse lookup_first for a method whose drafter cannot stand behind a prompt lookup."""
    drafter = drafter_of(method)
    if drafter.follows_lookup:
        return
    followers = ", ".join(name for name, other in DRAFTERS.items() if other.follows_lookup)
    raise InvalidRequestError(f"lookup_first applies to methods {followers}; method={drafter.name!r}: "
                              f"{drafter.lookup_first_refusal}")


def _with_lookup_first(speculation: Speculation, options: DraftOptions) -> Speculation:
    """Put a prompt lookup of n-grams from max(ngram_max, n) down to n = lookup_first in front of
    the method's drafter: rows where it matches draft its continuation, the others the model's."""
    check_lookup_first(speculation.method)
    n = options.lookup_first
    # A chain of k (a tree's depth) either way: under a tree it is grafted onto the drafter's.
    lookup = drafters.ngram.PromptLookup(num_draft=options.num_draft, ngram_max=max(options.ngram_max, n),
                                                  ngram_min=n)
    return dataclasses.replace(speculation, proposer=LookupFirst(lookup=lookup, model=speculation.proposer))


__all__ = ["DRAFT_SAMPLING", "MAX_DRAFT_TOKENS", "DraftOptions", "Method", "Speculation", "build",
           "check_lookup_first"]
