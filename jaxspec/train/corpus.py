"""The training corpus of a draft head: diverse prompts, the target's own answers, second turns,
packed with a loss mask over every assistant token. No network, no dataset download, nothing
from Spec-Bench (the evaluation set), and every stage resumable.

Prompt sources, all filtered the same way (`build_corpus`, stage 1):

    magpie                 `synthesize_user_prompts`: the target writes user messages itself
                           (Magpie): its chat template up to the user's message, then sampling,
                           which stops at the template's end-of-turn token
    self_instruct_topic    `jaxspec.self_instruct.topic_prompts` (templates x topics)
    self_instruct_passage  `jaxspec.self_instruct.passage_prompts` over the target's own articles
    math                   `math_prompts`: DeepMind's mathematics_dataset (Apache-2.0, generated
                           on the fly) wrapped in natural requests
    user                   a `--prompts FILE.jsonl` (`jaxspec.train.data.read_prompts_jsonl`)

Filters: `normalize` + character-shingle similarity. `deduplicate` drops near duplicates
(Jaccard, MinHash/LSH candidates, exact check) within the free-text sources (magpie, user);
the templated sources (self_instruct, math) are distinct by construction and lose only exact
repeats. `drop_near` removes everything near any turn of any Spec-Bench question (Jaccard, or
one mostly contained in the other), from every source, second turns included.

On disk (`build_corpus(target, out_dir, plan)`; rerun it to resume, `corpus_status` says where it is):

    plan.json                 the CorpusPlan, the target and input fingerprints; a different plan is refused
    pool/magpie.json          stage 1a: the synthesised user prompts and their drop counts
    pool/passages.json        stage 1b: the target's articles the passage prompts wrap
    prompts.jsonl             stage 1: {"id", "source", "text", ["template" | "module"]} per prompt
    prompts_report.json       stage 1: per source, requested / kept / drops by reason
    answers/shard_NNNNN.jsonl stage 2: the target's greedy answers, `shard_size` prompts a shard
    turn2/selection.json      stage 3: which conversations get a second turn (a seeded choice)
    turn2/shard_NNNNN.jsonl   stage 3: a synthesised follow-up and the target's answer to it
    dataset.npz               stage 4: `PackedCorpus` (a superset of `Dataset`'s file)
    manifest.json             counts per source, drops by reason, tokens, seconds per stage
    timings.json              seconds spent per stage, summed over resumed runs

A plan of several `rounds` keeps plan.json at the top and lays each round out as above in
round_000/, round_001/, ... (every file but plan.json); the top's dataset.npz and manifest.json
cover the rounds done so far ("rounds_done"), rewritten as each round finishes, so a corpus too
large for one sitting is usable, and can be committed and resumed, round by round.

Several processes may run the same build at once: each claims a file before it makes it
(`.NAME.claim` beside it: host and pid), leaves files another live worker holds, and moves on
to the next round's work while a round waits on another worker's shards (`_claim`).

Every file is written whole (a temporary file, then a rename), so a killed run leaves only
finished files behind and the next run starts at the first missing one; a finished file is
never rewritten, and greedy answers and seeded samples make the resumed corpus identical to an
uninterrupted one.

A conversation record (answers/ and turn2/ shards):

    {"id", "source", "messages": [{"role", "content"}, ...], "prompt_ids", "answer_ids",
     "finish_reason", "assistant_spans": [[start, end], ...]}

Its tokens are prompt_ids + answer_ids; `assistant_spans` are the half-open ranges of those
tokens the target wrote (both turns of a two-turn record), which `pack_conversations` turns into
the Dataset's per-token `assistant` mask (dataset.npz), so the trainer's loss covers every
turn. An assistant turn's tokens are the target's own ids, never a re-encoding of its decoded
text, so the data is what the target produced.

mathematics_dataset 1.0.1 predates sympy 1.14 and numpy 2: `_mathematics_modules` patches the
sympy import it needs, and leaves out the modules that fail on numpy 2 (`ndarray.itemset`):
calculus.differentiate, calculus.differentiate_composed, polynomials.coefficient_named,
polynomials.add, polynomials.expand, polynomials.collect, polynomials.compose. Some *_composed
modules call those internally now and then; such a draw is retried, and a module that keeps
failing is dropped for the rest of the draw. Its composed problems also drew from hash- and
id-ordered sets, so a seed did not fix them: `_make_composition_deterministic` orders them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import json
import logging
import math
import os
import pathlib
import random
import re
import socket
import sys
import time
import unicodedata
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxspec import self_instruct
from jaxspec.api import Model, generate
from jaxspec.errors import CheckpointError, InvalidRequestError
from jaxspec.tokenizer import Tokenizer
from jaxspec.train.data import Dataset, loss_mask, read_prompts_jsonl

logger = logging.getLogger(__name__)

SOURCES = ("user", "self_instruct_topic", "self_instruct_passage", "math", "magpie")  # earlier wins a tie
TEMPLATED_SOURCES = ("self_instruct_topic", "self_instruct_passage")

# ----------------------------------------------------------------------------------------------
# Text similarity: normalisation, shingles, near duplicates
# ----------------------------------------------------------------------------------------------

SHINGLE_CHARS = 5
# Containment (one text inside the other) is only trusted over enough shingles: a short text's
# few 5-grams ("what ", "at is") all occur by chance in a long article.
CONTAINED_REFERENCE_MIN_SHINGLES = 50  # a reference this long, quoted inside a text
CONTAINED_TEXT_MIN_SHINGLES = 150  # a text this long, cut out of a reference
_NUM_HASHES = 128
_HASH_PRIME = np.uint64(0x100000001B3)
_HASH_RNG = np.random.default_rng(0x5A1F)
_MINHASH_A = _HASH_RNG.integers(1, 2**63, _NUM_HASHES, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
_MINHASH_B = _HASH_RNG.integers(0, 2**63, _NUM_HASHES, dtype=np.uint64)


@functools.cache
def _punctuation_to_space() -> dict[int, str]:
    return {code: " " for code in range(sys.maxunicode + 1) if unicodedata.category(chr(code)).startswith("P")}


def normalize(text: str) -> str:
    """The text similarity is measured on: NFKC, lowercase, punctuation (Unicode P*) to spaces,
    whitespace collapsed. Symbols and digits stay ("2+3" and "2*3" differ)."""
    text = unicodedata.normalize("NFKC", text).lower().translate(_punctuation_to_space())
    return " ".join(text.split())


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: spreads a polynomial hash's bits (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shingles(text: str) -> np.ndarray:
    """uint64[n], sorted and unique: hashes of the character 5-grams of `normalize(text)` (the
    whole text when shorter); empty for a text with no characters left."""
    return _shingles_of_normalized(normalize(text))


def _shingles_of_normalized(text: str) -> np.ndarray:
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32).astype(np.uint64)
    if not len(codes):
        return np.zeros(0, np.uint64)
    width = min(SHINGLE_CHARS, len(codes))
    count = len(codes) - width + 1
    hashes = np.zeros(count, np.uint64)
    for offset in range(width):
        hashes = hashes * _HASH_PRIME + codes[offset: offset + count]
    return np.unique(_mix64(hashes))


def _intersection(a: np.ndarray, b: np.ndarray) -> int:
    return len(np.intersect1d(a, b, assume_unique=True))


def similarity(a: str, b: str) -> float:
    """Jaccard similarity of the two texts' shingle sets (1.0: the same after `normalize`)."""
    sa, sb = shingles(a), shingles(b)
    if not len(sa) and not len(sb):
        return 1.0
    shared = _intersection(sa, sb)
    return shared / (len(sa) + len(sb) - shared)


def hold_out_score(text: str, reference: str) -> float:
    """How near `text` is to a held-out `reference`: the largest of their Jaccard similarity,
    the fraction of the reference's shingles found in the text (a quoted or wrapped question;
    references of >= 50 shingles) and the fraction of the text's shingles found in the
    reference (an excerpt; texts of >= 150 shingles). `drop_near` uses the same score."""
    st, sr = shingles(text), shingles(reference)
    if not len(st) or not len(sr):
        return 0.0
    shared = _intersection(st, sr)
    score = shared / (len(st) + len(sr) - shared)
    if len(sr) >= CONTAINED_REFERENCE_MIN_SHINGLES:
        score = max(score, shared / len(sr))
    if len(st) >= CONTAINED_TEXT_MIN_SHINGLES:
        score = max(score, shared / len(st))
    return score


