"""What a corpus build makes (`CorpusPlan`), a round's share of it (`RoundShare`), and the record
in plan.json that a resumed build must match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
from typing import Any

from jaxspec import self_instruct
from jaxspec.api import Model
from jaxspec.errors import InvalidRequestError
from jaxspec.train.corpus.chat import _chat_tokenizer
from jaxspec.train.corpus.files import FORMAT_VERSION, PLAN_FILE, _file_sha256, _read_json, _write_json
from jaxspec.train.corpus.generation import _check_count, _derive_seed
from jaxspec.train.corpus.near_duplicates import _check_threshold, default_spec_bench_path


SOURCES = ("user", "self_instruct_topic", "self_instruct_passage", "math", "magpie")  # earlier wins a tie
TEMPLATED_SOURCES = ("self_instruct_topic", "self_instruct_passage")


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
