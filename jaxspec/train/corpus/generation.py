"""The target writing the corpus: greedy or sampled generation in fixed-shape batches
(`_generate_batches`), and Magpie, where it writes the user's messages too: first turns
(`synthesize_user_prompts`) and follow-ups after a first exchange (`synthesize_follow_ups`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from jaxspec.api import Model, generate
from jaxspec.errors import InvalidRequestError
from jaxspec.tokenizer import Tokenizer
from jaxspec.train.corpus.chat import USER_SENTINEL, _chat_tokenizer, chat_tokens
from jaxspec.train.corpus.near_duplicates import _NearDuplicateIndex, _ReferenceIndex

logger = logging.getLogger(__name__)


def _derive_seed(*parts: Any) -> int:
    """A 32-bit seed from any parts, the same in every process (Python's hash() is salted)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=4).digest(), "little")


# What one generation batch may hold: `batch_size` rows of prompts this long (`_generate_span`).
BATCH_PROMPT_TOKENS = 256


# Greedy answers are written in this many spans of `answer_max_new_tokens` (`_generate_batches`):
# the same tokens, fewer batch steps spent on rows that already ended.
ANSWER_SPANS = 2


def _generate_batches(target: Model, prompts: Sequence[Sequence[int]], *, batch_size: int, max_new_tokens: int,
                      window: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
                      seed: Any = None, stop_token_ids: Sequence[int] = (), spans: int = 1,
                      progress: str | None = None) -> list[tuple[list[int], str]]:
    """(generated ids, finish reason) per prompt, in order. Prompts are sorted by length and every
    batch is padded to `batch_size` rows (repeating its last; long prompts' batches to a halving of
    it, `BATCH_PROMPT_TOKENS`), so batches share one shape per prompt bucket. New tokens stop at the context and, with `window`, where the tokens
    would leave the training window (never trained on); a prompt that leaves no room gets
    ([], "prompt_too_long") (the context) or ([], "prompt_fills_window"). Sampling seeds derive
    from (`seed`, batch number).

    Greedy decoding can run in `spans` equal spans of the new tokens: after each, the rows
    still going continue from their prompt plus what they wrote, regrouped into full batches. A
    batch runs until its longest row is done, so in one span the rows that ended early ride
    along, and every step reads a cache sized for the longest. Many answers here end well before
    the bound and the rest run to it, so by a step cost linear in the cache two spans cost
    clearly less than one: the first runs over caches sized for part of the bound, the second
    only the rows still going (an answer shard's time: bench/RESULTS.md, "Measured by hand (no
    bench script)")."""
    if spans <= 1 or temperature > 0 or max_new_tokens < 2 * spans:
        return _generate_span(target, prompts, batch_size=batch_size, max_new_tokens=max_new_tokens, window=window,
                              temperature=temperature, top_p=top_p, seed=seed, stop_token_ids=stop_token_ids,
                              progress=progress)
    written: list[list[int]] = [[] for _ in prompts]
    results: list[tuple[list[int], str] | None] = [None] * len(prompts)
    going = list(range(len(prompts)))
    bounds = [max_new_tokens * (span + 1) // spans for span in range(spans)]  # tokens written after each
    for span, bound in enumerate(bounds):
        spent = bound - bounds[span - 1] if span else bound
        rows = _generate_span(target, [list(prompts[i]) + written[i] for i in going], batch_size=batch_size,
                              max_new_tokens=spent, window=window, stop_token_ids=stop_token_ids,
                              progress=progress and f"{progress} (tokens to {bound})")
        still_going = []
        for i, (tokens, reason) in zip(going, rows):
            if not tokens and reason in ("prompt_too_long", "prompt_fills_window") and written[i]:
                reason = "length"  # an earlier span reached the window or the context: a bound, as one span says
            written[i] += tokens
            if reason == "length" and tokens and bound < max_new_tokens:
                still_going.append(i)
            else:
                results[i] = (written[i], reason)
        going = still_going
    return results


def _generate_span(target: Model, prompts: Sequence[Sequence[int]], *, batch_size: int, max_new_tokens: int,
                   window: int | None, temperature: float = 0.0, top_p: float = 1.0, seed: Any = None,
                   stop_token_ids: Sequence[int] = (), progress: str | None = None) -> list[tuple[list[int], str]]:
    """`_generate_batches` in one span of new tokens."""
    context = target.config.max_position_embeddings
    results = [([], "prompt_too_long" if len(p) >= context else "prompt_fills_window") for p in prompts]
    room = [min(context, window or context) - len(p) for p in prompts]
    order = sorted((i for i in range(len(prompts)) if room[i] >= 1), key=lambda i: len(prompts[i]))
    chunks, start = [], 0
    while start < len(order):
        # A batch's memory grows with rows x prompt length (a prefill's scores are [rows, heads,
        # prompt, slots]): long prompts (second turns) go in halved batches, so no batch costs
        # more than `batch_size` rows of BATCH_PROMPT_TOKENS, however long its prompts. Rows stay
        # a power-of-two fraction of `batch_size`: few shapes.
        rows = batch_size  # the batch's padded size
        while rows > 1 and rows * len(prompts[order[min(start + rows, len(order)) - 1]]) > \
                batch_size * BATCH_PROMPT_TOKENS:
            rows //= 2
        chunks.append((order[start: start + rows], rows))
        start += rows
    from tqdm.auto import tqdm

    for number, (chunk, padded) in enumerate(tqdm(chunks, desc=progress, unit="batch", disable=progress is None)):
        rows = [list(prompts[i]) for i in chunk]
        rows += [rows[-1]] * (padded - len(rows))
        new = min(max_new_tokens, context - max(map(len, rows)), max(room[i] for i in chunk))
        options: dict[str, Any] = {"max_new_tokens": new, "stop_token_ids": list(stop_token_ids)}
        if temperature > 0:
            options.update(temperature=temperature, top_p=top_p, seed=_derive_seed(seed, number))
        result = generate(target, None, rows, **options)
        for i, tokens, reason in zip(chunk, result.tokens, result.finish_reason):
            results[i] = (list(tokens), reason)
    return results


# ----------------------------------------------------------------------------------------------
# Magpie: the target writes the user's messages
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Synthesis:
    """What a synthesis drew. User prompts: `texts` are the distinct prompts kept (none is None),
    fewer than `requested` when the batch bound was hit. Follow-ups: one per conversation, None
    where no sample was clean. `drops`: rows dropped by reason (unfinished, template_tokens,
    empty, too_short, near_spec_bench, duplicate)."""

    texts: tuple[str | None, ...]
    requested: int
    batches: int
    drops: Mapping[str, int]

    @property
    def shortfall(self) -> int:
        return self.requested - sum(text is not None for text in self.texts)

    @property
    def examined(self) -> int:
        """Sampled rows looked at: kept or dropped (a last batch's rows past the count are not)."""
        return sum(text is not None for text in self.texts) + sum(self.drops.values())


def _control_tokens(tokenizer: Tokenizer) -> tuple[set[int], tuple[str, ...]]:
    """Ids and texts of the tokenizer's special tokens (template markers, EOS, BOS)."""
    special = {i: token.content for i, token in tokenizer.hf_tokenizer.get_added_tokens_decoder().items()
               if token.special}
    for token_id in (*tokenizer.eos_token_ids, tokenizer.bos_token_id):
        if token_id is not None:
            special.setdefault(token_id, tokenizer.hf_tokenizer.id_to_token(token_id) or "")
    return set(special), tuple(text for text in special.values() if text)


def _user_turn_end_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Ids that end a user message: the template's token right after its content (ChatML's
    <|im_end|>) when it is a special token, and every EOS/end-of-turn id."""
    text = tokenizer.render_chat([{"role": "user", "content": USER_SENTINEL}], add_generation_prompt=False)
    after = tokenizer.encode(text[text.index(USER_SENTINEL) + len(USER_SENTINEL):], add_special_tokens=False)
    special, _ = _control_tokens(tokenizer)
    first = [after[0]] if after and after[0] in special else []
    return tuple(dict.fromkeys([*first, *tokenizer.eos_token_ids]))


def _clean_user_turn(tokenizer: Tokenizer, tokens: Sequence[int], finish_reason: str, end_ids: Sequence[int],
                     control: tuple[set[int], tuple[str, ...]], spec_bench: _ReferenceIndex | None,
                     spec_bench_threshold: float) -> tuple[str | None, str | None]:
    """(text, None) for a clean sampled user message, else (None, why it was dropped); near a
    `spec_bench` reference counts as unclean."""
    if finish_reason != "stop" or not tokens or tokens[-1] not in end_ids:
        return None, "unfinished"  # hit max_new_tokens without ending its turn
    body = list(tokens[:-1])
    control_ids, control_texts = control
    text = tokenizer.decode(body, skip_special_tokens=False).strip()
    if any(t in control_ids for t in body) or any(marker in text for marker in control_texts):
        return None, "template_tokens"
    if not text:
        return None, "empty"
    if len(text.split()) < 3:
        return None, "too_short"
    if spec_bench is not None and spec_bench.score(text) >= spec_bench_threshold:
        return None, "near_spec_bench"
    return text, None


def _check_count(name: str, value: Any, minimum: int = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidRequestError(f"{name} must be an integer >= {minimum}; got {value!r}")


def synthesize_user_prompts(target: Model, count: int, *, seed: int, batch_size: int = 64, max_new_tokens: int = 96,
                            temperature: float = 1.0, top_p: float = 0.95, max_batches: int | None = None,
                            dedup_threshold: float = 0.7, spec_bench: Sequence[str] = (),
                            spec_bench_threshold: float = 0.6, progress: bool = False) -> Synthesis:
    """`count` distinct user prompts the target writes itself (Magpie): its chat template up to
    the user's message (`magpie_prefix`), then sampling until the template's end-of-turn token.
    Rows that did not end their turn, hold template tokens, are empty or under 3 words, are
    near `spec_bench` (any text to keep out) or near an earlier prompt are dropped; batches
    are drawn (seeds from (seed, batch number); the rows of a batch sample independently) until
    `count` remain or `max_batches` (default 4 x the batches `count` needs, + 4) were drawn.
    A shortfall is logged and left in the returned `Synthesis`, never hidden."""
    _check_count("count", count, 1)
    _check_count("batch_size", batch_size, 1)
    tokenizer = _chat_tokenizer(target)
    prefix, _ = chat_tokens(tokenizer, [], ending="user")
    end_ids = _user_turn_end_ids(tokenizer)
    control = _control_tokens(tokenizer)
    if max_batches is None:
        max_batches = 4 * math.ceil(count / batch_size) + 4
    duplicates = _NearDuplicateIndex(dedup_threshold)
    spec_bench_index = _ReferenceIndex(spec_bench) if spec_bench else None
    kept: list[str] = []
    drops: Counter[str] = Counter()
    batches = 0
    while len(kept) < count and batches < max_batches:
        rows = _generate_batches(target, [prefix] * batch_size, batch_size=batch_size, max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_p=top_p, seed=("magpie", seed, batches),
                                 stop_token_ids=end_ids)
        batches += 1
        if progress:
            logger.info("magpie: %d/%d prompts after %d batches", len(kept), count, batches)
        for tokens, finish_reason in rows:
            if len(kept) == count:
                break
            text, reason = _clean_user_turn(tokenizer, tokens, finish_reason, end_ids, control, spec_bench_index,
                                            spec_bench_threshold)
            if reason is None and duplicates.find(text) is not None:
                reason = "duplicate"
            if reason is not None:
                drops[reason] += 1
                continue
            duplicates.add(text)
            kept.append(text)
    if len(kept) < count:
        logger.warning("magpie: %d of %d prompts after %d batches (the max_batches bound); drops %s",
                       len(kept), count, batches, dict(drops))
    return Synthesis(texts=tuple(kept), requested=count, batches=batches, drops=dict(sorted(drops.items())))


def synthesize_follow_ups(target: Model, conversations: Sequence[Sequence[Mapping[str, Any]]], *, seed: Any,
                          batch_size: int = 64, max_new_tokens: int = 96, temperature: float = 1.0,
                          top_p: float = 0.95, attempts: int = 2, spec_bench: Sequence[str] = (),
                          spec_bench_threshold: float = 0.6, progress: bool = False) -> Synthesis:
    """The user's next message for each conversation (messages ending with an assistant turn,
    which may carry the target's "token_ids", see `chat_tokens`): the Magpie trick after the
    conversation so far. Cleaned as `synthesize_user_prompts`, but not deduplicated (second
    turns such as "Can you give an example?" recur by nature); a conversation whose samples are
    all dropped is retried up to `attempts` times (fresh seeds), then gets None. `drops` count
    samples, so a conversation that failed twice counts twice."""
    _check_count("attempts", attempts, 1)
    tokenizer = _chat_tokenizer(target)
    prefixes = [chat_tokens(tokenizer, conversation, ending="user")[0] for conversation in conversations]
    end_ids = _user_turn_end_ids(tokenizer)
    control = _control_tokens(tokenizer)
    spec_bench_index = _ReferenceIndex(spec_bench) if spec_bench else None
    texts: list[str | None] = [None] * len(prefixes)
    drops: Counter[str] = Counter()
    batches = 0
    pending = list(range(len(prefixes)))
    for attempt in range(attempts):
        if not pending:
            break
        rows = _generate_batches(target, [prefixes[i] for i in pending], batch_size=batch_size,
                                 max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 seed=("follow_up", seed, attempt), stop_token_ids=end_ids,
                                 progress="follow-ups" if progress else None)
        batches += math.ceil(len(pending) / batch_size)
        still = []
        for i, (tokens, finish_reason) in zip(pending, rows):
            text, reason = _clean_user_turn(tokenizer, tokens, finish_reason, end_ids, control, spec_bench_index,
                                            spec_bench_threshold)
            if finish_reason in ("prompt_too_long", "prompt_fills_window"):
                reason = finish_reason
            if reason is None:
                texts[i] = text
            else:
                drops[reason] += 1
                if reason not in ("prompt_too_long", "prompt_fills_window"):
                    still.append(i)
        pending = still
    return Synthesis(texts=tuple(texts), requested=len(prefixes), batches=batches, drops=dict(sorted(drops.items())))