class _NearDuplicateIndex:
    """Texts added so far, queried for one with Jaccard >= threshold: MinHash signatures banded
    into LSH buckets give the candidates, an exact Jaccard over shingles decides. Rows per band:
    4 (32 bands) finds a pair at J = 0.7 with probability 0.9998, at 0.6 with 0.988; below a
    0.6 threshold, 2 rows (64 bands)."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.rows = 4 if threshold >= 0.6 else 2
        self.buckets: dict[tuple[int, bytes], list[int]] = {}
        self.exact: dict[str, int] = {}
        self.shingles: list[np.ndarray] = []

    @staticmethod
    def signature(hashes: np.ndarray) -> np.ndarray:
        if not len(hashes):
            return np.full(_NUM_HASHES, np.iinfo(np.uint64).max, np.uint64)
        return (hashes[None, :] * _MINHASH_A[:, None] + _MINHASH_B[:, None]).min(axis=1)

    def _bands(self, signature: np.ndarray):
        for band in range(_NUM_HASHES // self.rows):
            yield band, signature[band * self.rows: (band + 1) * self.rows].tobytes()

    def find(self, text: str) -> int | None:
        """The index of an added text near `text`, or None."""
        key = normalize(text)
        if key in self.exact:
            return self.exact[key]
        hashes = _shingles_of_normalized(key)
        seen: set[int] = set()
        for band_key in self._bands(self.signature(hashes)):
            for index in self.buckets.get(band_key, ()):
                if index in seen:
                    continue
                seen.add(index)
                other = self.shingles[index]
                shared = _intersection(hashes, other)
                union = len(hashes) + len(other) - shared
                if union and shared / union >= self.threshold:
                    return index
        return None

    def add(self, text: str) -> int:
        index = len(self.shingles)
        key = normalize(text)
        hashes = _shingles_of_normalized(key)
        self.shingles.append(hashes)
        self.exact.setdefault(key, index)
        for band_key in self._bands(self.signature(hashes)):
            self.buckets.setdefault(band_key, []).append(index)
        return index


class _ReferenceIndex:
    """Held-out references as one sorted array of (shingle hash, reference): a text's shared
    shingle count with every reference at once is a searchsorted and a bincount."""

    def __init__(self, references: Sequence[str]):
        sets = [shingles(reference) for reference in references]
        self.sizes = np.asarray([len(s) for s in sets], np.int64)
        hashes = np.concatenate(sets) if sets else np.zeros(0, np.uint64)
        owners = np.repeat(np.arange(len(sets)), self.sizes)
        order = np.argsort(hashes, kind="stable")
        self.hashes, self.owners = hashes[order], owners[order]

    def score(self, text: str) -> float:
        """`hold_out_score` against the nearest reference (0.0 with none)."""
        hashes = shingles(text)
        if not len(self.sizes) or not len(hashes):
            return 0.0
        left = np.searchsorted(self.hashes, hashes, "left")
        counts = np.searchsorted(self.hashes, hashes, "right") - left
        total = int(counts.sum())
        if not total:
            return 0.0
        starts = np.repeat(left - np.cumsum(counts) + counts, counts)
        shared = np.bincount(self.owners[starts + np.arange(total)], minlength=len(self.sizes))
        sizes = np.maximum(self.sizes, 1)
        scores = shared / (len(hashes) + sizes - shared)
        scores = np.maximum(scores, np.where(self.sizes >= CONTAINED_REFERENCE_MIN_SHINGLES, shared / sizes, 0.0))
        if len(hashes) >= CONTAINED_TEXT_MIN_SHINGLES:
            scores = np.maximum(scores, shared / len(hashes))
        return float(scores.max())


def _check_threshold(name: str, value: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= 1:
        raise InvalidRequestError(f"{name} must be a number in (0, 1]; got {value!r}")


def duplicate_flags(texts: Sequence[str], threshold: float = 0.7) -> list[bool]:
    """Per text: whether it is a near duplicate (Jaccard >= threshold) of an earlier kept text."""
    _check_threshold("threshold", threshold)
    index = _NearDuplicateIndex(threshold)
    flags = []
    for text in texts:
        duplicate = index.find(text) is not None
        if not duplicate:
            index.add(text)
        flags.append(duplicate)
    return flags


def deduplicate(texts: Sequence[str], threshold: float = 0.7) -> list[str]:
    """`texts` without near duplicates, the first of each group kept, in order. A text is dropped
    when its Jaccard similarity to a kept one is >= threshold (a chain a~b~c with a !~ c keeps a
    and c). About 20k prompts a second: MinHash/LSH finds the candidates."""
    return [text for text, duplicate in zip(texts, duplicate_flags(texts, threshold)) if not duplicate]


def near_flags(texts: Sequence[str], references: Sequence[str], threshold: float = 0.6) -> list[bool]:
    """Per text: whether its `hold_out_score` against some reference is >= threshold."""
    _check_threshold("threshold", threshold)
    index = _ReferenceIndex(references)
    return [index.score(text) >= threshold for text in texts]


def drop_near(texts: Sequence[str], references: Sequence[str], threshold: float = 0.6) -> list[str]:
    """`texts` without any that is near a reference (`hold_out_score` >= threshold): the same
    text after case, punctuation and whitespace changes, a lightly edited one, one quoting it,
    or an excerpt of it. At 0.6, Spec-Bench questions with one word replaced and upper-cased
    score 0.62 at the 5th percentile; the self-instruct and math prompts score at most 0.55."""
    return [text for text, near in zip(texts, near_flags(texts, references, threshold)) if not near]


# ----------------------------------------------------------------------------------------------
# Spec-Bench, the held-out evaluation set
# ----------------------------------------------------------------------------------------------

def default_spec_bench_path() -> pathlib.Path:
    """bench/data/spec_bench/question.jsonl of the repository this package lives in."""
    return pathlib.Path(__file__).resolve().parents[2] / "bench" / "data" / "spec_bench" / "question.jsonl"


def spec_bench_questions(path: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Spec-Bench's 480 questions, {"question_id", "category", "turns"} each (80 have two turns),
    from `path` or the repository's bench/data/spec_bench/question.jsonl."""
    if path is None:
        path = default_spec_bench_path()
        if not path.is_file():
            raise InvalidRequestError(
                f"Spec-Bench questions not found at {path}: an installed jaxspec does not ship bench/; pass the "
                "path of Spec-Bench's data/spec_bench/question.jsonl (github.com/hemingkx/Spec-Bench)")
    path = pathlib.Path(path)
    if not path.is_file():
        raise InvalidRequestError(f"Spec-Bench question file not found: {path}")
    questions = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        turns = record.get("turns") if isinstance(record, dict) else None
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
            raise CheckpointError(f"{path}:{number}: a question needs \"turns\", a non-empty list of strings")
        questions.append(record)
    if not questions:
        raise CheckpointError(f"{path} holds no questions")
    return questions


def spec_bench_turns(questions: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every turn of every question: what no training prompt may be near."""
    return [turn for question in questions for turn in question["turns"]]


# ----------------------------------------------------------------------------------------------
# Chat rendering with the target's own answer tokens
# ----------------------------------------------------------------------------------------------

# Private-use characters no real message holds: an assistant turn's content while rendering
# (replaced by its token ids afterwards), and the user message Magpie lets the target write.
_ASSISTANT_SLOT = "\ue000{}\ue001"
_ASSISTANT_SLOT_PATTERN = re.compile("\ue000(\\d+)\ue001")
USER_SENTINEL = "\ue002user message\ue003"
ENDINGS = ("complete", "assistant", "user")


def _chat_tokenizer(target: Model) -> Tokenizer:
    tokenizer = target.tokenizer
    if tokenizer is None or tokenizer.chat_template is None:
        raise InvalidRequestError("the corpus is chat text: the target needs a tokenizer with a chat template")
    return tokenizer


def _cut_at_user_sentinel(text: str) -> str:
    if text.count(USER_SENTINEL) != 1:
        raise CheckpointError("the chat template does not write a user message's content once, verbatim; "
                              "Magpie needs the template text up to the user's message")
    return text[: text.index(USER_SENTINEL)]


def magpie_prefix(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]] = ()) -> str:
    """The chat template's text up to where the next user message begins: `messages` (may be
    none) and then an open user turn, cut where the template writes its content. For ChatML
    this ends with "<|im_start|>user\\n"; SmolLM2's template puts its default system prompt first."""
    conversation = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = tokenizer.render_chat(conversation + [{"role": "user", "content": USER_SENTINEL}],
                                 add_generation_prompt=False)
    return _cut_at_user_sentinel(text)


def chat_tokens(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *,
                ending: str = "complete") -> tuple[list[int], list[tuple[int, int]]]:
    """(token ids, assistant spans) of a conversation rendered by the chat template.

    An assistant message may carry "token_ids", the target's own ids for it (its end-of-turn
    token included when it finished): they are used verbatim, and the template's own copy of a
    closing token they end with is not repeated. Without them its content is encoded and the
    template's end-of-turn token after it counts as the assistant's. Everything else is the
    template's text, encoded piece by piece between assistant turns (no BOS beyond what the
    template writes, as `encode_chat`). Spans are half-open [start, end) ranges of assistant tokens.

    `ending`: "complete" (the last message is the assistant's; the tokens end with it),
    "assistant" (the last is the user's; the tokens end with the generation prompt the target
    answers from) or "user" (the tokens end where the next user message's content begins: the
    Magpie prompt). Rendering the whole conversation once, rather than turn by turn, gives the
    right tokens for templates that render earlier turns differently once more follow.
    """
    if ending not in ENDINGS:
        raise InvalidRequestError(f"ending must be one of {ENDINGS}; got {ending!r}")
    messages = list(messages)
    last_role = messages[-1]["role"] if messages else None
    if ending == "complete" and last_role != "assistant":
        raise InvalidRequestError("a complete conversation ends with an assistant message")
    if ending == "assistant" and last_role != "user":
        raise InvalidRequestError("a conversation awaiting the assistant ends with a user message")
    if ending == "user" and last_role == "user":
        raise InvalidRequestError("a conversation awaiting the user cannot end with a user message")
    rendered, answers = [], []
    for message in messages:
        if message["role"] == "assistant":
            ids = message.get("token_ids")
            answers.append((message["content"], None if ids is None else [int(t) for t in ids]))
            rendered.append({"role": "assistant", "content": _ASSISTANT_SLOT.format(len(answers) - 1)})
        else:
            rendered.append({"role": message["role"], "content": message["content"]})
    if ending == "user":
        rendered.append({"role": "user", "content": USER_SENTINEL})
    text = tokenizer.render_chat(rendered, add_generation_prompt=ending == "assistant")
    if ending == "user":
        text = _cut_at_user_sentinel(text)
    pieces = _ASSISTANT_SLOT_PATTERN.split(text)  # template text, slot number, template text, ...
    if [int(slot) for slot in pieces[1::2]] != list(range(len(answers))):
        raise CheckpointError("the chat template does not write each assistant message's content once, in order")
    end_of_turn = set(tokenizer.eos_token_ids)
    tokens = tokenizer.encode(pieces[0], add_special_tokens=False)
    spans: list[tuple[int, int]] = []
    for slot, (content, ids) in enumerate(answers):
        start = len(tokens)
        tokens += ids if ids is not None else tokenizer.encode(content, add_special_tokens=False)
        after = tokenizer.encode(pieces[2 * slot + 2], add_special_tokens=False)
        last = slot == len(answers) - 1
        closing = after[:1] if after and after[0] in end_of_turn else []
        if ids is not None and ids and closing and ids[-1] == closing[0]:
            after = after[1:]  # the target wrote the template's closing token itself
        elif ids is None and closing:
            tokens.append(after.pop(0))  # the end of a turn it did not write the ids of: still its turn
        spans.append((start, len(tokens)))
        if not (last and ending == "complete"):
            tokens += after
    return tokens, spans


