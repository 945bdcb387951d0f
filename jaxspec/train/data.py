"""Training data: prompts in, packed right-padded token rows out, and the order they are read in.

    prompts   read_prompts_jsonl / tokenize_prompts      JSONL -> token ids
    answers   self_distill / self_instruct_examples      the target answers them greedily (batched
                                                         `jaxspec.generate`), so the head learns the
                                                         distribution it will be verified against
    batches   pack -> Dataset                            right-padded int32[N, T] + lengths
    masks     response_mask / loss_mask                  which positions' predictions are answer tokens
                                                         (every assistant turn of a conversation)
    order     split / batch_indices / BatchOrder         held-out rows; a step's rows, a function of
                                                         (seed, step) alone, so a resumed run reads
                                                         the same batches; BatchOrder batches rows
                                                         of like length at their own width
    vocab     draft_vocab -> DraftVocab                  the Vd most frequent response tokens -> d2t, t2d

The data lives on the host (numpy); `Dataset.batch` moves one batch at a time to the device.
Bad input (a malformed prompt file, an empty dataset, an unreadable data file) raises a
jaxspec.errors error naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.api import Model, generate, prompt_ids
from jaxspec.errors import CheckpointError, InvalidRequestError, is_integer


# ----------------------------------------------------------------------------------------------
# Prompts and self-distillation
# ----------------------------------------------------------------------------------------------

def read_prompts_jsonl(path: str | os.PathLike[str]) -> list[str | list[int]]:
    """One JSON object per line with a "prompt" or "text" field: a string, or a list of token ids
    (for models without a tokenizer). Blank lines are skipped; anything else names its line."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise InvalidRequestError(f"prompt file not found: {path}")
    prompts: list[str | list[int]] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InvalidRequestError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise InvalidRequestError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            prompt = record.get("prompt", record.get("text"))
            if prompt is None:
                raise InvalidRequestError(f"{path}:{number}: the object has no \"prompt\" or \"text\" field")
            is_ids = isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            if not (isinstance(prompt, str) and prompt.strip()) and not is_ids:
                raise InvalidRequestError(
                    f"{path}:{number}: \"prompt\"/\"text\" must be a non-empty string or list of token ids; "
                    f"got {prompt!r:.60}")
            prompts.append(prompt)
    if not prompts:
        raise InvalidRequestError(f"{path} holds no prompts")
    return prompts


def tokenize_prompts(model: Model, prompts: Sequence[str | Sequence[int]], *, chat: bool = True) -> list[list[int]]:
    """Token ids per prompt (text through the chat template when `chat`), checked as `generate`
    checks its prompts."""
    return prompt_ids(list(prompts), model, chat)


# Spec-Bench's runs of a head measure the first 128 tokens of each answer (bench/heads.py): validation
# scores those apart.
EARLY_ANSWER_TOKENS = 128

# The n-gram order of the lookup that tells repeated answer text from new text (`lookup_predicted`):
# the ngram proposer's longest match by default (ngram_max).
LOOKUP_ORDER = 3


@dataclasses.dataclass(frozen=True)
class Example:
    tokens: tuple[int, ...]  # prompt then the target's answer
    prompt_length: int


