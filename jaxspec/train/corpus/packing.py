"""From conversations to training rows: the held-out split (disjoint by template and by source)
and the packing of each conversation into a `Dataset` row with a per-token assistant mask
(`PackedCorpus`, dataset.npz).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxspec import self_instruct
from jaxspec.errors import CheckpointError, InvalidRequestError
from jaxspec.train.corpus.files import _write_atomic
from jaxspec.train.corpus.near_duplicates import normalize
from jaxspec.train.corpus.plan import TEMPLATED_SOURCES
from jaxspec.train.data import Dataset, concatenate_datasets, loss_mask


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
    ({"source", "text", optional "template"}, as prompts.jsonl.gz holds them).

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
        ids        str[N]    the conversation's prompt id (prompts.jsonl.gz)
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
        return cls(concatenate_datasets([part.data for part in parts]), np.concatenate([part.turns for part in parts]),
                   np.concatenate([part.ids for part in parts]))

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