# ----------------------------------------------------------------------------------------------
# Generation in fixed-shape batches
# ----------------------------------------------------------------------------------------------

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
    along, and every step reads a cache sized for the longest. Half the answers here end well
    before the bound (mean 177 of 512 tokens) and half run to it: by a step cost linear in the
    cache, two spans should spend about 0.6x the time of one. Measured together with the
    cache-major attention: an answer shard of 256 prompts took 1,212 s, against 3,419 s in one
    span before both (2.8x; the two were not timed apart)."""
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
        # more than `batch_size` rows of BATCH_PROMPT_TOKENS (64 rows of 1,024-token prompts
        # took 11 GB here). Rows stay a power-of-two fraction of `batch_size`: few shapes.
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


# ----------------------------------------------------------------------------------------------
# Math word problems: DeepMind's mathematics_dataset
# ----------------------------------------------------------------------------------------------

BROKEN_MATH_MODULES = frozenset({
    "calculus.differentiate", "calculus.differentiate_composed", "polynomials.coefficient_named",
    "polynomials.add", "polynomials.expand", "polynomials.collect", "polynomials.compose",
})  # they call ndarray.itemset, gone in numpy 2
MATH_REQUESTS = (
    "Solve this and explain each step: {question}",
    "Can you help me with this math problem? {question}",
    "Work through the following problem, showing your reasoning.\n\n{question}",
    "Here is a question from my homework: {question} How do I solve it?",
    "{question} Explain how you get the answer.",
    "I'm stuck on this one: {question}",
)
_MATH_ATTEMPTS = 20  # draws of one module in a row that may fail before it is dropped


@functools.cache
def _mathematics_modules() -> tuple[tuple[str, Callable[[], Any]], ...]:
    """(area.name, problem generator) of every mathematics_dataset module that runs here, sorted."""
    try:
        importlib.import_module("sympy.solvers.diophantine")
        from sympy.solvers.diophantine.diophantine import base_solution_linear

        # mathematics_dataset imports base_solution_linear from the package, which sympy 1.14 no
        # longer re-exports; the package attribute is shadowed by the diophantine() function.
        sys.modules["sympy.solvers.diophantine"].base_solution_linear = base_solution_linear
    except ImportError:
        pass  # an older sympy exports it already
    try:
        from mathematics_dataset.modules import modules
        from mathematics_dataset.util import composition
    except ImportError as error:
        raise InvalidRequestError(
            "math prompts need DeepMind's mathematics_dataset: pip install mathematics-dataset "
            f"(or pip install 'jaxspec[train]'); importing it failed: {error}") from None
    _make_composition_deterministic(composition)
    found = modules.train(lambda entropy: entropy)
    return tuple(sorted((f"{area}.{name}", generator) for area, generators in found.items()
                        for name, generator in generators.items() if f"{area}.{name}" not in BROKEN_MATH_MODULES))


def _make_composition_deterministic(composition: Any) -> None:
    """The composed problems draw from sets: of letters (`Context.pop`, ordered by string hashes,
    which PYTHONHASHSEED salts) and of entities (`expand_entities`, ordered by object ids), so
    the same seed gave different problems. Both draw from an ordered list instead (the same
    random calls, so nothing else changes)."""
    if getattr(composition, "_jaxspec_deterministic", False):
        return

    def pop(self):
        allowed = (composition._ALLOWED_SYMBOLS.difference(self._relation_symbols)
                   .difference(self._self_symbols).difference(self._child_symbols))
        if not allowed:
            raise ValueError("Ran out of symbols")
        symbol = random.choice(sorted(allowed))
        self._self_symbols.add(symbol)
        return symbol

    def expand_entities(context, **kwargs):  # composition.expand_entities, its set made a list in order
        kwargs = kwargs.copy()
        entities = list(context.child_entities)
        for key, maybe_entity in kwargs.items():
            if isinstance(maybe_entity, composition.Entity):
                entities.append(maybe_entity)
                kwargs[key] = maybe_entity.handle
        entities = list(dict.fromkeys(entities))
        random.shuffle(entities)
        descriptions = []
        for entity in entities:
            descriptions.append(entity.child_description)
            if not entity.expression_used:
                descriptions.append(entity.description)
        return " ".join(d for d in descriptions if d), kwargs

    composition.Context.pop = pop
    composition.expand_entities = expand_entities
    composition._jaxspec_deterministic = True


def math_modules() -> list[str]:
    """The mathematics_dataset modules `math_prompts` draws from (area.name)."""
    return [name for name, _ in _mathematics_modules()]


def math_problems(count: int, seed: int) -> list[tuple[str, str]]:
    """`count` distinct (module, question) pairs, round-robin over a seeded order of the working
    modules. The dataset draws from Python's, numpy's and sympy's global generators: all are
    seeded here and restored afterwards, and its set-ordered draws are made ordered
    (`_make_composition_deterministic`), so the result depends on `seed` alone, in any process,
    and callers' streams are left as they were."""
    _check_count("count", count, 0)
    import sympy.core.random as sympy_random  # randprime draws from sympy's own generators

    generators = list(_mathematics_modules())
    order = np.random.default_rng([seed, 0x3A7]).permutation(len(generators))
    generators = [generators[i] for i in order]
    sympy_generators = (sympy_random.rng, sympy_random._assumptions_rng)
    saved = random.getstate(), np.random.get_state(), [g.getstate() for g in sympy_generators]
    problems: dict[str, str] = {}
    try:
        random.seed(seed)
        np.random.seed(_derive_seed("math", seed))
        sympy_random.seed(_derive_seed("math-sympy", seed))
        slot = 0
        while len(problems) < count and generators:
            name, generator = generators[slot % len(generators)]
            for _ in range(_MATH_ATTEMPTS):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        question = " ".join(str(generator().question).split())
                    break
                except Exception:  # noqa: BLE001 - a numpy-2 failure inside the old package
                    question = None
            if question is None:
                logger.warning("mathematics_dataset module %s fails on every draw; left out", name)
                generators.remove((name, generator))
                continue
            problems.setdefault(question, name)
            slot += 1
            if slot > 20 * count + 100:
                break  # modules whose questions keep repeating: return what there is
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        for generator, state in zip(sympy_generators, saved[2]):
            generator.setstate(state)
    return [(name, question) for question, name in problems.items()]


def math_prompts(count: int, seed: int) -> list[str]:
    """`count` math word problems from mathematics_dataset (`math_problems`), each wrapped in one
    of a few natural request phrasings (seeded)."""
    return [wrapped for _, wrapped in _wrapped_math(count, seed)]


def _wrapped_math(count: int, seed: int) -> list[tuple[str, str]]:
    rng = np.random.default_rng([seed, 0x3A8])
    return [(module, MATH_REQUESTS[int(rng.integers(len(MATH_REQUESTS)))].format(question=question))
            for module, question in math_problems(count, seed)]


# ----------------------------------------------------------------------------------------------
# A held-out split disjoint by template and by source
# ----------------------------------------------------------------------------------------------

def _fill(template: str, field: str) -> tuple[str, str]:
    prefix, _, suffix = template.partition("{" + field + "}")
    return prefix, suffix


@functools.cache
def _topic_templates() -> dict[str, str]:
    """Every self_instruct topic prompt -> its template key ("writing:2", "coding:0")."""
    keys = {}
    for kind, templates in self_instruct.TEMPLATES.items():
        for number, template in enumerate(templates):
            for topic in self_instruct.TOPICS:
                keys.setdefault(template.format(topic=topic), f"{kind}:{number}")
    for number, template in enumerate(self_instruct.CODING_TEMPLATES):
        for task in self_instruct.CODING_TASKS:
            keys.setdefault(template.format(task=task), f"coding:{number}")
    return keys


def self_instruct_template(text: str, source: str) -> str:
    """The template a self_instruct prompt was written from: "kind:number" (topic prompts;
    "word_problem" for the generated arithmetic problems) or "passage/kind:number"."""
    if source == "self_instruct_topic":
        return _topic_templates().get(text, "word_problem")
    best, key = "", None
    for kind, templates in self_instruct.PASSAGE_TEMPLATES.items():
        for number, template in enumerate(templates):
            prefix, suffix = _fill(template, "passage")
            if text.startswith(prefix) and text.endswith(suffix) and len(prefix) + len(suffix) >= len(best):
                best, key = prefix + suffix, f"passage/{kind}:{number}"
    if key is None:
        raise InvalidRequestError(f"not a self_instruct passage prompt: {text[:60]!r}")
    return key


