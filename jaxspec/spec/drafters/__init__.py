"""The built-in drafters, one module each; importing one registers its method(s)
(jaxspec.spec.drafting). Registration order is the order `Method.infer` asks them to claim a draft.

A new drafter is one module that builds its proposer (jaxspec.spec.proposers' protocol) and
calls `register(Drafter(...))`, plus its line here.
"""

from jaxspec.spec.drafters import plain  # noqa: F401
from jaxspec.spec.drafters import ngram  # noqa: F401
from jaxspec.spec.drafters import draft_model  # noqa: F401
from jaxspec.spec.drafters import eagle3  # noqa: F401
from jaxspec.spec.drafters import mtp  # noqa: F401
from jaxspec.spec.drafters import assistant  # noqa: F401