def self_distill(target: Model, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int, *,
                 ignore_eos: bool = False, progress: bool = False) -> list[Example]:
    """The target answers each prompt greedily; returns prompt + answer per prompt, in order.

    Prompts are batched by length (similar lengths share a padded bucket, hence a compile)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidRequestError(f"batch_size must be an integer >= 1; got {batch_size!r}")
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise InvalidRequestError("self_distill needs at least one prompt")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: dict[int, list[int]] = {}
    chunks = [order[start: start + batch_size] for start in range(0, len(order), batch_size)]
    from tqdm.auto import tqdm

    for chunk in tqdm(chunks, desc="self-distill", unit="batch", disable=not progress):
        result = generate(target, None, [prompts[i] for i in chunk], max_new_tokens=max_new_tokens,
                          ignore_eos=ignore_eos)
        answers.update(zip(chunk, result.tokens))
    return [Example(tokens=tuple(prompts[i] + answers[i]), prompt_length=len(prompts[i])) for i in range(len(prompts))]


def self_instruct_examples(target: Model, num_prompts: int = 640, num_passage_prompts: int = 192, *,
                           max_new_tokens: int = 128, batch_size: int = 32, seed: int = 0,
                           progress: bool = False) -> list[Example]:
    """Training examples from jaxspec's own topic list (`jaxspec.self_instruct`), all answered by
    the target through its chat template: `num_prompts` topic prompts (stage 1), then
    `num_passage_prompts` prompts wrapping the target's own stage-1 articles (stage 2:
    summarisation, extraction, reading comprehension, translation)."""
    from jaxspec import self_instruct

    if target.tokenizer is None:
        raise InvalidRequestError("self-instruct prompts are text: the target needs a tokenizer (or pass --prompts)")
    texts = self_instruct.topic_prompts(num_prompts, seed)
    stage1 = self_distill(target, tokenize_prompts(target, texts), max_new_tokens, batch_size, progress=progress)
    if not num_passage_prompts:
        return stage1
    articles = [target.tokenizer.decode(example.tokens[example.prompt_length:])
                for text, example in zip(texts, stage1) if self_instruct.is_article_prompt(text)]
    stage2_texts = self_instruct.passage_prompts(articles, num_passage_prompts, seed)
    stage2 = self_distill(target, tokenize_prompts(target, stage2_texts), max_new_tokens, batch_size,
                          progress=progress)
    return stage1 + stage2


# ----------------------------------------------------------------------------------------------
# Packed data
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """Right-padded training sequences (host numpy; batches go to the device one at a time)."""

    tokens: np.ndarray  # int32[N, T]
    lengths: np.ndarray  # int32[N]: valid tokens per row
    prompt_lengths: np.ndarray  # int32[N]: the first prompt_lengths[n] tokens are the prompt
    # bool[N, T]: which tokens the assistant wrote, for conversations of several turns (the user's
    # later turns sit between answers); None: tokens prompt_lengths[n] .. lengths[n] - 1.
    assistant: np.ndarray | None = None
    # bool[N]: rows held out of training (validation), e.g. the corpus's split disjoint by template
    # and source (jaxspec.train.corpus.held_out_split); None: `split` draws them at random.
    held_out: np.ndarray | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def assistant_tokens(self, indices: Sequence[int] | None = None) -> np.ndarray:
        """bool[B, T]: the tokens of rows `indices` (default all) that the assistant wrote."""
        indices = np.arange(len(self)) if indices is None else np.asarray(indices, np.int64)
        if self.assistant is not None:
            return self.assistant[indices]
        positions = np.arange(self.seq_len)[None, :]
        return (positions >= self.prompt_lengths[indices, None]) & (positions < self.lengths[indices, None])

    def prompts(self, indices: Sequence[int]) -> list[list[int]]:
        """The prompts of rows `indices`, as token lists (what a generation is started from)."""
        return [self.tokens[i, : self.prompt_lengths[i]].tolist() for i in indices]

    def batch(self, indices: Sequence[int], width: int | None = None) -> dict[str, jax.Array]:
        """Rows `indices` and their loss mask, `width` positions wide (default the data's
        seq_len; narrower cuts only padding when every row fits, as `BatchOrder`'s batches do);
        an index of -1 is an empty row (length 0: no loss, no accuracy)."""
        indices = np.asarray(indices)
        width = self.seq_len if width is None else width
        empty = indices < 0
        safe = np.where(empty, 0, indices)
        lengths = np.where(empty, 0, self.lengths[safe])
        if int(lengths.max(initial=0)) > width:
            raise InvalidRequestError(f"a row of {int(lengths.max())} tokens does not fit a batch {width} wide")
        return {
            "tokens": jnp.asarray(np.where(empty[:, None], 0, self.tokens[safe, :width])),
            "lengths": jnp.asarray(lengths),
            "prompt_lengths": jnp.asarray(np.where(empty, 0, self.prompt_lengths[safe])),
            "loss_mask": jnp.asarray(loss_mask(self.assistant_tokens(safe)[:, :width], lengths)),
        }

    def next_is_lookup_predicted(self, indices: Sequence[int], width: int, n: int = LOOKUP_ORDER) -> np.ndarray:
        """bool[B, width], aligned with `batch`'s loss mask: position t's next token is one a
        prompt lookup of order `n` over the row proposes (`lookup_predicted`); -1: an empty row."""
        out = np.zeros((len(indices), width), bool)
        for i, row in enumerate(np.asarray(indices)):
            if row >= 0:
                length = min(int(self.lengths[row]), width + 1)
                out[i, : length - 1] = _lookup_predicted_row(self.tokens[row, :length].tolist(), n)[1:]
        return out

    def next_answer_positions(self, indices: Sequence[int], width: int) -> np.ndarray:
        """int[B, width], aligned with `batch`'s loss mask: the index within its answer of position
        t's next token (`answer_positions`); -1 where that token is no answer's, or for row -1."""
        indices = np.asarray(indices)
        out = np.full((len(indices), width), -1, np.int64)
        valid = np.flatnonzero(indices >= 0)
        positions = answer_positions(self.subset(indices[valid]))[:, 1: width + 1]
        out[valid, : positions.shape[1]] = positions
        return out

    def cut_after_prompt(self, answer_tokens: int) -> "Dataset":
        """Each row cut `answer_tokens` positions after its prompt: its first answer's opening
        (after an answer that ended sooner, what follows it: a second turn's start). Where a
        small model's long answers mostly loop (a 3-gram lookup proposes most of their later
        tokens: bench/RESULTS.md, "Corpus repetition"), and where Spec-Bench measures a head (its
        first 128 tokens), at a fraction of the feature and training cost."""
        if not is_integer(answer_tokens) or answer_tokens < 1:
            raise InvalidRequestError(f"answer_tokens must be an integer >= 1; got {answer_tokens!r}")
        lengths = np.minimum(self.lengths, self.prompt_lengths + answer_tokens).astype(np.int32)
        width = int(lengths.max(initial=1))
        past = np.arange(width)[None, :] >= lengths[:, None]  # [N, W]: beyond a row's new length
        assistant = None if self.assistant is None else np.where(past, False, self.assistant[:, :width])
        return Dataset(np.where(past, 0, self.tokens[:, :width]).astype(np.int32), lengths,
                       self.prompt_lengths.copy(), assistant,
                       None if self.held_out is None else self.held_out.copy())

    def subset(self, indices: Sequence[int]) -> "Dataset":
        indices = np.asarray(indices, np.int64)
        return Dataset(self.tokens[indices], self.lengths[indices], self.prompt_lengths[indices],
                       None if self.assistant is None else self.assistant[indices],
                       None if self.held_out is None else self.held_out[indices])

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        arrays = (self.tokens, self.lengths, self.prompt_lengths)
        arrays += tuple(array for array in (self.assistant, self.held_out) if array is not None)
        for array in arrays:
            digest.update(np.ascontiguousarray(array, np.int32).tobytes())
            digest.update(str(array.shape).encode())
        return digest.hexdigest()[:16]

    def arrays(self) -> dict[str, np.ndarray]:
        """What a data file holds, by name: the optional arrays where the data has them."""
        optional = {name: array for name, array in (("assistant", self.assistant), ("held_out", self.held_out))
                    if array is not None}
        return {"tokens": self.tokens, "lengths": self.lengths, "prompt_lengths": self.prompt_lengths, **optional}

    def save(self, path: pathlib.Path) -> None:
        np.savez(path, **self.arrays())

    @classmethod
    def load(cls, path: pathlib.Path) -> "Dataset":
        try:
            with np.load(path) as data:
                optional = {name: data[name].astype(bool) if name in data.files else None
                            for name in ("assistant", "held_out")}
                loaded = cls(data["tokens"].astype(np.int32), data["lengths"].astype(np.int32),
                             data["prompt_lengths"].astype(np.int32), **optional)
        except (OSError, KeyError, ValueError) as error:
            raise CheckpointError(f"{path} is not a readable training data file: {error}") from None
        if loaded.assistant is not None and loaded.assistant.shape != loaded.tokens.shape:
            raise CheckpointError(f"{path}: its assistant mask {loaded.assistant.shape} does not match its tokens "
                                  f"{loaded.tokens.shape}")
        if loaded.held_out is not None and loaded.held_out.shape != loaded.lengths.shape:
            raise CheckpointError(f"{path}: its held_out flags {loaded.held_out.shape} do not match its "
                                  f"{len(loaded)} rows")
        return loaded


def concatenate_datasets(parts: Sequence[Dataset]) -> Dataset:
    """The rows of every part, in order: several corpora, or some rounds of one, as one Dataset.

    Parts must share a window (seq_len). Where only some carry an assistant mask, the others'
    is the mask their prompt lengths imply (`Dataset.assistant_tokens`). Held-out flags must be
    on every part or on none: a split chosen for some rows only cannot be completed at random."""
    if not parts:
        raise InvalidRequestError("nothing to concatenate: no datasets given")
    if len({part.seq_len for part in parts}) != 1:
        raise InvalidRequestError(f"datasets of different windows cannot be concatenated: seq_len "
                                  f"{[part.seq_len for part in parts]}")
    flagged = [part.held_out is not None for part in parts]
    if any(flagged) and not all(flagged):
        raise InvalidRequestError("held-out flags are on some of the datasets but not all: concatenate datasets "
                                  "that all carry their split, or none")

    def joined(arrays):
        return np.concatenate(list(arrays))

    masked = any(part.assistant is not None for part in parts)
    return Dataset(joined(part.tokens for part in parts), joined(part.lengths for part in parts),
                   joined(part.prompt_lengths for part in parts),
                   assistant=joined(part.assistant_tokens() for part in parts) if masked else None,
                   held_out=joined(part.held_out for part in parts) if all(flagged) else None)


def load_datasets(paths: Sequence[str | os.PathLike[str]]) -> Dataset:
    """The data files at `paths` (`Dataset.save`'s, or a corpus's dataset.npz), concatenated in order."""
    return concatenate_datasets([Dataset.load(pathlib.Path(path)) for path in paths])


def pack(examples: Sequence[Example], seq_len: int) -> Dataset:
    """Truncate to `seq_len` and right-pad. Rows with no response token inside the window (the
    prompt fills it, or the answer is empty) teach nothing and are dropped."""
    if not isinstance(seq_len, int) or seq_len < 4:
        raise InvalidRequestError(f"seq_len must be an integer >= 4; got {seq_len!r}")
    kept = [e for e in examples if min(len(e.tokens), seq_len) > e.prompt_length]
    if not kept:
        raise InvalidRequestError(
            f"no example has a response token within seq_len={seq_len}: prompts too long or answers empty")
    tokens = np.zeros((len(kept), seq_len), np.int32)
    lengths = np.zeros(len(kept), np.int32)
    for row, example in enumerate(kept):
        window = example.tokens[:seq_len]
        tokens[row, : len(window)] = window
        lengths[row] = len(window)
    prompt_lengths = np.asarray([e.prompt_length for e in kept], np.int32)
    return Dataset(tokens, lengths, prompt_lengths)


def response_mask(lengths: jax.Array, prompt_lengths: jax.Array, seq_len: int) -> jax.Array:
    """bool[B, T]: position t's next-token prediction is a response token of the data
    (prompt_length - 1 <= t < length - 1). The loss mask, before the head's alignment shift, of
    single-turn rows (`loss_mask` of their assistant tokens)."""
    positions = jnp.arange(seq_len)[None, :]
    return (positions >= prompt_lengths[:, None] - 1) & (positions < lengths[:, None] - 1)


def loss_mask(assistant: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """bool[B, T]: position t's next token is one the assistant wrote (`assistant[:, t + 1]`,
    t + 1 < length), in any turn. The loss mask, before the head's alignment shift."""
    next_is_assistant = np.zeros_like(assistant, dtype=bool)
    next_is_assistant[:, :-1] = assistant[:, 1:]
    return next_is_assistant & (np.arange(assistant.shape[1])[None, :] < np.asarray(lengths)[:, None] - 1)