@functools.cache
def _template_groups(source: str) -> frozenset[str]:
    """Every `split_group` key a templated source's prompts can have."""
    if source == "self_instruct_topic":
        keys = {*_topic_templates().values(), "word_problem"}
    else:
        keys = {f"passage/{kind}:{number}" for kind, templates in self_instruct.PASSAGE_TEMPLATES.items()
                for number in range(len(templates))}
    return frozenset(f"{source}/{key}" for key in keys)


def split_group(record: Mapping[str, Any]) -> str:
    """The unit `held_out_split` keeps whole: a self_instruct prompt's source and template, else
    the source and the hash of the prompt's normalized text (each prompt its own group)."""
    source = record["source"]
    if source in TEMPLATED_SOURCES:
        return f"{source}/{record.get('template') or self_instruct_template(record['text'], source)}"
    return f"{source}/{hashlib.sha256(normalize(record['text']).encode()).hexdigest()[:16]}"


def _unit_hash(seed: int, key: str) -> float:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest(), "little") / 2**64


def held_out_split(records: Sequence[Mapping[str, Any]], fraction: float,
                   seed: int) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """(training records, held-out records), each in the input order; records are prompt records
    ({"source", "text", optional "template"}, as prompts.jsonl holds them).

    Disjoint by template: a self_instruct prompt is TEMPLATE.format(topic=...) (or
    passage=...), and whole templates are held out, round(fraction x templates) of every
    template self_instruct has for that source (at least one, never all; whether or not
    `records` use them, so the choice is the same for any part of a corpus), so no held-out
    prompt shares its instruction wording with a training one. Topics, and the articles passage
    prompts wrap, do recur across templates: the held-out set measures unseen phrasings of
    known subjects, not unseen subjects. Disjoint by source: every other prompt (magpie, math,
    user) is held out on its own, when the hash of (seed, source, normalized text) falls below
    `fraction`, so a roughly `fraction` slice of each source is held out and texts that
    normalize alike go the same way. The choice depends on the seed and each group's key,
    not on the order or the number of records: each record's fate is its own, so the rounds
    of a corpus, split apart, agree with the split of their union."""
    if not isinstance(fraction, int | float) or isinstance(fraction, bool) or not 0 <= fraction < 1:
        raise InvalidRequestError(f"fraction must be a number in [0, 1); got {fraction!r}")
    groups = [split_group(record) for record in records]
    held: set[str] = set()
    for source in TEMPLATED_SOURCES:
        keys = sorted(_template_groups(source), key=lambda k: _unit_hash(seed, k))
        if fraction > 0 and len(keys) >= 2:
            held.update(keys[: min(len(keys) - 1, max(1, round(fraction * len(keys))))])
    held.update(g for g, r in zip(groups, records)
                if r["source"] not in TEMPLATED_SOURCES and _unit_hash(seed, g) < fraction)
    train = [r for g, r in zip(groups, records) if g not in held]
    return train, [r for g, r in zip(groups, records) if g in held]


# ----------------------------------------------------------------------------------------------
# Packing conversations with a per-token assistant mask
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class PackedCorpus:
    """Packed conversations: `data` is a `Dataset` whose `assistant` mask marks the tokens the
    target wrote, in every turn (its prompt_lengths: each row's first assistant token), plus
    what the model card needs. Its `held_out` flags (the rows whose prompt is in
    `held_out_split`'s held-out part) are the validation rows training takes. dataset.npz holds
    Dataset's arrays under its own names, so `Dataset.load` (and the trainer) read it as is, and
    these beside them:

        turns      int32[N]  assistant turns in the row (1 or 2)
        ids        str[N]    the conversation's prompt id (prompts.jsonl)
    """

    data: Dataset
    turns: np.ndarray
    ids: np.ndarray

    @property
    def held_out(self) -> np.ndarray:
        """bool[N]: the row's prompt is held out of training (`data.held_out`)."""
        return self.data.held_out

    def loss_mask(self) -> np.ndarray:
        """bool[N, T]: position t's next-token prediction is an assistant token (`data.loss_mask`)."""
        return loss_mask(self.data.assistant, self.data.lengths)

    def save(self, path: pathlib.Path) -> None:
        """Written whole or not at all (a temporary file, then a rename)."""
        arrays = {**self.data.arrays(), "turns": self.turns, "ids": self.ids}
        _write_atomic(pathlib.Path(path), lambda handle: np.savez(handle, **arrays), binary=True)

    @classmethod
    def concatenate(cls, parts: Sequence[PackedCorpus]) -> PackedCorpus:
        """The rows of every part in order (parts of one seq_len: a corpus's rounds)."""
        if len({part.data.seq_len for part in parts}) != 1:
            raise InvalidRequestError("packed corpora of different seq_len cannot be concatenated")

        def joined(name: str) -> np.ndarray:
            return np.concatenate([getattr(part.data, name) for part in parts])

        data = Dataset(joined("tokens"), joined("lengths"), joined("prompt_lengths"), assistant=joined("assistant"),
                       held_out=joined("held_out"))
        return cls(data, np.concatenate([part.turns for part in parts]), np.concatenate([part.ids for part in parts]))

    @classmethod
    def load(cls, path: pathlib.Path) -> PackedCorpus:
        data = Dataset.load(path)
        try:
            with np.load(path) as arrays:
                packed = cls(data, arrays["turns"].astype(np.int32), arrays["ids"].astype(str))
        except (OSError, KeyError, ValueError) as error:
            raise CheckpointError(f"{path} is not a packed corpus (no turns/ids): {error}") from None
        if data.assistant is None or data.held_out is None:
            raise CheckpointError(f"{path} is not a packed corpus: it has no assistant mask or no held_out flags")
        return packed


def conversation_mask(length: int, spans: Sequence[Sequence[int]]) -> np.ndarray:
    """bool[length]: which of a conversation's tokens lie in its assistant spans."""
    mask = np.zeros(length, bool)
    for start, end in spans:
        mask[start:end] = True
    return mask


def pack_conversations(records: Sequence[Mapping[str, Any]], seq_len: int, *,
                       held_out_ids: Sequence[str] = ()) -> tuple[PackedCorpus, dict[str, Any]]:
    """Conversation records (prompt_ids + answer_ids, assistant_spans) as right-padded rows of
    `seq_len` tokens: a longer conversation is cut to the window (not dropped); one with no
    assistant token inside the window ("prompt_fills_window"), an empty answer (the target
    only ended its turn: "empty_answer") or none ("prompt_too_long") is dropped. Returns the
    packed corpus and {"dropped": by reason, "cut_to_window": rows cut}; rows in
    `held_out_ids` are flagged held out."""
    if not isinstance(seq_len, int) or seq_len < 4:
        raise InvalidRequestError(f"seq_len must be an integer >= 4; got {seq_len!r}")
    held = set(held_out_ids)
    drops: Counter[str] = Counter()
    rows, cut = [], 0
    for record in records:
        tokens = list(record["prompt_ids"]) + list(record["answer_ids"])
        mask = conversation_mask(len(tokens), record["assistant_spans"])[:seq_len]
        if record.get("finish_reason") in ("prompt_too_long", "prompt_fills_window"):
            drops[record["finish_reason"]] += 1
        elif not record["messages"][-1]["content"].strip():
            drops["empty_answer"] += 1
        elif not mask.any():
            drops["prompt_fills_window"] += 1
        else:
            cut += len(tokens) > seq_len
            rows.append((tokens[:seq_len], mask, record))
    if not rows:
        raise InvalidRequestError(f"no conversation has an assistant token within seq_len={seq_len}")
    tokens = np.zeros((len(rows), seq_len), np.int32)
    masks = np.zeros((len(rows), seq_len), bool)
    for row, (ids, mask, _) in enumerate(rows):
        tokens[row, : len(ids)] = ids
        masks[row, : len(mask)] = mask
    lengths = np.asarray([len(ids) for ids, _, _ in rows], np.int32)
    prompt_lengths = masks.argmax(axis=1).astype(np.int32)  # the first assistant token
    ids = np.asarray([record["id"] for _, _, record in rows], str)
    held_flags = np.asarray([record["id"] in held for _, _, record in rows], bool)
    packed = PackedCorpus(
        data=Dataset(tokens, lengths, prompt_lengths, assistant=masks, held_out=held_flags),
        turns=np.asarray([len(record["assistant_spans"]) for _, _, record in rows], np.int32), ids=ids)
    return packed, {"dropped": dict(sorted(drops.items())), "cut_to_window": cut}


# ----------------------------------------------------------------------------------------------
# The resumable build
# ----------------------------------------------------------------------------------------------

