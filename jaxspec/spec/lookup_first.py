"""Lookup-first drafting: prompt lookup where the context repeats itself, a model drafter elsewhere.

A small draft head is weakest exactly where the text copies earlier text (a name, a quoted span,
code being edited): it predicts the next token from features, not by pointing back. Prompt
lookup is the opposite: free, often right where its n-gram matches, silent elsewhere. Teacher-
forced on the shipped SmolLM2 head, the first draft agrees with the target more often when a
3-gram match's continuation replaces the head's draft (bench/RESULTS.md, "Head agreement";
docs/design.md, "Methods, proposers and the options of a request").

`LookupFirst` runs both every round and decides per row, with `jnp.where`s: in a chain, a row
whose last n tokens (n >= the lookup's `ngram_min`) occurred earlier in its context drafts the
lookup's continuation, every other row the model's. Under a tree, such a row keeps the model's
tree and grafts the continuation onto it (`tree.graft_chain`: down the tree as far as the tree
holds its tokens, the rest in place of the tree's last nodes): the head's best guesses stay
beside the copy. Both are computed for every row: the loop stays one program, and the head costs
a small part of the target's verify.

Only a drafter whose state follows the verified tokens alone can stand behind the lookup: a
feature head (EAGLE-3, MTP) rewrites its cache from the target's features of whatever was
committed, and the shared-KV assistant keeps only the target's last hidden state. A draft
model's KV cache follows its own drafts (its rollback assumes the accepted tokens are ones it
ran), so the method builder refuses that pairing.

Under sampled verification the lookup's drafts are point masses: a lookup row's q is the
one-hot of its drafts, a model row's the distribution its drafts were drawn from, and
rejection sampling is exact for each row's own q.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxspec.errors import InvalidRequestError
from jaxspec.spec import tree as tree_lib
from jaxspec.spec.drafters.ngram import PromptLookup
from jaxspec.spec.proposers import Context, Prefill, Proposal, Proposer, Verified


@dataclasses.dataclass(frozen=True, kw_only=True)
class LookupFirst:
    """A `Proposer`: `lookup`'s drafts in rows where its n-gram matches, `model`'s in the rest
    (under a tree, grafted onto the model's).

    `model` is an Eagle3, Mtp or SharedKVAssistant proposer; `lookup` a chain of the same k (a
    tree's depth). The state is `model`'s, initialised and updated by it (the lookup has none).
    """

    lookup: PromptLookup
    model: Proposer
    can_abstain: ClassVar[bool] = False  # the model always drafts

    def __post_init__(self):
        if self.lookup.num_draft != self.model.num_draft or self.lookup.tree is not None:
            raise InvalidRequestError("LookupFirst's lookup must draft a chain of the model's k (a tree's depth)")

    @property
    def num_draft(self) -> int:
        return self.model.num_draft

    @property
    def tree(self):
        return self.model.tree

    @property
    def name(self) -> str:
        return f"{self.model.name}+lookup"

    @property
    def target_hidden_layers(self) -> tuple[int, ...]:
        return self.model.target_hidden_layers

    @property
    def context_limit(self) -> tuple[str, int] | None:
        return self.model.context_limit

    def draft_inputs(self, target_params, draft_model_params):
        return self.model.draft_inputs(target_params, draft_model_params)

    def init(self, draft_params, prefill: Prefill, capacity: int) -> Any:
        return self.model.init(draft_params, prefill, capacity)

    def update(self, draft_params, state, verified: Verified) -> Any:
        return self.model.update(draft_params, state, verified)

    def propose(self, draft_params, state, context: Context) -> tuple[Proposal, Any]:
        looked, _ = self.lookup.propose(None, None, context)
        drafted, state = self.model.propose(draft_params, state, context)
        if drafted.parents is not None:  # a tree: the lookup's chain in place of its last nodes
            # num_proposed <= depth <= num_nodes (DraftTree): the chain always fits.
            drafts, parents = tree_lib.graft_chain(drafted.drafts, drafted.parents, looked.drafts, looked.num_proposed)
            return drafted.replace(drafts=drafts, parents=parents), state
        use_lookup = looked.num_proposed > 0  # [B]: the row's context repeats its last n tokens

        def pick(from_lookup, from_model):
            where = use_lookup.reshape(use_lookup.shape + (1,) * (from_model.ndim - 1))
            return jnp.where(where, from_lookup, from_model)

        probs = drafted.probs  # [B, k, V] when the model samples its drafts; else None (point masses)
        if probs is not None:
            probs = pick(jax.nn.one_hot(looked.drafts, probs.shape[-1], dtype=probs.dtype), probs)
        return Proposal(drafts=pick(looked.drafts, drafted.drafts),
                        num_proposed=pick(looked.num_proposed, drafted.num_proposed), probs=probs), state
