"""What EAGLE-3 and MTP drafting share: a one-layer head over the target's hidden states, with its
own KV over the whole sequence (jaxspec.spec.drafters.eagle3, .mtp)."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.cache import KVCache
from jaxspec.errors import InvalidRequestError
from jaxspec.model import Model
from jaxspec.spec import tree as tree_lib
from jaxspec.spec.proposers import Context, Prefill, Verified, draft_chain, next_token, tree_proposal


@struct.dataclass
class HeadState:
    cache: KVCache  # the head's KV over the whole sequence; length == the target cache's
    g_next: jax.Array  # [B, D]: the head's output at the last committed position
    next_logits: jax.Array  # [B, Vd]: draft logits for the token after the pending one


class FeatureHead:
    """Drafting with a one-layer head over the target's hidden states: EAGLE-3 and MTP.

    The head keeps its own KV over the whole sequence across rounds (as vLLM does), not a
    scratch buffer: after each verify, the committed positions are written into it from the
    target's own features (one head forward over the k + 1 verified positions, padded), and the
    last of them yields the next round's first draft. Later drafts within a round run on the
    head's own output; their KV slots are speculative and rolled back by length. Slot p holds
    the pair (target feature p, token p + 1).

    A subclass says how target features become the head's input (`_encode`), runs one head step
    (`_step`), maps head-vocabulary ids to target ids (`_to_target`) and makes the head's cache.
    Fields it must have: num_draft, sample, sampler, a `vocab_size` (the target's V) and
    `speaks_target_ids` (whether the head's ids are the target's, or map through `_to_target`).
    """

    can_abstain: ClassVar[bool] = False
    context_limit: ClassVar[tuple[str, int] | None] = None  # a subclass's head may serve fewer positions

    def _encode(self, draft_params, hiddens: tuple[jax.Array, ...]) -> jax.Array: ...

    def _step(self, draft_params, tokens, g, cache, **tree_inputs) -> tuple[jax.Array, jax.Array, KVCache]: ...

    def _to_target(self, draft_params, ids: jax.Array) -> jax.Array: ...

    def _vocab_map(self, draft_params, size: int) -> jax.Array | None:
        """int32[Vd]: the target id of each of the head's `size` ids; None where they are the
        target's own (MTP). A map of the full vocabulary size may still permute it (a d2t), so
        the head's type decides, not its size."""
        return None if self.speaks_target_ids else self._to_target(draft_params, jnp.arange(size))

    def _create_cache(self, batch: int, capacity: int) -> KVCache: ...

    def _absorb(self, draft_params, cache: KVCache, tokens, features, count) -> HeadState:
        """Write (feature p, token p + 1) pairs at the cache's offsets and commit `count` per row."""
        logits, g_next, cache = self._step(draft_params, tokens, self._encode(draft_params, features), cache)
        last = jnp.maximum(count - 1, 0)[:, None, None]
        return HeadState(
            cache=cache.advance(count),
            g_next=jnp.take_along_axis(g_next, last, axis=1)[:, 0],
            next_logits=jnp.take_along_axis(logits, last, axis=1)[:, 0],
        )

    def _draft_token(self, draft_params, logits, context, step, grammar_state=None):
        """Head-vocabulary logits -> target token id [B], and q over the target vocabulary; under a
        grammar, drawn from the logits masked by each row's `grammar_state`."""
        all_targets = self._vocab_map(draft_params, logits.shape[-1])  # [Vd], or None: the target's ids
        allowed = context.allowed(grammar_state)  # [B, V] over the target's vocabulary
        if allowed is not None and all_targets is not None:
            allowed = allowed[:, all_targets]  # [B, Vd]
        head_id, head_probs = next_token(logits, context, step, self.sample, self.sampler, allowed)
        token = self._to_target(draft_params, head_id)
        if head_probs is None or all_targets is None:
            return token, head_probs
        probs = jnp.zeros((logits.shape[0], self.vocab_size)).at[:, all_targets].set(head_probs)
        return token, probs

    def init(self, draft_params, prefill: Prefill, capacity: int) -> HeadState:
        batch, size = prefill.prompt.shape
        cache = self._create_cache(batch, capacity)
        # Feature p pairs with token p + 1: the prompt shifted left, the first token at the end.
        shifted = jnp.concatenate([prefill.prompt[:, 1:], jnp.zeros((batch, 1), jnp.int32)], axis=1)
        last = (prefill.prompt_length - 1)[:, None]
        tokens = jnp.where(jnp.arange(size)[None, :] == last, prefill.first_token[:, None], shifted)
        return self._absorb(draft_params, cache, tokens, prefill.hiddens, prefill.prompt_length)

    def propose(self, draft_params, state: HeadState, context: Context):
        if self.tree is not None:
            return self._propose_tree(draft_params, state, context)
        committed_length = state.cache.length

        def step(carry, token):
            g, cache = carry
            logits, g_next, cache = self._step(draft_params, token[:, None], g[:, None], cache)
            return logits[:, 0], (g_next[:, 0], cache.advance(jnp.ones_like(cache.length)))

        def draw(logits, index, grammar_state):
            return self._draft_token(draft_params, logits, context, index, grammar_state)

        proposal, (_, cache) = draft_chain(self.num_draft, state.next_logits, (state.g_next, state.cache), step, draw,
                                           context)
        # The speculative slots stay written but uncommitted: the update overwrites them.
        return proposal, state.replace(cache=cache.set_length(committed_length))

    def _propose_tree(self, draft_params, state: HeadState, context: Context):
        """Grow the tree from the head's next-token logits: each frontier runs as one head step,
        fed its parent's g, at scratch slots past the committed length (rolled back after)."""
        committed_length, top_k = state.cache.length, self.tree.top_k

        def expand(cache, tokens, g, level, sees):
            offset, positions, mask = tree_lib.frontier_inputs(committed_length, level, top_k, sees)
            logits, g_next, cache = self._step(draft_params, tokens, g, cache.set_length(offset),
                                               positions=positions, tree_mask=mask)
            return logits, g_next, cache

        vocab_map = self._vocab_map(draft_params, state.next_logits.shape[-1])  # the head's ids -> target ids
        grown, cache = tree_lib.grow(self.tree, state.next_logits, state.g_next, expand,
                                     lambda ids: self._to_target(draft_params, ids), state.cache,
                                     tree_lib.GrowGrammar.of(context, vocab_map))
        return tree_proposal(grown), state.replace(cache=cache.set_length(committed_length))

    def update(self, draft_params, state: HeadState, verified: Verified) -> HeadState:
        # Under a tree, `verified` is already the accepted path's: the head absorbs it like a chain.
        return self._absorb(draft_params, state.cache, verified.committed, verified.hiddens,
                            verified.num_committed)


def check_head(target: Model, head: Model | None, config_class: type, method: str, name: str,
               how_to_load: str):
    """A draft head's config, checked against its target (hidden size, vocabulary)."""
    if not isinstance(head, Model) or not isinstance(head.config, config_class):
        raise InvalidRequestError(f"method={method!r} needs draft_params: an {name} head from {how_to_load}")
    cfg, target_cfg = head.config, target.config
    if cfg.dim != target_cfg.dim:
        raise InvalidRequestError(
            f"the {name} head's hidden_size ({cfg.dim}) differs from the target's ({target_cfg.dim})")
    if cfg.vocab_size != target_cfg.vocab_size:
        raise InvalidRequestError(
            f"the {name} head's vocabulary ({cfg.vocab_size}) differs from the target's ({target_cfg.vocab_size})")
    return cfg