PLAN_FILE, PROMPTS_FILE, PROMPTS_REPORT_FILE = "plan.json", "prompts.jsonl", "prompts_report.json"
MAGPIE_FILE, PASSAGES_FILE = "pool/magpie.json", "pool/passages.json"
ANSWERS_DIR, TURN2_DIR, SELECTION_FILE = "answers", "turn2", "turn2/selection.json"
DATASET_FILE, MANIFEST_FILE, TIMINGS_FILE = "dataset.npz", "manifest.json", "timings.json"
FORMAT_VERSION = 2  # 2: rounds; the target named by its file name and weight format
ROUND_DIR = "round_{:03d}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorpusPlan:
    """What `build_corpus` makes; every field is recorded in plan.json and must match on resume.

    Counts per source (after filtering, when the source can draw more: magpie); `prompts_file`
    a JSONL of {"prompt"|"text"} to add (all of it). `follow_up_fraction` of the conversations
    that ended their first answer get a second turn. Answers are greedy, end at EOS or
    `answer_max_new_tokens`, and are never generated past the `seq_len` training window.
    `seed` derives every seed (Magpie batches, self_instruct, math, follow-up choice, the split).

    `rounds` > 1 builds the corpus in that many rounds, each a whole corpus of its own in
    round_NNN/ holding an even share of every count (`RoundShare`), so that a corpus too big for
    one sitting grows by finished rounds: after each, dataset.npz at the top covers every round
    done. The rounds draw disjoint slices of the finite pools (self_instruct topics and articles,
    the prompts file), their own seeds for the sampled sources (Magpie, math), and drop any prompt
    near one of an earlier round.
    """

    magpie: int = 6144
    self_instruct_topic: int = 1536
    self_instruct_passage: int = 512
    math: int = 2048
    prompts_file: str | None = None
    follow_up_fraction: float = 0.25
    magpie_max_new_tokens: int = 96
    magpie_temperature: float = 1.0
    magpie_top_p: float = 0.95
    magpie_max_batches: int | None = None
    follow_up_attempts: int = 2
    passage_max_new_tokens: int = 256
    answer_max_new_tokens: int = 1024
    seq_len: int = 2048
    magpie_batch_size: int = 64
    answer_batch_size: int = 32
    shard_size: int = 256
    seed: int = 0
    dedup_threshold: float = 0.7
    spec_bench_threshold: float = 0.6
    held_out_fraction: float = 0.05
    spec_bench_path: str | None = None
    rounds: int = 1

    def __post_init__(self):
        _check_count("rounds", self.rounds, 1)
        for name in ("magpie", "self_instruct_topic", "self_instruct_passage", "math", "seed"):
            _check_count(name, getattr(self, name), 0)
        for name in ("magpie_max_new_tokens", "passage_max_new_tokens", "answer_max_new_tokens", "magpie_batch_size",
                     "answer_batch_size", "shard_size", "follow_up_attempts"):
            _check_count(name, getattr(self, name), 1)
        _check_count("seq_len", self.seq_len, 4)
        if self.magpie_max_batches is not None:
            _check_count("magpie_max_batches", self.magpie_max_batches, 1)
        if self.self_instruct_topic:
            try:  # the topic pool's size depends on the seed (repeated word problems are dropped)
                self_instruct.topic_prompts(self.self_instruct_topic, self.seed)
            except InvalidRequestError as error:
                raise InvalidRequestError(f"self_instruct_topic: {error}") from None
        for name in ("dedup_threshold", "spec_bench_threshold", "magpie_top_p"):
            _check_threshold(name, getattr(self, name))
        for name, upper in (("follow_up_fraction", 1.0), ("held_out_fraction", 0.999)):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= upper:
                raise InvalidRequestError(f"{name} must be a number in [0, {upper:g}]; got {value!r}")
        if not isinstance(self.magpie_temperature, int | float) or self.magpie_temperature <= 0:
            raise InvalidRequestError(f"magpie_temperature must be a number > 0; got {self.magpie_temperature!r}")
        for name in ("prompts_file", "spec_bench_path"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidRequestError(f"{name} must be a path string or None; got {value!r}")
        if not (self.magpie or self.self_instruct_topic or self.self_instruct_passage or self.math
                or self.prompts_file):
            raise InvalidRequestError("the plan has no prompt source: every count is 0 and there is no prompts_file")

    def requested(self, source: str) -> int | None:
        """The plan's count for `source` (None for the user file: all of it)."""
        return {"magpie": self.magpie, "self_instruct_topic": self.self_instruct_topic,
                "self_instruct_passage": self.self_instruct_passage, "math": self.math}.get(source)


@dataclasses.dataclass(frozen=True)
class RoundShare:
    """Round `index` of a plan's `rounds`: which slice of each source it draws, and its seed.

    A plan of one round is the whole corpus in its own directory, drawn with the plan's seed, as
    before rounds existed. Round r of R takes [total * r // R, total * (r + 1) // R) of every
    count: for the finite pools (self_instruct topics, the article prompts behind passages, the
    prompts file) a slice of the one seeded order the plan draws, so rounds never repeat a
    prompt; for the sampled sources (Magpie, math) that many prompts drawn with the round's own
    seed, and `earlier` (the prompts of rounds before it) to drop near duplicates against."""

    plan: CorpusPlan
    index: int = 0
    earlier: tuple[tuple[str, str], ...] = ()  # (source, text) of every earlier round's prompts

    @property
    def seed(self) -> int:
        return self.plan.seed if self.plan.rounds == 1 else _derive_seed("round", self.plan.seed, self.index)

    def span(self, total: int) -> tuple[int, int]:
        """[start, stop) of `total` items that this round takes."""
        rounds = self.plan.rounds
        return total * self.index // rounds, total * (self.index + 1) // rounds

    def count(self, source: str) -> int:
        start, stop = self.span(self.plan.requested(source))
        return stop - start

    def id_prefix(self) -> str:
        return "" if self.plan.rounds == 1 else f"r{self.index:03d}-"


# --- files -------------------------------------------------------------------------------------

def _write_atomic(path: pathlib.Path, write: Callable[[Any], None], binary: bool = False) -> None:
    """Write via a temporary file and a rename: a killed run never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _write_json(path: pathlib.Path, value: Any) -> None:
    _write_atomic(path, lambda handle: json.dump(value, handle, indent=1, ensure_ascii=False))


def _write_jsonl(path: pathlib.Path, records: Sequence[Mapping[str, Any]]) -> None:
    _write_atomic(path, lambda handle: handle.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is not readable JSON ({error}); delete it to rebuild that stage") from None


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{path}:{number}: not valid JSON ({error.msg}); delete the file to "
                                  "regenerate it") from None
    return records


class _Busy(Exception):
    """A file this build needs is being made by another live worker."""


CLAIM_POLL_SECONDS = 30.0
_EMPTY_CLAIM_SECONDS = 60.0  # a claim file still empty after this long: its writer died creating it


def _claim_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(f".{path.name}.claim")


def _claimant_alive(claim: pathlib.Path) -> bool:
    """Whether the worker that wrote `claim` ("host pid") may still be making its file: a process
    of this host that is gone is not; one of another host (a shared directory) is assumed alive."""
    try:
        text = claim.read_text(encoding="utf-8").split()
        age = time.time() - claim.stat().st_mtime
    except FileNotFoundError:
        return False
    if len(text) != 2 or not text[1].isdigit():
        return age < _EMPTY_CLAIM_SECONDS
    host, pid = text[0], int(text[1])
    if host != socket.gethostname():
        return True
    if pid == os.getpid():
        return False  # our own, left by an interrupted attempt in this process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _claim(path: pathlib.Path):
    """Claim the making of `path` for this process, or raise _Busy if a live worker holds it.

    Several processes may build one corpus at once: each claims a file before it makes it (a
    `.NAME.claim` beside it, created exclusively, holding host and pid) and releases it once the
    file is written; a claim whose process is gone is taken over. Two workers taking over the
    same dead claim at the same instant may both make the file: the work is repeated, never
    wrong (the same deterministic content, each write atomic)."""
    claim = _claim_path(path)
    claim.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            handle = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            if _claimant_alive(claim):
                raise _Busy(path) from None
            claim.unlink(missing_ok=True)
    with os.fdopen(handle, "w", encoding="utf-8") as out:
        out.write(f"{socket.gethostname()} {os.getpid()}\n")
    try:
        yield
    finally:
        claim.unlink(missing_ok=True)


def _made_once(path: pathlib.Path, read: Callable[[pathlib.Path], Any], make: Callable[[], None]) -> Any:
    """`read(path)`, `make()` writing it first unless it is there (claimed while it is made)."""
    if not path.is_file():
        with _claim(path):
            if not path.is_file():  # another worker may have finished it meanwhile
                make()
    return read(path)


def _file_sha256(path: str | os.PathLike[str]) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def _shard_path(out_dir: pathlib.Path, stage: str, number: int) -> pathlib.Path:
    return out_dir / stage / f"shard_{number:05d}.jsonl"


def _add_seconds(out_dir: pathlib.Path, stage: str, seconds: float) -> None:
    path = out_dir / TIMINGS_FILE
    timings = _read_json(path) if path.is_file() else {}
    timings[stage] = round(timings.get(stage, 0.0) + seconds, 3)
    _write_json(path, timings)


# --- the plan ------------------------------------------------------------------------------------

def _target_fingerprint(target: Model) -> dict[str, Any]:
    tokenizer = _chat_tokenizer(target)
    # The source by its file name, not its path: a corpus committed or copied elsewhere resumes there.
    source = None if target.source is None else pathlib.PurePath(str(target.source)).name
    return {"config": repr(target.config), "source": source, "weight_format": str(target.weight_format),
            "vocab_size": tokenizer.vocab_size,
            "chat_template_sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()}


def _plan_record(target: Model, plan: CorpusPlan) -> dict[str, Any]:
    spec_bench = plan.spec_bench_path or default_spec_bench_path()
    if plan.prompts_file is not None and not pathlib.Path(plan.prompts_file).is_file():
        raise InvalidRequestError(f"prompt file not found: {plan.prompts_file}")
    return {"format": FORMAT_VERSION, "plan": dataclasses.asdict(plan), "target": _target_fingerprint(target),
            "prompts_file_sha256": None if plan.prompts_file is None else _file_sha256(plan.prompts_file),
            "spec_bench_sha256": _file_sha256(spec_bench) if pathlib.Path(spec_bench).is_file() else None}


def _check_plan(out_dir: pathlib.Path, record: dict[str, Any]) -> None:
    """Write plan.json, or refuse a directory built with a different plan, naming what differs."""
    path = out_dir / PLAN_FILE
    if not path.is_file():
        if out_dir.is_dir() and any(out_dir.iterdir()):
            raise InvalidRequestError(f"{out_dir} is not empty and holds no {PLAN_FILE}: not a corpus directory")
        _write_json(path, record)
        return
    saved = _read_json(path)
    ours, theirs = record["plan"], saved.get("plan", {})
    changed = [f"{name} ({theirs.get(name)!r} there, {ours[name]!r} now)" for name in ours
               if theirs.get(name) != ours[name]]
    changed += [f"{name} (different)" for name in ("format", "target", "prompts_file_sha256", "spec_bench_sha256")
                if saved.get(name) != record[name]]
    if changed:
        raise InvalidRequestError(f"{out_dir} holds a corpus built with a different plan: {'; '.join(changed)}. "
                                  "Use another directory, or delete this one to rebuild")


# --- stage 1: prompts ---------------------------------------------------------------------------

def _magpie_pool(target: Model, out_dir: pathlib.Path, share: RoundShare, spec_turns: list[str],
                 progress: bool) -> dict[str, Any]:
    return _made_once(out_dir / MAGPIE_FILE, _read_json,
                      lambda: _write_magpie_pool(target, out_dir, share, spec_turns, progress))


def _write_magpie_pool(target: Model, out_dir: pathlib.Path, share: RoundShare, spec_turns: list[str],
                       progress: bool) -> None:
    path = out_dir / MAGPIE_FILE
    start = time.perf_counter()
    plan = share.plan
    synthesis = synthesize_user_prompts(
        target, share.count("magpie"), seed=share.seed, batch_size=plan.magpie_batch_size,
        max_new_tokens=plan.magpie_max_new_tokens, temperature=plan.magpie_temperature, top_p=plan.magpie_top_p,
        max_batches=plan.magpie_max_batches, dedup_threshold=plan.dedup_threshold, spec_bench=spec_turns,
        spec_bench_threshold=plan.spec_bench_threshold, progress=progress)
    # Rows sampled = batches x batch size; the last batch's rows past `count` are never examined.
    pool = {"prompts": list(synthesis.texts), "requested": synthesis.requested, "batches": synthesis.batches,
            "sampled": synthesis.batches * plan.magpie_batch_size, "examined": synthesis.examined,
            "drops": dict(synthesis.drops)}
    _write_json(path, pool)
    _add_seconds(out_dir, "magpie", time.perf_counter() - start)


def _passage_pool(target: Model, out_dir: pathlib.Path, share: RoundShare, progress: bool) -> dict[str, Any]:
    """The target's greedy articles for the round's slice of up to `self_instruct_passage` article
    prompts (one seeded order for every round): the passages."""
    return _made_once(out_dir / PASSAGES_FILE, _read_json, lambda: _write_passage_pool(target, out_dir, share, progress))


def _write_passage_pool(target: Model, out_dir: pathlib.Path, share: RoundShare, progress: bool) -> None:
    path = out_dir / PASSAGES_FILE
    start = time.perf_counter()
    plan = share.plan
    tokenizer = _chat_tokenizer(target)
    articles = [text for text in _topic_templates() if self_instruct.is_article_prompt(text)]
    order = np.random.default_rng([plan.seed, 0xA27]).permutation(len(articles))[: plan.self_instruct_passage]
    order = order[slice(*share.span(len(order)))]
    articles = [articles[i] for i in order]
    prompts = [chat_tokens(tokenizer, [{"role": "user", "content": p}], ending="assistant")[0] for p in articles]
    rows = _generate_batches(target, prompts, batch_size=plan.answer_batch_size,
                             max_new_tokens=plan.passage_max_new_tokens, progress="passages" if progress else None)
    passages = [_answer_text(tokenizer, tokens) for tokens, _ in rows]
    _write_json(path, {"article_prompts": articles, "passages": passages})
    _add_seconds(out_dir, "passages", time.perf_counter() - start)


def _user_prompts(path: str) -> list[str]:
    prompts = read_prompts_jsonl(path)
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"{path}: prompt {index} is token ids; the corpus needs text prompts")
    return prompts


def _filter_source(source: str, texts: Sequence[str], extras: Sequence[dict[str, Any]], spec_bench: _ReferenceIndex,
                   seen: set[str], share: RoundShare) -> tuple[list[tuple[str, dict[str, Any]]], Counter[str]]:
    """A source's prompts without empty ones, near-Spec-Bench ones and duplicates (near for the
    free-text sources, exact for the templated ones; exact across sources via `seen`), and
    without any that repeats a prompt of an earlier round (`share.earlier`: exactly, or near
    one of the same free-text source): "earlier_round"."""
    plan = share.plan
    drops: Counter[str] = Counter()
    near_earlier = _NearDuplicateIndex(plan.dedup_threshold) if source in ("user", "magpie") else None
    earlier_round = _NearDuplicateIndex(plan.dedup_threshold) if near_earlier is not None else None
    earlier_keys = {" ".join(text.split()) for _, text in share.earlier}
    for earlier_source, text in share.earlier:
        if earlier_round is not None and earlier_source == source:
            earlier_round.add(text)
    kept = []
    for text, extra in zip(texts, extras):
        text = text.strip()
        key = " ".join(text.split())
        if not text:
            reason = "empty"
        elif spec_bench.score(text) >= plan.spec_bench_threshold:
            reason = "near_spec_bench"
        elif key in earlier_keys or (earlier_round is not None and earlier_round.find(text) is not None):
            reason = "earlier_round"
        elif key in seen or (near_earlier is not None and near_earlier.find(text) is not None):
            reason = "duplicate"
        else:
            reason = None
        if reason is not None:
            drops[reason] += 1
            continue
        seen.add(key)
        if near_earlier is not None:
            near_earlier.add(text)
        kept.append((text, extra))
    return kept, drops


def _build_prompts(target: Model, out_dir: pathlib.Path, share: RoundShare, spec_turns: list[str],
                   progress: bool) -> list[dict[str, Any]]:
    return _made_once(out_dir / PROMPTS_FILE, _read_jsonl,
                      lambda: _write_prompts(target, out_dir, share, spec_turns, progress))


def _write_prompts(target: Model, out_dir: pathlib.Path, share: RoundShare, spec_turns: list[str],
                   progress: bool) -> None:
    path = out_dir / PROMPTS_FILE
    plan = share.plan
    raw: dict[str, tuple[list[str], list[dict[str, Any]]]] = {}
    report: dict[str, dict[str, Any]] = {}
    if plan.prompts_file is not None:
        texts = _user_prompts(plan.prompts_file)
        texts = texts[slice(*share.span(len(texts)))]
        raw["user"] = (texts, [{}] * len(texts))
    if share.count("self_instruct_topic"):
        texts = self_instruct.topic_prompts(plan.self_instruct_topic, plan.seed)[
            slice(*share.span(plan.self_instruct_topic))]
        raw["self_instruct_topic"] = (texts, [{"template": self_instruct_template(t, "self_instruct_topic")}
                                              for t in texts])
    if share.count("self_instruct_passage"):
        passages = _passage_pool(target, out_dir, share, progress)["passages"]
        try:
            texts = self_instruct.passage_prompts(passages, share.count("self_instruct_passage"), share.seed)
        except InvalidRequestError as error:  # the target's articles were all too short
            logger.warning("no self_instruct passage prompts: %s", error)
            texts = []
        raw["self_instruct_passage"] = (texts, [{"template": self_instruct_template(t, "self_instruct_passage")}
                                                for t in texts])
    if share.count("math"):
        start = time.perf_counter()
        problems = _wrapped_math(share.count("math"), share.seed)
        raw["math"] = ([text for _, text in problems], [{"module": module} for module, _ in problems])
        _add_seconds(out_dir, "math", time.perf_counter() - start)
    if share.count("magpie"):
        pool = _magpie_pool(target, out_dir, share, spec_turns, progress)
        raw["magpie"] = (pool["prompts"], [{}] * len(pool["prompts"]))
        report["magpie"] = {"requested": share.count("magpie"), "sampled": pool["sampled"], "examined": pool["examined"],
                            "batches": pool["batches"], "synthesis_drops": pool["drops"]}
    start = time.perf_counter()
    spec_bench = _ReferenceIndex(spec_turns)
    seen: set[str] = set()
    records = []
    for source in SOURCES:
        if source not in raw:
            continue
        texts, extras = raw[source]
        kept, drops = _filter_source(source, texts, extras, spec_bench, seen, share)
        requested = None if source == "user" else share.count(source)
        entry = report.setdefault(source, {})
        entry.update(requested=len(texts) if requested is None else requested, candidates=len(texts),
                     kept=len(kept), drops=dict(sorted(drops.items())))
        if source == "magpie":  # the synthesis drops come first: the pool itself was already filtered
            entry["drops"] = dict(sorted((Counter(entry.pop("synthesis_drops")) + drops).items()))
        records += [{"id": f"{share.id_prefix()}{source}-{number:06d}", "source": source, "text": text, **extra}
                    for number, (text, extra) in enumerate(kept)]
    _write_json(out_dir / PROMPTS_REPORT_FILE, report)
    _write_jsonl(path, records)
    _add_seconds(out_dir, "prompts", time.perf_counter() - start)


# --- stages 2 and 3: answers, second turns --------------------------------------------------------

def _answer_text(tokenizer: Tokenizer, answer_ids: Sequence[int]) -> str:
    """An answer's text, without the end-of-turn token that ended it."""
    ids = list(answer_ids)
    if ids and ids[-1] in tokenizer.eos_token_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids).strip()


