"""The drafter registry (jaxspec.spec.drafting): a drafter is one module and one `register` call.

This file is such a module: a toy drafter ("repeat": every draft is the pending token again) is
declared and registered here and nowhere else, and then runs everywhere a built-in does: as a
`Method`, through `generate`, in the CLI's `--method` choices and in the "unknown method" error.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import pytest

import jaxspec
from jaxspec import cli
from jaxspec.spec import drafting
from jaxspec.spec.drafting import Drafter, Method, Speculation, refuse_draft
from jaxspec.spec.proposers import Context, Proposal

PROMPT = [3, 17, 42, 5, 17, 42, 9]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RepeatLast:
    """Drafts the pending token k times (point masses); model-free, stateless."""

    num_draft: int
    name: str = "repeat"
    target_hidden_layers: tuple[int, ...] = ()
    tree: None = None
    can_abstain: ClassVar[bool] = False
    context_limit: ClassVar[None] = None

    def draft_inputs(self, target_params, draft_model_params):
        return None

    def init(self, draft_params, prefill, capacity):
        return None

    def update(self, draft_params, state, verified):
        return state

    def propose(self, draft_params, state, context: Context):
        pending = jnp.take_along_axis(context.tokens, (context.length - 1)[:, None], axis=1)  # [B, 1]
        drafts = jnp.repeat(pending, self.num_draft, axis=1)  # [B, k]
        return Proposal(drafts=drafts, num_proposed=jnp.full(pending.shape[:1], self.num_draft, jnp.int32)), state


def build(target, draft, options, sampler) -> Speculation:
    refuse_draft("repeat", draft)
    if options.tree is not None:
        raise jaxspec.InvalidRequestError("method='repeat' drafts chains only")
    return Speculation(Method.parse("repeat"), RepeatLast(num_draft=options.num_draft))


@pytest.fixture
def repeat():
    """The toy drafter registered for one test, and gone after it."""
    drafter = drafting.register(Drafter(name="repeat", build=build, summary="the pending token, k times"))
    yield drafter
    drafting.unregister("repeat")


def test_a_registered_drafter_is_a_method(repeat):
    assert Method.parse("repeat") is Method.REPEAT is repeat.method
    assert "repeat" in drafting.names()
    args = cli.build_parser().parse_args(["generate", "Hi", "--method", "repeat"])
    assert args.method == "repeat"


def test_a_registered_drafter_runs_in_the_loop_and_keeps_greedy_exact(tiny_model, repeat):
    plain = jaxspec.generate(tiny_model, prompt=PROMPT, max_new_tokens=16, ignore_eos=True)
    result = jaxspec.generate(tiny_model, prompt=PROMPT, method="repeat", num_draft_tokens=3, max_new_tokens=16,
                              ignore_eos=True)
    assert result.tokens == plain.tokens
    stats = result.stats
    assert stats.method == "repeat" and stats.drafter == "repeat"
    assert stats.proposed == 3 * stats.rounds > 0  # its drafts were verified every round


def test_a_drafter_gone_from_the_registry_is_an_unknown_method(repeat):
    drafting.unregister("repeat")
    with pytest.raises(jaxspec.InvalidRequestError, match="method must be one of .*'assistant'"):
        jaxspec.generate(jaxspec.Model(config=None, params=None), prompt=PROMPT, method="repeat")
    assert not hasattr(Method, "REPEAT")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "Hi", "--method", "repeat"])


def test_a_name_is_registered_once():
    with pytest.raises(jaxspec.InvalidRequestError, match="already registered"):
        drafting.register(Drafter(name="ngram", build=build, summary="another ngram"))
