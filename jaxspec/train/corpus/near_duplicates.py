"""Text similarity for the corpus, and Spec-Bench, the set every source is kept away from.

`normalize` + 5-character shingles: `deduplicate` drops near duplicates within a source
(Jaccard; MinHash/LSH finds the candidates, an exact check decides), `drop_near` removes
anything near a reference text (Jaccard, or one mostly contained in the other), and
`spec_bench_questions` / `spec_bench_turns` read the references: every turn of Spec-Bench.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import sys
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxspec.errors import CheckpointError, InvalidRequestError


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
    return pathlib.Path(__file__).resolve().parents[3] / "bench" / "data" / "spec_bench" / "question.jsonl"


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