def _answer_shard(target: Model, records: Sequence[Mapping[str, Any]], plan: CorpusPlan) -> list[dict[str, Any]]:
    tokenizer = _chat_tokenizer(target)
    prompts = [chat_tokens(tokenizer, [{"role": "user", "content": r["text"]}], ending="assistant")[0]
               for r in records]
    rows = _generate_batches(target, prompts, batch_size=plan.answer_batch_size,
                             max_new_tokens=plan.answer_max_new_tokens, window=plan.seq_len, spans=ANSWER_SPANS)
    shard = []
    for record, prompt, (answer, finish_reason) in zip(records, prompts, rows):
        shard.append({"id": record["id"], "source": record["source"],
                      "messages": [{"role": "user", "content": record["text"]},
                                   {"role": "assistant", "content": _answer_text(tokenizer, answer)}],
                      "prompt_ids": prompt, "answer_ids": answer, "finish_reason": finish_reason,
                      "assistant_spans": [[len(prompt), len(prompt) + len(answer)]]})
    return shard


def _turn2_shard(target: Model, conversations: Sequence[Mapping[str, Any]], share: RoundShare, spec_turns: list[str],
                 number: int) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Second turns of one shard's conversations: (records, follow-up drops by reason)."""
    plan = share.plan
    tokenizer = _chat_tokenizer(target)
    histories = [[dict(c["messages"][0]), {**c["messages"][1], "token_ids": c["answer_ids"]}] for c in conversations]
    follow_ups = synthesize_follow_ups(
        target, histories, seed=(share.seed, number), batch_size=plan.magpie_batch_size,
        max_new_tokens=plan.magpie_max_new_tokens, temperature=plan.magpie_temperature, top_p=plan.magpie_top_p,
        attempts=plan.follow_up_attempts, spec_bench=spec_turns, spec_bench_threshold=plan.spec_bench_threshold)
    chosen = [(c, h, text) for c, h, text in zip(conversations, histories, follow_ups.texts) if text is not None]
    prompts = [chat_tokens(tokenizer, h + [{"role": "user", "content": text}], ending="assistant")
               for _, h, text in chosen]
    rows = _generate_batches(target, [p for p, _ in prompts], batch_size=plan.answer_batch_size,
                             max_new_tokens=plan.answer_max_new_tokens, window=plan.seq_len, spans=ANSWER_SPANS)
    shard, unstable = [], 0
    for (conversation, history, text), (prompt, spans), (answer, finish_reason) in zip(chosen, prompts, rows):
        # The first turn's tokens must open the two-turn rendering, as the target saw them when
        # it answered; a template that rewrites earlier turns breaks that (counted, warned).
        first = conversation["prompt_ids"] + conversation["answer_ids"]
        stable = prompt[: len(first)] == first
        unstable += not stable
        messages = [{"role": m["role"], "content": m["content"]} for m in history]
        shard.append({"id": conversation["id"], "source": conversation["source"],
                      "messages": messages + [{"role": "user", "content": text},
                                              {"role": "assistant", "content": _answer_text(tokenizer, answer)}],
                      "prompt_ids": prompt, "answer_ids": answer, "finish_reason": finish_reason,
                      "assistant_spans": [list(spans[0]), [len(prompt), len(prompt) + len(answer)]],
                      "prefix_stable": stable})
    if unstable:
        logger.warning("turn 2, shard %d: for %d conversations the template renders the first turn differently "
                       "once a second follows; their tokens are the two-turn rendering", number, unstable)
    return shard, dict(follow_ups.drops)


