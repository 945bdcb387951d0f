"""Plain decoding: no drafter, one token per target forward."""

from __future__ import annotations

from jaxspec.errors import InvalidRequestError
from jaxspec.spec.drafting import Drafter, Speculation, refuse_draft, register


def build(target, draft, options, sampler) -> Speculation:
    refuse_draft("plain", draft)
    if options.tree is not None:
        raise InvalidRequestError("a draft tree needs a proposer: pass a method other than 'plain'")
    return Speculation(DRAFTER.method)


DRAFTER = register(Drafter(name="plain", build=build, summary="no proposer: one token per target forward",
                           lookup_first_refusal="plain decoding has no drafter to fall back on"))
