"""The resumable build: prompts (stage 1), answers (2), second turns (3), the packed dataset (4),
per round; `build_corpus` runs or resumes it, `corpus_status` says where it stands.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pathlib
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxspec import self_instruct
from jaxspec.api import Model
from jaxspec.errors import InvalidRequestError
from jaxspec.tokenizer import Tokenizer
from jaxspec.train.corpus.chat import _chat_tokenizer, chat_tokens
from jaxspec.train.corpus.files import (
    ANSWERS_DIR, CLAIM_POLL_SECONDS, DATASET_FILE, FORMAT_VERSION, MAGPIE_FILE, MANIFEST_FILE, PASSAGES_FILE,
    PLAN_FILE, PROMPTS_FILE, PROMPTS_REPORT_FILE, ROUND_DIR, SELECTION_FILE, TIMINGS_FILE, TURN2_DIR, _Busy,
    _add_seconds, _claim, _is_made, _jsonl_text, _made_once, _read_json, _read_jsonl, _shard_numbers, _shard_path,
    _write_json, _write_jsonl,
)
from jaxspec.train.corpus.generation import (
    ANSWER_SPANS, _generate_batches, synthesize_follow_ups, synthesize_user_prompts,
)
from jaxspec.train.corpus.mathematics import _wrapped_math
from jaxspec.train.corpus.near_duplicates import (
    _NearDuplicateIndex, _ReferenceIndex, spec_bench_questions, spec_bench_turns,
)
from jaxspec.train.corpus.packing import (
    PackedCorpus, _topic_templates, held_out_split, pack_conversations, self_instruct_template,
)
from jaxspec.train.corpus.plan import CorpusPlan, RoundShare, SOURCES, _check_plan, _plan_record
from jaxspec.train.data import read_prompts_jsonl

logger = logging.getLogger(__name__)


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
               if not _is_made(_shard_path(out_dir, stage, n))]
    elsewhere = []  # shards another live worker is making
    for number in tqdm(missing, desc=stage, unit="shard", disable=not progress):
        path = _shard_path(out_dir, stage, number)
        try:
            with _claim(path):
                if _is_made(path):
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
            if not _is_made(round_dir / PROMPTS_FILE):
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
        if wrote or not (out_dir / MANIFEST_FILE).is_file():
            # Otherwise a clone is rebuilding its ignored dataset.npz from the committed shards: the
            # same rows again, so the committed timings (and the manifest that copies them) stay.
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
        status[stage]["done"] = len(_shard_numbers(out_dir, stage))  # shard_NNNNN.jsonl.gz, or a legacy .jsonl
    if _is_made(out_dir / PROMPTS_FILE):
        status["prompts"] = sum(1 for line in _jsonl_text(out_dir / PROMPTS_FILE)[1].splitlines() if line.strip())
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