def _eligible_for_follow_up(record: Mapping[str, Any], plan: CorpusPlan) -> bool:
    """A first answer that ended its turn, is not empty, and leaves room in the window."""
    length = len(record["prompt_ids"]) + len(record["answer_ids"])
    return (record["finish_reason"] == "stop" and bool(record["messages"][1]["content"])
            and length + 32 < plan.seq_len)


def _shards(out_dir: pathlib.Path, stage: str, work: Sequence[Any], plan: CorpusPlan,
            make: Callable[[int, Sequence[Any]], list[dict[str, Any]]], progress: bool) -> bool:
    """Write every missing shard of `stage` (`make(number, items)` -> its records); True if any was."""
    from tqdm.auto import tqdm

    missing = [n for n in range(math.ceil(len(work) / plan.shard_size))
               if not _shard_path(out_dir, stage, n).is_file()]
    elsewhere = []  # shards another live worker is making
    for number in tqdm(missing, desc=stage, unit="shard", disable=not progress):
        path = _shard_path(out_dir, stage, number)
        try:
            with _claim(path):
                if path.is_file():
                    continue
                start = time.perf_counter()
                records = make(number, work[number * plan.shard_size: (number + 1) * plan.shard_size])
                _write_jsonl(path, records)
                _add_seconds(out_dir, stage, time.perf_counter() - start)
        except _Busy:
            elsewhere.append(number)
    if elsewhere:
        raise _Busy(_shard_path(out_dir, stage, elsewhere[0]))  # the stage is read whole: not yet
    return bool(missing)


def _read_shards(out_dir: pathlib.Path, stage: str, count: int, plan: CorpusPlan) -> list[dict[str, Any]]:
    return [record for number in range(math.ceil(count / plan.shard_size))
            for record in _read_jsonl(_shard_path(out_dir, stage, number))]


def _follow_up_selection(out_dir: pathlib.Path, answers: Sequence[Mapping[str, Any]], share: RoundShare) -> list[str]:
    """Ids of the conversations that get a second turn: a seeded choice, fixed once made."""
    plan = share.plan

    def choose() -> None:
        eligible = [r["id"] for r in answers if _eligible_for_follow_up(r, plan)]
        chosen = round(plan.follow_up_fraction * len(eligible))
        order = np.random.default_rng([share.seed, 0x7A2]).permutation(len(eligible))[:chosen]
        _write_json(out_dir / SELECTION_FILE, {"ids": [eligible[i] for i in sorted(order)], "eligible": len(eligible)})

    return _made_once(out_dir / SELECTION_FILE, _read_json, choose)["ids"]


# --- stage 4 and the build --------------------------------------------------------------------

def build_corpus(target: Model, out_dir: str | os.PathLike[str], plan: CorpusPlan, *,
                 progress: bool = False, wait: bool = True) -> dict[str, Any]:
    """Build (or resume) the corpus in `out_dir` (see the module docstring for the files) and
    return its manifest. Finished stages and shards are skipped; a directory built with another
    plan, target, prompts file or Spec-Bench file is refused, naming what differs. A plan of
    several `rounds` builds round_000/, round_001/, ... in turn (each laid out as a one-round
    corpus), and after each rewrites dataset.npz and manifest.json at the top over every round
    done, so a corpus stopped between rounds is already usable.

    Several processes may build one corpus at once (`_claim`): each makes the files no other
    live worker has claimed, and where a round must wait for another's shards it goes on to the
    next round's (its prompts need only the earlier rounds' prompts). With `wait`, a worker
    with nothing left to make waits for the others and returns the whole manifest; without,
    it returns `corpus_status` with "busy": True at that point."""
    if not isinstance(plan, CorpusPlan):
        raise InvalidRequestError(f"plan must be a CorpusPlan; got {type(plan).__name__}")
    out_dir = pathlib.Path(out_dir)
    spec_turns = spec_bench_turns(spec_bench_questions(plan.spec_bench_path))
    _check_plan(out_dir, _plan_record(target, plan))
    while True:
        try:
            if plan.rounds == 1:
                return _build_round(target, out_dir, RoundShare(plan), spec_turns, progress)
            if _build_rounds(target, out_dir, plan, spec_turns, progress):
                return _read_json(out_dir / MANIFEST_FILE)
        except _Busy:
            pass
        if not wait:
            return {"busy": True, **corpus_status(out_dir)}
        if progress:
            logger.info("corpus: waiting for other workers")
        time.sleep(CLAIM_POLL_SECONDS)


def _build_rounds(target: Model, out_dir: pathlib.Path, plan: CorpusPlan, spec_turns: list[str],
                  progress: bool) -> bool:
    """One pass over the rounds, making what no other worker holds; True once all are done."""
    earlier: list[tuple[str, str]] = []
    done, busy = 0, False
    for index in range(plan.rounds):
        round_dir = out_dir / ROUND_DIR.format(index)
        if progress and not (round_dir / MANIFEST_FILE).is_file():
            logger.info("corpus round %d of %d", index + 1, plan.rounds)
        try:
            _build_round(target, round_dir, RoundShare(plan, index, tuple(earlier)), spec_turns, progress)
            if not busy:  # every round so far is done: the top covers them before the next starts
                done = index + 1
                if (not (out_dir / DATASET_FILE).is_file() or not (out_dir / MANIFEST_FILE).is_file()
                        or _read_json(out_dir / MANIFEST_FILE).get("rounds_done") != done):
                    _combine_rounds(out_dir, plan, done)
        except _Busy:
            busy = True
            if not (round_dir / PROMPTS_FILE).is_file():
                break  # later rounds are drawn apart from this one's prompts: not yet
        earlier += [(r["source"], r["text"]) for r in _read_jsonl(round_dir / PROMPTS_FILE)]
    return done == plan.rounds