def lookup_predicted(data: Dataset, n: int = LOOKUP_ORDER) -> np.ndarray:
    """bool[N, T]: token t is what a prompt lookup of order `n` over the row's own earlier tokens
    proposes (the token that followed the last earlier occurrence of tokens t-n..t-1), the
    tokens a draft head adds nothing for: a small model's answers that loop until the length
    bound are mostly these (bench/corpus_repetition.py)."""
    if not is_integer(n) or n < 1:
        raise InvalidRequestError(f"n must be an integer >= 1; got {n!r}")
    predicted = np.zeros(data.tokens.shape, bool)
    for row in range(len(data)):
        length = int(data.lengths[row])
        predicted[row, :length] = _lookup_predicted_row(data.tokens[row, :length].tolist(), n)
    return predicted


def _lookup_predicted_row(tokens: list[int], n: int) -> np.ndarray:
    """bool[len(tokens)]: `lookup_predicted` of one row's valid tokens."""
    predicted = np.zeros(len(tokens), bool)
    follower: dict[tuple[int, ...], int] = {}  # n-gram -> the token after its last occurrence so far
    for t in range(n, len(tokens)):
        context = tuple(tokens[t - n: t])
        predicted[t] = follower.get(context) == tokens[t]
        follower[context] = tokens[t]
    return predicted


