"""Teacher-forced scoring: what log-probability a trunk gives each token of a text, and its perplexity.

Contract: for each row of N tokens, `score` returns log p(token_i | tokens_<i) for i = 1 .. N-1
under the model's raw distribution (temperature 1, no sampling processors), in float32, and the
row's perplexity exp(-mean) of them. The numbers are what one forward over the whole row gives;
how the rows are run does not change them beyond float rounding:

  * all rows go through one forward per chunk, right-padded: the causal mask means the padding
    after a row's end never reaches that row's earlier positions, and its log-probs are dropped;
  * the sequence runs `chunk_tokens` positions at a time through the trunk's cache (KV, or the
    hybrid's recurrent states), so logits never exceed [B, chunk, V], and each position's
    log-prob is gathered on the device: only [B, chunk] floats come back per chunk;
  * one jitted `score_chunk` program serves every call of the same (batch bucket, chunk,
    capacity) shape: batch and length are bucketed to powers of two, so calls of nearby sizes
    share it.

The trunk's params are only ever passed to its family's forward, so any weight format a forward
reads is scored as it is. Bad input raises InvalidRequestError before anything is traced.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import compilation, models
from jaxspec.api import prompt_ids
from jaxspec.errors import InvalidRequestError, is_integer
from jaxspec.model import Model, check_trunk

__all__ = ["ScoreResult", "score", "score_chunk"]

# Length (positions run through the trunk) is bucketed to a power of two of at least this, as
# generate buckets prompts; rows of the batch to a power of two of at least 1.
MIN_LENGTH_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    """Teacher-forced log-probs of each row, and its perplexity.

    logprobs: one float32 array per row, in input order; a row of N tokens has N-1 entries, entry
        j = log p(tokens[j+1] | tokens[0..j]) (natural log, the model's raw distribution). The
        first token has none: nothing precedes it.
    perplexity: float64 [B], exp(-mean(logprobs[b])) per row.
    tokens: the N token ids each row was scored as (int32; a text as tokenized, BOS as
        `add_bos` left it), so logprobs[b][j] belongs to tokens[b][j + 1].
    """

    logprobs: tuple[np.ndarray, ...]
    perplexity: np.ndarray
    tokens: tuple[np.ndarray, ...]


def score_chunk(params, cache, tokens: jax.Array, next_tokens: jax.Array, *, cfg):
    """Run `tokens` int32[B, C] through the trunk at each row's cache length and return
    log p(next_tokens[b, t] | everything up to tokens[b, t]) float32[B, C], with the cache
    advanced by C (the next chunk continues from there)."""
    batch, steps = tokens.shape
    logits, _, cache = models.forward(params, cfg, tokens, cache)  # [B, C, V]
    # float32 whatever format the weights (and so the logits) are in: scores are float32.
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, C, V]
    picked = jnp.take_along_axis(logprobs, next_tokens[:, :, None], axis=-1)[:, :, 0]  # [B, C]
    return picked, cache.advance(jnp.full((batch,), steps, jnp.int32))


# cfg is static (hashable); the cache is donated: each chunk's cache replaces the last. Full
# float32 products, as generation's (jaxspec.compilation, Numerics).
score_chunk_jit = jax.jit(compilation.full_precision_products(score_chunk), static_argnames=("cfg",),
                          donate_argnames=("cache",))


def _power_of_two_at_least(n: int, minimum: int) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def _bos_id(model: Model) -> int | None:
    if model.tokenizer is not None and model.tokenizer.bos_token_id is not None:
        return model.tokenizer.bos_token_id
    return model.config.bos_token_id


def _rows(model: Model, texts_or_ids, add_bos: bool | None) -> list[list[int]]:
    """The rows to score as token ids, checked: texts tokenized raw, conversations through the chat
    template with no assistant cue after the last message (api.prompt_ids), BOS added or removed
    at the front as `add_bos` asks, each row 2 .. context tokens long."""
    if add_bos is not None and not isinstance(add_bos, bool):
        raise InvalidRequestError(f"add_bos must be None, True or False; got {add_bos!r}")
    rows = prompt_ids(texts_or_ids, model, chat=False, add_generation_prompt=False)
    if add_bos is not None:
        bos = _bos_id(model)
        if bos is None:
            raise InvalidRequestError("add_bos was given but this model names no BOS token")
        starts_with_bos = [bool(row) and row[0] == bos for row in rows]
        if add_bos:
            rows = [row if starts else [bos, *row] for row, starts in zip(rows, starts_with_bos)]
        else:
            rows = [row[1:] if starts else row for row, starts in zip(rows, starts_with_bos)]
    context = model.config.max_position_embeddings
    for index, row in enumerate(rows):
        if len(row) < 2:
            raise InvalidRequestError(
                f"row {index} has {len(row)} token(s); scoring needs at least 2 (the first token is only context)")
        if len(row) > context:
            raise InvalidRequestError(f"row {index} has {len(row)} tokens, beyond the model's context of {context}")
    return rows


def score(model: Model, texts_or_ids, *, add_bos: bool | None = None, chunk_tokens: int = 256) -> ScoreResult:
    """Teacher-forced log-probs of every token after the first, and perplexity, per row.

    `texts_or_ids`: a string (tokenized raw, BOS included where the tokenizer adds one), a
    conversation (a list of {"role", "content"} messages, rendered by the chat template as it
    stands, with no cue for a next turn), token ids, or a batch of any of these (rows of any
    lengths, each at least 2 tokens). `add_bos`: None scores rows as tokenized or given; True
    starts every row with the model's BOS (added where missing); False starts none with it.
    `chunk_tokens`: positions run per forward (logits of [rows, chunk_tokens, V] at most).
    `model` is a trunk (`jaxspec.load()`), never a draft head. See `ScoreResult`.
    """
    if not isinstance(model, Model):
        raise InvalidRequestError(f"model must be a jaxspec Model (from jaxspec.load); got {type(model).__name__}")
    check_trunk(model, "score")
    if not is_integer(chunk_tokens) or chunk_tokens < 1:
        raise InvalidRequestError(f"chunk_tokens must be an integer >= 1; got {chunk_tokens!r}")
    rows = _rows(model, texts_or_ids, add_bos)

    # Position t predicts token t + 1, so a row of N tokens runs its first N - 1 through the trunk.
    steps_needed = max(len(row) for row in rows) - 1
    length_bucket = min(_power_of_two_at_least(steps_needed, MIN_LENGTH_BUCKET), model.config.max_position_embeddings)
    chunk = min(int(chunk_tokens), length_bucket)
    capacity = math.ceil(length_bucket / chunk) * chunk  # whole chunks: the last one never overruns the cache
    batch = _power_of_two_at_least(len(rows), 1)
    padded = np.zeros((batch, capacity + 1), np.int32)  # [B, S + 1]: inputs [:, :S], next tokens [:, 1:]
    for index, row in enumerate(rows):
        padded[index, : len(row)] = row

    compilation.enable_persistent_cache()
    cache = models.create_cache(model.config, batch, capacity)
    chunk_logprobs = []  # [B, C] each, left on the device until all chunks are queued
    program = f"score [batch {batch}, {chunk} tokens a chunk, {capacity} cache slots]"
    with compilation.CompileWatch(program):
        for start in range(0, steps_needed, chunk):
            tokens = jnp.asarray(padded[:, start: start + chunk])
            next_tokens = jnp.asarray(padded[:, start + 1: start + chunk + 1])
            picked, cache = score_chunk_jit(model.params, cache, tokens, next_tokens, cfg=model.config)
            chunk_logprobs.append(picked)
        logprobs = np.concatenate(jax.device_get(chunk_logprobs), axis=1)  # [B, chunks * C]

    per_row = tuple(np.ascontiguousarray(logprobs[index, : len(row) - 1], np.float32) for index, row in enumerate(rows))
    perplexity = np.exp(-np.array([np.mean(row, dtype=np.float64) for row in per_row]))  # float64 [B]
    tokens = tuple(np.asarray(row, np.int32) for row in rows)
    return ScoreResult(logprobs=per_row, perplexity=perplexity, tokens=tokens)