def _build_round(target: Model, out_dir: pathlib.Path, share: RoundShare, spec_turns: list[str],
                 progress: bool) -> dict[str, Any]:
    """Every stage of one round (the whole corpus when the plan has one) in `out_dir`."""
    plan = share.plan
    tokenizer = _chat_tokenizer(target)
    prompts = _build_prompts(target, out_dir, share, spec_turns, progress)
    wrote = _shards(out_dir, ANSWERS_DIR, prompts, plan, lambda n, items: _answer_shard(target, items, plan), progress)
    answers = _read_shards(out_dir, ANSWERS_DIR, len(prompts), plan)
    by_id = {r["id"]: r for r in answers}
    selected = [by_id[i] for i in _follow_up_selection(out_dir, answers, share)]

    def turn2(number: int, items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        shard, drops = _turn2_shard(target, items, share, spec_turns, number)
        _write_json(out_dir / TURN2_DIR / f"drops_{number:05d}.json", drops)  # before its shard: never lost
        return shard

    wrote = _shards(out_dir, TURN2_DIR, selected, plan, turn2, progress) or wrote
    second = _read_shards(out_dir, TURN2_DIR, len(selected), plan)

    if wrote or not (out_dir / DATASET_FILE).is_file() or not (out_dir / MANIFEST_FILE).is_file():
        start = time.perf_counter()
        # The split decides each prompt alone (its template, or its own hash), so rounds packed
        # apart agree with the split of their union.
        _, held = held_out_split(prompts, plan.held_out_fraction, plan.seed)
        two_turn = {r["id"]: r for r in second if r["messages"][-1]["content"].strip()}
        conversations = [two_turn.get(r["id"], r) for r in answers]  # an empty second answer: keep one turn
        packed, packing = pack_conversations(conversations, plan.seq_len, held_out_ids=[r["id"] for r in held])
        packed.save(out_dir / DATASET_FILE)
        _add_seconds(out_dir, "pack", time.perf_counter() - start)
        manifest = _manifest(out_dir, plan, tokenizer, prompts, answers, second, packed, packing)
        _write_json(out_dir / MANIFEST_FILE, manifest)
    return _read_json(out_dir / MANIFEST_FILE)


def _summed(values: Sequence[Any]) -> Any:
    """Manifests' counts added leaf by leaf: numbers summed, dicts merged key by key (a key
    missing from some counts as absent there), anything else taken from the first."""
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, dict) for v in present):
        keys = list(dict.fromkeys(k for v in present for k in v))
        return {k: _summed([v.get(k) for v in present]) for k in keys}
    if present and all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
        total = sum(present)
        return round(total, 3) if isinstance(total, float) else total
    return present[0] if present else None


def _combine_rounds(out_dir: pathlib.Path, plan: CorpusPlan, rounds_done: int) -> None:
    """dataset.npz and manifest.json at the top of a corpus of rounds: the first `rounds_done`
    rounds' rows, concatenated in round order, and their manifests' counts summed."""
    round_dirs = [out_dir / ROUND_DIR.format(index) for index in range(rounds_done)]
    parts = [PackedCorpus.load(d / DATASET_FILE) for d in round_dirs]
    PackedCorpus.concatenate(parts).save(out_dir / DATASET_FILE)
    manifests = [_read_json(d / MANIFEST_FILE) for d in round_dirs]
    combined = {name: _summed([m[name] for m in manifests])
                for name in ("sources", "prompts", "finish_reasons", "follow_ups", "rows", "tokens", "seconds")}
    combined["tokens"]["seq_len"] = plan.seq_len
    _write_json(out_dir / MANIFEST_FILE, {"format": FORMAT_VERSION, "plan": dataclasses.asdict(plan),
                                          "rounds_done": rounds_done, **combined})


def _manifest(out_dir: pathlib.Path, plan: CorpusPlan, tokenizer: Tokenizer, prompts: Sequence[Mapping[str, Any]],
              answers: Sequence[Mapping[str, Any]], second: Sequence[Mapping[str, Any]], packed: PackedCorpus,
              packing: Mapping[str, Any]) -> dict[str, Any]:
    """What the model card quotes: counts per source, drops by reason, tokens, seconds."""
    sources = _read_json(out_dir / PROMPTS_REPORT_FILE)
    source_of = {r["id"]: r["source"] for r in prompts}
    rows = Counter(source_of[i] for i in packed.ids.tolist())
    two_turn_rows = Counter(source_of[i] for i, turns in zip(packed.ids.tolist(), packed.turns) if turns == 2)
    for source, entry in sources.items():
        entry["rows"], entry["two_turn_rows"] = rows.get(source, 0), two_turn_rows.get(source, 0)
    follow_up_drops: Counter[str] = Counter()
    for path in sorted((out_dir / TURN2_DIR).glob("drops_*.json")):
        follow_up_drops.update(_read_json(path))
    data, selection = packed.data, _read_json(out_dir / SELECTION_FILE)
    return {
        "format": FORMAT_VERSION,
        "plan": dataclasses.asdict(plan),
        "sources": sources,
        "prompts": len(prompts),
        "finish_reasons": {"turn1": dict(sorted(Counter(r["finish_reason"] for r in answers).items())),
                           "turn2": dict(sorted(Counter(r["finish_reason"] for r in second).items()))},
        "follow_ups": {"eligible": selection["eligible"], "selected": len(selection["ids"]), "written": len(second),
                       "drops": dict(sorted(follow_up_drops.items())),
                       "prefix_unstable": sum(not r.get("prefix_stable", True) for r in second)},
        "rows": {"total": len(data), "two_turn": int((packed.turns == 2).sum()), "held_out": int(packed.held_out.sum()),
                 **packing},
        "tokens": {"prompt_tokens_turn1": sum(len(r["prompt_ids"]) for r in answers),
                   "answer_tokens_generated": sum(len(r["answer_ids"]) for r in [*answers, *second]),
                   "dataset_tokens": int(data.lengths.sum()),
                   "assistant_tokens_in_window": int(data.assistant.sum()), "seq_len": plan.seq_len},
        "seconds": _read_json(out_dir / TIMINGS_FILE) if (out_dir / TIMINGS_FILE).is_file() else {},
    }


def corpus_status(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What a corpus directory holds: each stage done or not, shards done of total (None while
    the total is not known yet), and `next`, the stage a `build_corpus` call would run. A plan of
    several rounds adds `rounds` (done of total) and reports the stages of the first round not
    done, `next` naming it ("round 3: answers")."""
    out_dir = pathlib.Path(out_dir)
    if not (out_dir / PLAN_FILE).is_file():
        return {**_round_status(out_dir, 1), "planned": False, "next": "plan"}
    plan = _read_json(out_dir / PLAN_FILE)["plan"]
    rounds = plan.get("rounds", 1)
    if rounds == 1:
        return _round_status(out_dir, plan["shard_size"])
    done = 0
    while done < rounds and (out_dir / ROUND_DIR.format(done) / MANIFEST_FILE).is_file():
        done += 1
    status = {"planned": True, "rounds": {"done": done, "total": rounds}, "dataset": (out_dir / DATASET_FILE).is_file(),
              "complete": done == rounds, "next": None}
    if done < rounds:
        current = _round_status(out_dir / ROUND_DIR.format(done), plan["shard_size"])
        status.update({key: value for key, value in current.items() if key not in ("planned", "complete", "next")})
        status["next"] = f"round {done}: {current['next']}"
    return status


def _round_status(out_dir: pathlib.Path, shard_size: int) -> dict[str, Any]:
    status: dict[str, Any] = {"planned": True, "magpie_pool": (out_dir / MAGPIE_FILE).is_file(),
                              "passage_pool": (out_dir / PASSAGES_FILE).is_file(), "prompts": None,
                              "answers": {"done": 0, "total": None}, "turn2": {"done": 0, "total": None},
                              "dataset": (out_dir / DATASET_FILE).is_file(),
                              "complete": (out_dir / MANIFEST_FILE).is_file()}
    for stage in (ANSWERS_DIR, TURN2_DIR):
        status[stage]["done"] = len(list((out_dir / stage).glob("shard_*.jsonl")))
    if (out_dir / PROMPTS_FILE).is_file():
        status["prompts"] = sum(1 for line in (out_dir / PROMPTS_FILE).open(encoding="utf-8") if line.strip())
        status[ANSWERS_DIR]["total"] = math.ceil(status["prompts"] / shard_size)
    if (out_dir / SELECTION_FILE).is_file():
        status[TURN2_DIR]["total"] = math.ceil(len(_read_json(out_dir / SELECTION_FILE)["ids"]) / shard_size)
    if status["prompts"] is None:
        status["next"] = "prompts"
    elif status[ANSWERS_DIR]["done"] < status[ANSWERS_DIR]["total"]:
        status["next"] = "answers"
    elif status[TURN2_DIR]["total"] is None or status[TURN2_DIR]["done"] < status[TURN2_DIR]["total"]:
        status["next"] = "turn2"
    elif not status["complete"]:
        status["next"] = "pack"
    else:
        status["next"] = None
    return status