def answer_positions(data: Dataset) -> np.ndarray:
    """int[N, T]: each assistant token's index within its own turn (0 = the turn's first token);
    -1 where the assistant did not write the token."""
    assistant = data.assistant_tokens()
    positions = np.full(assistant.shape, -1, np.int64)
    for row in range(len(data)):
        turn_start = 0
        for t in np.flatnonzero(assistant[row]):
            if t == 0 or not assistant[row, t - 1]:
                turn_start = t
            positions[row, t] = t - turn_start
    return positions


def split_rows(data: Dataset, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, validation indices): the data's own held-out rows when it has them (a
    corpus split by template and source), else `split`'s random draw."""
    if data.held_out is None:
        return split(len(data), val_fraction, seed)
    if data.held_out.all():
        raise InvalidRequestError("every row of the data is held out: nothing to train on")
    return np.flatnonzero(~data.held_out), np.flatnonzero(data.held_out)


def held_out_prompts(data: Dataset, val_fraction: float, seed: int, count: int) -> list[list[int]]:
    """The prompts (token lists) of up to `count` validation rows (`split_rows`), a seeded draw.

    Not the first rows: a corpus lists its held-out rows by source and template, so its first few
    are one template's, and a tau measured on them tells of that template, not of the rest."""
    _, val_rows = split_rows(data, val_fraction, seed)
    drawn = np.random.default_rng(seed).permutation(val_rows)[:count]
    return data.prompts(drawn)


def split(num_examples: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, validation indices): a seeded shuffle, the validation rows held out."""
    order = np.random.default_rng([seed, 0xDA7A]).permutation(num_examples)
    num_val = 0 if num_examples < 2 or val_fraction <= 0 else max(1, round(num_examples * val_fraction))
    num_val = min(num_val, num_examples - 1)
    return np.sort(order[num_val:]), np.sort(order[:num_val])


@functools.lru_cache(maxsize=8)
def _epoch_order(seed: int, epoch: int, num_train: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_train)


def batch_indices(seed: int, step: int, batch_size: int, num_train: int) -> np.ndarray:
    """Rows of training step `step`: epochs are seeded permutations laid end to end, so the order
    is a function of (seed, step) alone and a resumed run takes the same batches."""
    flat = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs, offsets = np.divmod(flat, num_train)
    return np.asarray([_epoch_order(seed, int(e), num_train)[o] for e, o in zip(epochs, offsets)])


def bucket_widths(lengths: np.ndarray, bucket_width: int, seq_len: int) -> np.ndarray:
    """int64[N]: the width of the batches each row goes in: its length rounded up to a multiple
    of `bucket_width`, at most `seq_len` (`bucket_width` 0: every row `seq_len` wide)."""
    lengths = np.asarray(lengths, np.int64)
    if not bucket_width:
        return np.full(lengths.shape, seq_len, np.int64)
    return np.minimum(-(-np.maximum(lengths, 1) // bucket_width) * bucket_width, seq_len)


def length_batches(rows: Sequence[int], widths: Sequence[int], batch_size: int) -> list[tuple[np.ndarray, int]]:
    """`rows` in batches of one width each, narrowest first, every batch `batch_size` rows (the
    last of a width padded with -1, empty rows): (row indices, width) per batch."""
    rows, widths = np.asarray(rows, np.int64), np.asarray(widths, np.int64)
    batches = []
    for width in np.unique(widths):
        members = rows[widths == width]
        for start in range(0, len(members), batch_size):
            chunk = members[start: start + batch_size]
            batches.append((np.concatenate([chunk, np.full(batch_size - len(chunk), -1, np.int64)]), int(width)))
    return batches


@dataclasses.dataclass(frozen=True, eq=False)
class BatchOrder:
    """Which rows training step s reads, and how wide its batch is: rows of like length batched
    together at their bucket's width (`bucket_widths`), so a batch of short conversations does not
    pay for the longest window. Epoch e shuffles the rows of each width and the batches of all
    widths with the seed (seed, e); epochs follow each other; so a step's batch is a function of
    (seed, step) alone and a resumed run reads the same batches. Every epoch has the same number
    of batches, each of `batch_size` rows (a width's last batch padded with empty rows, -1)."""

    rows: np.ndarray  # int64[N]: the training rows
    widths: np.ndarray  # int64[N]: each one's batch width
    batch_size: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        _, counts = np.unique(self.widths, return_counts=True)
        return int(np.sum(-(-counts // self.batch_size)))

    def epoch(self, epoch: int) -> list[tuple[np.ndarray, int]]:
        return _bucketed_epoch(self, epoch)

    def step(self, step: int) -> tuple[np.ndarray, int]:
        """(row indices, batch width) of training step `step`."""
        epoch, offset = divmod(step, self.steps_per_epoch)
        return self.epoch(epoch)[offset]


@functools.lru_cache(maxsize=4)
def _bucketed_epoch(order: BatchOrder, epoch: int) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng([order.seed, epoch, 0xB0C])
    shuffled = rng.permutation(len(order.rows))
    batches = length_batches(order.rows[shuffled], order.widths[shuffled], order.batch_size)
    return [batches[i] for i in rng.permutation(len(batches))]


# ----------------------------------------------------------------------------------------------
# Draft vocabulary
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class DraftVocab:
    target_ids: np.ndarray  # int64[Vd]: the target id of each draft id, ascending
    d2t: np.ndarray  # int64[Vd]: target_ids - arange(Vd), what eagle3.to_target_ids adds
    t2d: np.ndarray  # bool[V]: whether a target id is in the draft vocabulary

    @property
    def target_to_draft(self) -> np.ndarray:
        """int32[V]: the draft id of each target id, -1 where it has none."""
        lookup = np.full(self.t2d.shape, -1, np.int32)
        lookup[self.target_ids] = np.arange(len(self.target_ids), dtype=np.int32)
        return lookup


def draft_token_ranking(data: Dataset, vocab_size: int, first: np.ndarray | None = None) -> np.ndarray:
    """int64[V]: every target id, in the order a draft vocabulary takes them (`draft_vocab`): the
    most frequent response tokens (what the head will be asked to predict), then prompt tokens,
    then the unused ids, ties broken by the lower id.

    first: target ids that come before all others, in that same order among themselves: the
    vocabulary of a head a run starts from (`TrainConfig.keep_init_vocab`), so that a vocabulary
    at least that large keeps every one of its rows and grows by the data's most frequent others."""
    positions = np.arange(data.seq_len)[None, :]
    in_response = data.assistant_tokens()
    in_prompt = (positions < data.lengths[:, None]) & ~in_response
    response_counts = np.bincount(data.tokens[in_response], minlength=vocab_size)[:vocab_size]
    prompt_counts = np.bincount(data.tokens[in_prompt], minlength=vocab_size)[:vocab_size]
    kept = np.zeros(vocab_size, bool)
    if first is not None:
        first = np.asarray(first, np.int64)
        if first.ndim != 1 or ((first < 0) | (first >= vocab_size)).any():
            raise InvalidRequestError(f"the token ids to rank first must be a list of ids in [0, {vocab_size})")
        kept[first] = True
    # lexsort sorts by the last key first: kept ids, then response count, then prompt count (both
    # descending), then the id (ascending).
    return np.lexsort((np.arange(vocab_size), -prompt_counts, -response_counts, ~kept)).astype(np.int64)


def answer_token_coverage(data: Dataset, vocab_size: int, measured_on: Dataset | None = None,
                          first: np.ndarray | None = None) -> np.ndarray:
    """float64[V]: entry n - 1 is the fraction of assistant tokens that a draft vocabulary of the n
    first tokens of `data`'s ranking (`draft_token_ranking`) holds (what the head can ever propose).

    measured_on: count the assistant tokens of these rows instead (held-out text). Measured on the
    rows the ranking comes from, coverage overstates what unseen text gets: every token the
    answers use is in the ranking's head (round 0 of the SmolLM2 corpus: 0.99 of its own answer
    tokens in 5,120 tokens, 0.94 of its held-out rows'). first: as `draft_token_ranking`."""
    counted = data if measured_on is None else measured_on
    counts = np.bincount(counted.tokens[counted.assistant_tokens()], minlength=vocab_size)[:vocab_size]
    total = max(int(counts.sum()), 1)
    return np.cumsum(counts[draft_token_ranking(data, vocab_size, first)]) / total


def draft_vocab_size_for(data: Dataset, vocab_size: int, coverage: float, multiple: int = 256,
                         measured_on: Dataset | None = None, first: np.ndarray | None = None) -> int:
    """The smallest draft vocabulary, a multiple of `multiple` (at most the whole vocabulary), whose
    tokens (`data`'s first, by `draft_token_ranking`) cover at least `coverage` of the assistant
    tokens of `measured_on` (held-out rows; default `data`'s own: see `answer_token_coverage`).
    first: as `draft_token_ranking`; the size is then never below the count of those ids."""
    reached = answer_token_coverage(data, vocab_size, measured_on, first) >= coverage - 1e-12
    if first is not None:
        reached[: max(np.unique(first).size - 1, 0)] = False  # every kept id stays
    needed = int(np.argmax(reached)) + 1 if reached.any() else vocab_size
    return min(vocab_size, -(-needed // multiple) * multiple)


def draft_vocab(data: Dataset, vocab_size: int, draft_vocab_size: int, first: np.ndarray | None = None) -> DraftVocab:
    """The `draft_vocab_size` target tokens the head may draft: the first of `draft_token_ranking`
    (with `first`: those ids, then the data's most frequent others). Draft ids follow target ids
    in ascending order (d2t >= 0), as in EAGLE-3."""
    if not isinstance(draft_vocab_size, int) or not 1 <= draft_vocab_size <= vocab_size:
        raise InvalidRequestError(f"draft_vocab_size must be an integer in [1, {vocab_size}]; got {draft_vocab_size!r}")
    target_ids = np.sort(draft_token_ranking(data, vocab_size, first)[:draft_vocab_size])
    t2d = np.zeros(vocab_size, bool)
    t2d[target_ids] = True
    return DraftVocab(target_ids=target_ids, d2t=target_ids - np.arange(draft_vocab_size), t2d=t2d)
