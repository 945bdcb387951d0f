"""The training corpus (jaxspec.train.corpus): Spec-Bench held out of every source, near-duplicate
removal, math prompts, the Magpie prefix, chat tokens and the two-turn loss mask, the held-out
split, and the resumable build on a tiny random model with a ChatML word tokenizer."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

import jaxspec
from jaxspec import self_instruct, train
from jaxspec.tokenizer import Tokenizer
from jaxspec.train import corpus
from jaxspec.train.corpus import files, generation
from jaxspec.train.corpus.files import _read_jsonl
from tests.conftest import TINY, requires_default_model

# ChatML with a default system prompt, as SmolLM2's template writes it.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant<|im_end|>\\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
IM_START, IM_END = 1, 2
WORDS = ["system", "user", "assistant", "You", "are", "a", "helpful"]
# Ids the tiny model's greedy answers seldom reach, made end-of-turn ids too: its sampled user
# messages then end within a few tokens, while its greedy answers run long enough to be passages.
EXTRA_END_IDS = (11, 15, 22, 37, 42, 44, 46, 47, 48, 52, 56, 59, 61, 71, 72, 75, 85, 86, 91, 98, 104, 105, 110,
                 118, 120, 126, 127)


def chat_tokenizer() -> Tokenizer:
    vocab = SPECIAL + WORDS
    vocab += [f"word{i:03d}" for i in range(len(vocab), TINY.vocab_size)]
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="word010"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in SPECIAL])
    return Tokenizer(hf, eos_token_id=IM_END, extra_eos_token_ids=EXTRA_END_IDS, pad_token_id=0, chat_template=CHATML)


@pytest.fixture(scope="module")
def chat_model(tiny_model):
    return dataclasses.replace(tiny_model, tokenizer=chat_tokenizer())


@pytest.fixture(scope="module")
def spec_turns():
    turns = corpus.spec_bench_turns(corpus.spec_bench_questions())
    assert len(turns) == 560  # 480 questions, 80 of them with two turns: the file was read whole
    return turns


def has_mathematics_dataset() -> bool:
    try:
        corpus.math_modules()
        return True
    except jaxspec.InvalidRequestError:
        return False


requires_math = pytest.mark.skipif(not has_mathematics_dataset(),
                                   reason="mathematics_dataset not installed: pip install mathematics-dataset")


def edit(text: str, word_index: int) -> str:
    """A light edit: every letter's case flipped and one word replaced."""
    words = text.split()
    words[word_index] = "zebra"
    return " ".join(words).swapcase()


# ----------------------------------------------------------------------------------------------
# Spec-Bench stays out
# ----------------------------------------------------------------------------------------------

def test_no_prompt_source_is_near_a_spec_bench_question(spec_turns):
    default = corpus.CorpusPlan()
    topic = self_instruct.topic_prompts(default.self_instruct_topic, default.seed)
    articles = [f"{prompt} " + "It is a long story, told here in plain words for the reader. " * 4 for prompt in topic]
    sources = {"self_instruct_topic": topic,
               "self_instruct_passage": self_instruct.passage_prompts(articles, default.self_instruct_passage)}
    if has_mathematics_dataset():
        sources["math"] = corpus.math_prompts(default.math, default.seed)
    for source, texts in sources.items():
        near = [text for text, flag in zip(texts, corpus.near_flags(texts, spec_turns)) if flag]
        assert not near, f"{source}: {len(near)} prompts near Spec-Bench, e.g. {near[0][:100]!r}"
    # The positive control: a lightly edited question (case flipped, one word replaced), and the
    # same wrapped in a request, are caught; so is an excerpt of a long one.
    question = next(turn for turn in spec_turns if len(turn.split()) >= 12)
    edited = edit(question, 3)
    long_turn = max(spec_turns, key=len)
    caught = [edited, f"Please help me with this. {edited} Thanks!", question.upper(),
              "Summarize this: " + long_turn[len(long_turn) // 4: len(long_turn) // 2]]
    assert corpus.drop_near(caught + topic[:3], spec_turns) == topic[:3]


COMMITTED_CORPUS = pathlib.Path(__file__).resolve().parent.parent / "corpora" / "smollm2-135m"


def _committed_user_turns() -> list[str]:
    """Every user message of the committed corpus (corpora/smollm2-135m): each round's prompts
    and the follow-ups of its second turns, the training data of the shipped head."""
    texts = []
    for round_dir in sorted(COMMITTED_CORPUS.glob("round_*")):
        if (round_dir / "prompts.jsonl.gz").is_file():
            texts += [record["text"] for record in _read_jsonl(round_dir / "prompts.jsonl.gz")]
        for shard in sorted((round_dir / "turn2").glob("shard_*.jsonl.gz")):
            for record in _read_jsonl(shard):
                texts += [m["content"] for m in record["messages"][1:] if m["role"] == "user"]
    return texts


def _exact_hold_out_scores(texts: list[str], references: list[str]) -> np.ndarray:
    """float[N]: each text's largest hold_out_score over all references, computed for every pair
    at once from exact shingle counts (a sparse product), with no MinHash candidate stage."""
    from scipy import sparse

    def incidence(strings, columns):
        rows = [corpus.shingles(s) for s in strings]
        indices = np.concatenate([np.searchsorted(columns, r) for r in rows])
        pointers = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
        return sparse.csr_matrix((np.ones(len(indices)), indices, pointers), shape=(len(strings), len(columns)))

    columns = np.unique(np.concatenate([corpus.shingles(s) for s in [*texts, *references]]))
    ours, theirs = incidence(texts, columns), incidence(references, columns)
    shared = (ours @ theirs.T).toarray()  # [N, R]: shingles each pair shares
    sizes_ours, sizes_theirs = np.diff(ours.indptr)[:, None], np.diff(theirs.indptr)[None, :]
    score = shared / np.maximum(sizes_ours + sizes_theirs - shared, 1)
    score = np.maximum(score, np.where(sizes_theirs >= corpus.CONTAINED_REFERENCE_MIN_SHINGLES,
                                       shared / np.maximum(sizes_theirs, 1), 0.0))
    score = np.maximum(score, np.where(sizes_ours >= corpus.CONTAINED_TEXT_MIN_SHINGLES,
                                       shared / np.maximum(sizes_ours, 1), 0.0))
    return score.max(axis=1)


def test_the_committed_corpus_holds_no_prompt_near_spec_bench(spec_turns):
    """The shipped head's own training prompts, first turns and follow-ups, are each scored
    against every Spec-Bench turn exactly (no LSH), and none reaches the 0.6 the build drops at.
    Lightly edited Spec-Bench questions mixed in are caught by the same scoring: it can fail."""
    texts = _committed_user_turns()
    assert len(texts) >= 2688  # rounds 0-2 at least (894 + 897 + 897 first turns)
    rng = random.Random(1)
    controls = [edit(q, rng.randrange(len(q.split()))) for q in rng.sample(spec_turns, 5)]
    scores = _exact_hold_out_scores(texts + controls, spec_turns)
    assert (scores[len(texts):] >= 0.6).all(), scores[len(texts):]
    worst = int(np.argmax(scores[: len(texts)]))
    assert scores[worst] < 0.6, f"{texts[worst][:120]!r} is {scores[worst]:.2f} near a Spec-Bench turn"
    agree = [max(corpus.hold_out_score(texts[i], turn) for turn in spec_turns) for i in range(0, len(texts), 400)]
    assert scores[: len(texts): 400] == pytest.approx(agree)  # the product computes hold_out_score's rule


def test_the_fast_hold_out_index_agrees_with_the_pairwise_score(spec_turns):
    rng = random.Random(0)
    questions = rng.sample(spec_turns, 40)
    texts = [edit(q, rng.randrange(len(q.split()))) for q in questions]
    texts += self_instruct.topic_prompts(60, 3)
    references = [set(corpus.shingles(turn).tolist()) for turn in spec_turns]

    def pairwise_score(text: str) -> float:
        """hold_out_score's rule, over Python sets, against every reference in turn."""
        ours, best = set(corpus.shingles(text).tolist()), 0.0
        for theirs in references:
            shared = len(ours & theirs)
            best = max(best, shared / len(ours | theirs))
            if len(theirs) >= corpus.CONTAINED_REFERENCE_MIN_SHINGLES:
                best = max(best, shared / len(theirs))
            if len(ours) >= corpus.CONTAINED_TEXT_MIN_SHINGLES:
                best = max(best, shared / len(ours))
        return best

    scores = [pairwise_score(text) for text in texts]
    assert [max(corpus.hold_out_score(text, q) for q in questions) for text in texts[:40]] == pytest.approx(scores[:40])
    brute = [score >= 0.6 for score in scores]
    assert corpus.near_flags(texts, spec_turns, 0.6) == brute
    assert sum(brute[:40]) >= 30 and not any(brute[40:])  # both kinds are present: the check can fail


# ----------------------------------------------------------------------------------------------
# Near duplicates
# ----------------------------------------------------------------------------------------------

def test_deduplicate_catches_near_duplicates_and_keeps_distinct_texts():
    base = "Write a short story about a lighthouse keeper who finds a message in a bottle on the beach."
    near = [base.upper(), "  write a short story about a lighthouse keeper, who finds a message in a bottle on the beach",
            base.replace("short", "brief")]
    distinct = ["Explain how photosynthesis works to a ten-year-old.", "What is the capital of Australia?",
                "Write a haiku about autumn leaves.", "Give me three tips for a job interview."]
    assert corpus.deduplicate([base, *near, *distinct]) == [base, *distinct]
    assert corpus.similarity(base, near[0]) == 1.0 and corpus.similarity(base, distinct[0]) < 0.2
    # MinHash/LSH finds what an all-pairs Jaccard finds (here over templated prompts, which
    # share most of their text, and their near copies).
    texts = self_instruct.topic_prompts(300, 1)
    texts += [text.lower().replace(".", "!") for text in texts[:50]]
    threshold = 0.7
    keep = []
    for text in texts:
        if all(corpus.similarity(text, kept) < threshold for kept in keep):
            keep.append(text)
    assert corpus.deduplicate(texts, threshold) == keep
    assert len(keep) < 300  # some templated prompts are themselves near duplicates: the test can fail


# ----------------------------------------------------------------------------------------------
# Math prompts
# ----------------------------------------------------------------------------------------------

@requires_math
def test_math_prompts_are_reproducible_differ_by_seed_and_cover_several_areas():
    random.seed(7)
    np.random.seed(7)
    expected = (random.random(), np.random.random())
    random.seed(7)
    np.random.seed(7)
    first = corpus.math_prompts(60, 0)
    assert (random.random(), np.random.random()) == expected  # the callers' generators are left alone
    assert corpus.math_prompts(60, 0) == first
    other = corpus.math_prompts(60, 1)
    assert other != first and len(set(other) & set(first)) < 10
    assert len(set(first)) == 60
    areas = {module.split(".")[0] for module, _ in corpus.math_problems(60, 0)}
    assert len(areas) >= 6, areas
    assert not set(corpus.math_modules()) & corpus.BROKEN_MATH_MODULES
    assert all(any(text.replace(q, "") != text for q in ("?", ".", "")) for text in first)


# ----------------------------------------------------------------------------------------------
# Chat rendering: the Magpie prefix, the target's own tokens, the two-turn mask
# ----------------------------------------------------------------------------------------------

def test_magpie_prefix_for_chatml_ends_where_the_user_message_begins():
    tokenizer = chat_tokenizer()
    prefix = corpus.magpie_prefix(tokenizer)
    assert prefix == "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\n"
    assert corpus.USER_SENTINEL not in prefix and "\ue000" not in prefix
    ids, spans = corpus.chat_tokens(tokenizer, [], ending="user")
    assert ids == tokenizer.encode(prefix, add_special_tokens=False) and spans == []
    history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi you"}]
    later = corpus.magpie_prefix(tokenizer, history)
    assert later.endswith("<|im_start|>assistant\nhi you<|im_end|>\n<|im_start|>user\n")


def test_chat_tokens_use_the_targets_ids_and_match_the_template():
    tokenizer = chat_tokenizer()
    user = {"role": "user", "content": "word020 word021"}
    prompt, spans = corpus.chat_tokens(tokenizer, [user], ending="assistant")
    assert prompt == tokenizer.encode_chat("word020 word021") and spans == []
    answer = [30, 31, 32, IM_END]  # the target's ids, its end-of-turn token included
    second = {"role": "user", "content": "word040"}
    messages = [user, {"role": "assistant", "content": "word030 word031 word032", "token_ids": answer}, second,
                {"role": "assistant", "content": "word050", "token_ids": [50, IM_END]}]
    tokens, spans = corpus.chat_tokens(tokenizer, messages)
    # Prefix-stable: the first turn's prompt and answer open the two-turn tokens unchanged ...
    assert tokens[: len(prompt) + len(answer)] == prompt + answer
    # ... and the whole equals the template's rendering of the four messages (as text, up to the last <|im_end|>).
    rendered = tokenizer.encode_chat([{k: m[k] for k in ("role", "content")} for m in messages],
                                     add_generation_prompt=False)
    assert tokens == rendered[: len(tokens)] and rendered[len(tokens):] == []  # the word tokenizer drops "\n"
    assert spans == [(len(prompt), len(prompt) + 4), (len(tokens) - 2, len(tokens))]
    # A capped answer (no end-of-turn token) leaves the template's <|im_end|> outside its span.
    capped, capped_spans = corpus.chat_tokens(tokenizer, [messages[0], {**messages[1], "token_ids": [30, 31]},
                                                          second], ending="assistant")
    start, end = capped_spans[0]
    assert capped[start:end] == [30, 31] and capped[end] == IM_END


def test_the_packed_mask_covers_exactly_the_assistant_tokens_of_both_turns():
    tokenizer = chat_tokenizer()
    messages = [{"role": "user", "content": "word020"},
                {"role": "assistant", "content": "word030 word031", "token_ids": [30, 31, IM_END]},
                {"role": "user", "content": "word040 word041"}]
    prompt, spans = corpus.chat_tokens(tokenizer, messages, ending="assistant")
    answer = [50, 51, 52, IM_END]
    two_turn = {"id": "magpie-000000", "messages": messages + [{"role": "assistant", "content": "word050"}],
                "prompt_ids": prompt, "answer_ids": answer,
                "assistant_spans": [list(spans[0]), [len(prompt), len(prompt) + len(answer)]]}
    one_prompt = tokenizer.encode_chat("word060")
    one_turn = {"id": "math-000000", "messages": [{"role": "user", "content": "word060"},
                                                  {"role": "assistant", "content": "word070"}],
                "prompt_ids": one_prompt, "answer_ids": [70, IM_END],
                "assistant_spans": [[len(one_prompt), len(one_prompt) + 2]]}
    packed, report = corpus.pack_conversations([two_turn, one_turn], seq_len=40, held_out_ids=["math-000000"])
    assert report == {"dropped": {}, "cut_to_window": 0}
    tokens, mask = packed.data.tokens[0], packed.data.assistant[0]
    assert tokens[mask].tolist() == [30, 31, IM_END, 50, 51, 52, IM_END]  # both answers, nothing else
    user_two = [i for i, t in enumerate(tokens[: packed.data.lengths[0]]) if t in (40, 41)]
    assert user_two and not mask[user_two].any()
    assert packed.data.prompt_lengths.tolist() == [spans[0][0], len(one_prompt)]
    assert packed.turns.tolist() == [2, 1] and packed.held_out.tolist() == [False, True]
    # The loss mask is the assistant mask shifted to "predicts an assistant token"; for one turn
    # it is response_mask, for two it leaves the second user message out where response_mask does not.
    loss = packed.loss_mask()
    np.testing.assert_array_equal(np.asarray(packed.data.batch([0, 1])["loss_mask"]), loss)  # what the trainer reads
    expected = np.asarray(train.response_mask(jnp.asarray(packed.data.lengths), jnp.asarray(packed.data.prompt_lengths),
                                              40))
    np.testing.assert_array_equal(loss[1], expected[1])
    assert loss[0].sum() == 7 and expected[0].sum() > 7
    assert not loss[0][[i - 1 for i in user_two]].any()
    # Cut to the window, not dropped: a window ending inside the second answer keeps its start.
    cut, report = corpus.pack_conversations([two_turn], seq_len=len(prompt) + 2)
    assert report["cut_to_window"] == 1 and cut.data.assistant[0].sum() == 3 + 2


# ----------------------------------------------------------------------------------------------
# The held-out split
# ----------------------------------------------------------------------------------------------

def template_of(record) -> str:
    """The self_instruct template a prompt was written from, found by filling each one in."""
    text = record["text"]
    if record["source"] == "self_instruct_passage":
        templates = [t for group in self_instruct.PASSAGE_TEMPLATES.values() for t in group]
        return max((t for t in templates if text.startswith(t.split("{passage}")[0])), key=len)
    templates = [t for group in self_instruct.TEMPLATES.values() for t in group]
    for template in templates:
        if any(template.format(topic=topic) == text for topic in self_instruct.TOPICS):
            return template
    for template in self_instruct.CODING_TEMPLATES:
        if any(template.format(task=task) == text for task in self_instruct.CODING_TASKS):
            return template
    return "word problem"


def test_held_out_split_shares_no_template_group_with_training():
    topic = self_instruct.topic_prompts(1200, 0)
    articles = [f"{p} " + "Some sentences make a passage long enough to summarise here. " * 3 for p in topic[:40]]
    records = [{"source": "self_instruct_topic", "text": t} for t in topic]
    records += [{"source": "self_instruct_passage", "text": t} for t in self_instruct.passage_prompts(articles, 120)]
    records += [{"source": "magpie", "text": f"Question number {i} about something else"} for i in range(2000)]
    train_part, held = corpus.held_out_split(records, 0.1, seed=3)
    assert len(train_part) + len(held) == len(records)
    train_templates = {(r["source"], template_of(r)) for r in train_part if r["source"] != "magpie"}
    held_templates = {(r["source"], template_of(r)) for r in held if r["source"] != "magpie"}
    assert held_templates and not train_templates & held_templates
    # Each templated source holds out some of its templates, never all.
    assert {s for s, _ in held_templates} == {s for s, _ in train_templates} == set(corpus.TEMPLATED_SOURCES)
    magpie_held = sum(r["source"] == "magpie" for r in held)
    assert 120 < magpie_held < 280  # about 10% of 2000, by hash
    # A function of the seed and the groups: the same split for shuffled records, another for another seed.
    shuffled = random.Random(0).sample(records, len(records))
    assert {r["text"] for r in corpus.held_out_split(shuffled, 0.1, seed=3)[1]} == {r["text"] for r in held}
    assert {r["text"] for r in corpus.held_out_split(records, 0.1, seed=4)[1]} != {r["text"] for r in held}


# ----------------------------------------------------------------------------------------------
# Magpie synthesis and the resumable build (tiny random model)
# ----------------------------------------------------------------------------------------------

def test_magpie_rows_of_a_batch_sample_independently(chat_model):
    prefix, _ = corpus.chat_tokens(chat_model.tokenizer, [], ending="user")
    result = jaxspec.generate(chat_model, None, [prefix] * 8, temperature=1.0, top_p=0.95, seed=0, max_new_tokens=24)
    assert len({tuple(row) for row in result.tokens}) == 8
    synthesis = corpus.synthesize_user_prompts(chat_model, 6, seed=0, batch_size=8, max_new_tokens=24)
    assert len(synthesis.texts) == 6 == len(set(synthesis.texts)) and synthesis.shortfall == 0
    assert all(len(text.split()) >= 3 and "<|" not in text for text in synthesis.texts)
    # The same draw with some of its own prompts held out: those are dropped as near Spec-Bench.
    held = corpus.synthesize_user_prompts(chat_model, 6, seed=0, batch_size=8, max_new_tokens=24,
                                          spec_bench=synthesis.texts[:2])
    assert held.drops["near_spec_bench"] == 2 and not set(held.texts) & set(synthesis.texts[:2])
    bounded = corpus.synthesize_user_prompts(chat_model, 500, seed=0, batch_size=8, max_new_tokens=24, max_batches=2)
    assert bounded.batches == 2 and bounded.shortfall == 500 - len(bounded.texts) > 0  # said, not hidden
    assert bounded.examined == len(bounded.texts) + sum(bounded.drops.values()) == 16


def test_greedy_answers_written_in_spans_are_the_answers_written_at_once(chat_model):
    """Answers come in spans (corpus.generation.ANSWER_SPANS): rows still going continue from their own
    prefix, regrouped; greedy, that is the same text as one span, ends and bounds alike."""
    tokenizer = chat_model.tokenizer
    texts = ["hello", "tell me about the history of paper money", "plan a trip " * 6, "why", "a b c d e f g " * 4]
    prompts = [corpus.chat_tokens(tokenizer, [{"role": "user", "content": text}], ending="assistant")[0]
               for text in texts]
    window = max(map(len, prompts)) + 10  # the longest prompt's row meets the window before 24 new tokens
    options = dict(batch_size=2, max_new_tokens=24, window=window)
    free = generation._generate_batches(chat_model, prompts, **options)
    stop = free[0][0][5]  # a token row 0 writes early: rows that write it end there
    whole = generation._generate_batches(chat_model, prompts, stop_token_ids=[stop], **options)
    reasons = [reason for _, reason in whole]
    assert "stop" in reasons and "length" in reasons, reasons  # rows end in the first span and run on
    assert any(len(tokens) < 24 and reason == "length" for tokens, reason in whole)  # the window's bound
    for spans in (2, 3):
        assert generation._generate_batches(chat_model, prompts, stop_token_ids=[stop], spans=spans,
                                        **options) == whole


def test_long_prompts_go_in_halved_batches_with_the_same_answers(chat_model, monkeypatch):
    """No generation batch holds more than batch_size rows of BATCH_PROMPT_TOKENS (memory): long
    prompts go in power-of-two fractions of the batch; each row's greedy answer is unchanged."""
    tokenizer = chat_model.tokenizer
    prompts = [corpus.chat_tokens(tokenizer, [{"role": "user", "content": "tell me " * words}], ending="assistant")[0]
               for words in (1, 2, 3, 4, 8, 16, 24, 32)]
    options = dict(batch_size=4, max_new_tokens=8)
    whole = generation._generate_batches(chat_model, prompts, **options)
    batches = []
    real = generation.generate

    def generate(model, draft, rows, **kwargs):
        batches.append((len(rows), max(map(len, rows))))
        return real(model, draft, rows, **kwargs)

    monkeypatch.setattr(generation, "generate", generate)
    monkeypatch.setattr(generation, "BATCH_PROMPT_TOKENS", 24)
    assert generation._generate_batches(chat_model, prompts, **options) == whole
    assert all(rows == 1 or rows * longest <= 4 * 24 for rows, longest in batches), batches
    assert {rows for rows, _ in batches} == {4, 2, 1} and sum(rows for rows, _ in batches) >= len(prompts), batches


@contextlib.contextmanager
def counted_generate(fail_at: int | None = None):
    """The corpus's generate (corpus.generation.generate), counting its calls; with `fail_at`, that
    call raises (a killed run)."""
    calls = []
    real = generation.generate

    def generate(*args, **kwargs):
        calls.append(kwargs.get("max_new_tokens"))
        if fail_at is not None and len(calls) == fail_at:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(generation, "generate", generate)
        yield calls


def tiny_plan(prompts_file) -> corpus.CorpusPlan:
    return corpus.CorpusPlan(
        magpie=8, self_instruct_topic=8, self_instruct_passage=4, math=8 if has_mathematics_dataset() else 0,
        prompts_file=str(prompts_file), follow_up_fraction=0.5, magpie_max_new_tokens=24, passage_max_new_tokens=48,
        answer_max_new_tokens=16, seq_len=96, magpie_batch_size=8, answer_batch_size=8, shard_size=8,
        held_out_fraction=0.2)


@pytest.fixture(scope="module")
def user_file(tmp_path_factory, spec_turns):
    question = next(turn for turn in spec_turns if len(turn.split()) >= 12)
    lines = [{"prompt": "Tell me about the history of paper money in a few sentences."},
             {"text": "tell me about the history of paper money, in a few sentences"},  # a near duplicate
             {"prompt": question}, {"prompt": edit(question, 2)},  # Spec-Bench, as is and lightly edited
             {"prompt": "Plan a three day walking trip in the mountains for two beginners."}]
    path = tmp_path_factory.mktemp("user") / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def built(chat_model, user_file, tmp_path_factory):
    """An uninterrupted build: (its directory, the manifest, generate calls made)."""
    out_dir = tmp_path_factory.mktemp("corpus") / "built"
    with counted_generate() as calls:
        manifest = corpus.build_corpus(chat_model, out_dir, tiny_plan(user_file))
    return out_dir, manifest, len(calls)


def corpus_files(out_dir) -> dict[str, bytes]:
    """Every data file's bytes (not the timings, nor the manifest's seconds)."""
    files = {str(p.relative_to(out_dir)): p.read_bytes() for p in sorted(out_dir.rglob("*"))
             if p.is_file() and p.name not in (corpus.TIMINGS_FILE, corpus.MANIFEST_FILE, "dataset.npz")}
    manifest = json.loads((out_dir / corpus.MANIFEST_FILE).read_text())
    manifest.pop("seconds")
    files["manifest"] = json.dumps(manifest, sort_keys=True).encode()
    with np.load(out_dir / "dataset.npz") as data:
        files.update({f"dataset/{name}": data[name].tobytes() for name in data.files})
    return files


def test_build_corpus_writes_every_stage(built, spec_turns):
    out_dir, manifest, calls = built
    assert calls > 0
    for name in ("plan.json", "prompts.jsonl.gz", "prompts_report.json", "pool/magpie.json", "pool/passages.json",
                 "answers/shard_00000.jsonl.gz", "turn2/selection.json", "turn2/shard_00000.jsonl.gz", "dataset.npz"):
        assert (out_dir / name).is_file(), name
    status = corpus.corpus_status(out_dir)
    assert status["complete"] and status["next"] is None
    assert status["answers"]["done"] == status["answers"]["total"] == -(-manifest["prompts"] // 8)
    prompts = _read_jsonl(out_dir / "prompts.jsonl.gz")
    sources = {r["source"] for r in prompts}
    assert {"magpie", "self_instruct_topic", "self_instruct_passage", "user"} <= sources
    # Nothing in the pool is near Spec-Bench, the model-written magpie prompts included (pairwise check).
    near = [r["text"] for r in prompts if max(corpus.hold_out_score(r["text"], t) for t in spec_turns) >= 0.6]
    assert not near, near
    user = manifest["sources"]["user"]
    assert user["kept"] == 2 and user["drops"] == {"duplicate": 1, "near_spec_bench": 2}
    assert manifest["sources"]["magpie"]["kept"] == 8
    data = corpus.PackedCorpus.load(out_dir / "dataset.npz")
    trainer = train.Dataset.load(out_dir / "dataset.npz")  # the trainer's reader: the assistant mask comes too
    assert trainer.assistant is not None and trainer.fingerprint() == data.data.fingerprint()
    assert manifest["rows"]["total"] == len(data.data) and manifest["rows"]["two_turn"] == int((data.turns == 2).sum()) > 0
    assert manifest["tokens"]["assistant_tokens_in_window"] == int(data.data.assistant.sum())
    # Each row's mask is its record's assistant spans, cut to the window (the two-turn record
    # unless the target's second answer was empty).
    records = {r["id"]: r for stage in ("answers", "turn2") for path in sorted((out_dir / stage).glob("shard_*"))
               for r in _read_jsonl(path)
               if stage == "answers" or r["messages"][-1]["content"].strip()}
    for row, conversation_id in enumerate(data.ids):
        record = records[conversation_id]
        tokens = record["prompt_ids"] + record["answer_ids"]
        assert data.turns[row] == len(record["assistant_spans"])
        expected = corpus.conversation_mask(len(tokens), record["assistant_spans"])[:96]
        np.testing.assert_array_equal(data.data.assistant[row, : len(expected)], expected)
        assert data.data.tokens[row, : data.data.lengths[row]].tolist() == tokens[:96]


def test_a_second_build_generates_nothing(built, chat_model, user_file):
    out_dir, manifest, _ = built
    with counted_generate() as calls:
        again = corpus.build_corpus(chat_model, out_dir, tiny_plan(user_file))
    assert calls == [] and again == manifest


def test_a_clone_rebuilds_the_ignored_dataset_leaving_the_committed_files_as_they_were(built, chat_model, user_file):
    out_dir, _, _ = built
    committed = {p: p.read_bytes() for p in sorted(out_dir.rglob("*")) if p.is_file() and p.name != "dataset.npz"}
    expected = corpus_files(out_dir)
    (out_dir / "dataset.npz").unlink()  # ignored by git: a fresh clone has the shards, not the rows
    with counted_generate() as calls:
        corpus.build_corpus(chat_model, out_dir, tiny_plan(user_file))
    assert calls == [] and corpus_files(out_dir) == expected
    assert {p: p.read_bytes() for p in committed} == committed  # timings.json's seconds included


def test_a_killed_build_resumes_to_the_same_corpus(built, chat_model, user_file, tmp_path):
    out_dir, _, total_calls = built
    expected = corpus_files(out_dir)
    for kill_at in (total_calls // 2, total_calls - 1):
        resumed_dir = tmp_path / f"killed_at_{kill_at}"
        with counted_generate(fail_at=kill_at), pytest.raises(KeyboardInterrupt):
            corpus.build_corpus(chat_model, resumed_dir, tiny_plan(user_file))
        assert not corpus.corpus_status(resumed_dir)["complete"]
        assert not list(resumed_dir.rglob(".*.tmp"))  # no half-written file left behind
        with counted_generate() as calls:
            corpus.build_corpus(chat_model, resumed_dir, tiny_plan(user_file))
        assert 0 < len(calls) < total_calls
        assert corpus_files(resumed_dir) == expected
    # A deleted shard is regenerated alone, and the data comes out the same.
    last = max((out_dir / "answers").glob("shard_*.jsonl.gz"))
    last.unlink()
    with counted_generate() as calls:
        corpus.build_corpus(chat_model, out_dir, tiny_plan(user_file))
    assert 0 < len(calls) <= 2 and corpus_files(out_dir) == expected


def test_corpus_jsonl_files_are_gzip_written_deterministically_and_read_in_either_form(tmp_path):
    """Prompts and shards are written as .jsonl.gz with nothing of the moment in the header, so the
    same records give the same bytes; a plain .jsonl of the same name (a corpus from before gzip)
    is read in its place."""
    records = [{"id": "r000-magpie-000000", "source": "magpie", "text": "Caf\u00e9 \u2713, \"quoted\"\n",
                "ids": [1, 2, 3]},
               {"id": "r000-math-000001", "source": "math", "text": "What is 2 + 2?"}]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    shard = files._shard_path(tmp_path / "a", corpus.ANSWERS_DIR, 0)
    assert shard.name == "shard_00000.jsonl.gz" and corpus.PROMPTS_FILE == "prompts.jsonl.gz"
    files._write_jsonl(shard, records)
    data = shard.read_bytes()
    # gzip's magic, deflate, no flags (so no file name), mtime 0, OS "unknown": nothing of where or when.
    assert data[:10] == b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    assert gzip.decompress(data).decode("utf-8") == text
    assert files._read_jsonl(shard) == records
    assert not list(shard.parent.glob(".*"))  # no temporary file or claim left
    # Rewritten elsewhere, under another name and at another time: the same bytes.
    time.sleep(1.1)
    again = tmp_path / "b" / corpus.PROMPTS_FILE
    files._write_jsonl(again, records)
    assert again.read_bytes() == data
    # A legacy plain shard stands for the .jsonl.gz one: made, read, counted.
    legacy_dir = tmp_path / "legacy"
    (legacy_dir / corpus.ANSWERS_DIR).mkdir(parents=True)
    (legacy_dir / corpus.ANSWERS_DIR / "shard_00000.jsonl").write_text(text, encoding="utf-8")
    canonical = files._shard_path(legacy_dir, corpus.ANSWERS_DIR, 0)
    assert files._is_made(canonical) and not canonical.exists() and files._read_jsonl(canonical) == records
    assert not files._is_made(files._shard_path(legacy_dir, corpus.ANSWERS_DIR, 1))
    files._write_jsonl(files._shard_path(legacy_dir, corpus.ANSWERS_DIR, 1), records[:1])
    assert files._shard_numbers(legacy_dir, corpus.ANSWERS_DIR) == {0, 1}
    with pytest.raises(FileNotFoundError, match="shard_00002.jsonl.gz"):
        files._read_jsonl(files._shard_path(legacy_dir, corpus.ANSWERS_DIR, 2))
    # A damaged file names itself.
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(jaxspec.CheckpointError, match=r"shard_00000.jsonl.gz is not readable gzip"):
        files._read_jsonl(shard)


def test_a_corpus_built_before_gzip_resumes_as_it_is(built, chat_model, user_file, tmp_path):
    """A corpus whose prompts and shards are plain .jsonl (written before gzip) is complete as it
    is: nothing regenerated, nothing rewritten; a shard it lacks is made as .jsonl.gz, and the
    data comes out the same."""
    out_dir, _, _ = built
    legacy = tmp_path / "legacy"
    shutil.copytree(out_dir, legacy)
    manifest = json.loads((out_dir / corpus.MANIFEST_FILE).read_text())  # as now (an earlier test may rebuild a shard)
    for path in sorted(legacy.rglob("*.jsonl.gz")):
        path.with_name(path.name[: -len(".gz")]).write_bytes(gzip.decompress(path.read_bytes()))
        path.unlink()
    plain = {p: p.read_bytes() for p in sorted(legacy.rglob("*.jsonl"))}
    assert len(plain) >= 3
    status = corpus.corpus_status(legacy)
    assert status == corpus.corpus_status(out_dir) and status["complete"] and status["answers"]["done"] >= 1
    with counted_generate() as calls:
        again = corpus.build_corpus(chat_model, legacy, tiny_plan(user_file))
    assert calls == [] and again == manifest
    assert {p: p.read_bytes() for p in sorted(legacy.rglob("*.jsonl"))} == plain and not list(legacy.rglob("*.gz"))
    expected = {k: v for k, v in corpus_files(out_dir).items() if k == "manifest" or k.startswith("dataset/")}
    last = max((legacy / "answers").glob("shard_*.jsonl"))
    last.unlink()
    with counted_generate() as calls:
        corpus.build_corpus(chat_model, legacy, tiny_plan(user_file))
    assert calls
    regenerated = last.with_name(last.name + ".gz")
    assert regenerated.is_file()
    assert files._read_jsonl(regenerated) == files._read_jsonl(out_dir / "answers" / regenerated.name)
    assert {k: v for k, v in corpus_files(legacy).items() if k in expected} == expected


def test_a_changed_plan_is_refused_naming_the_field(built, chat_model, user_file):
    out_dir, _, _ = built
    changed = dataclasses.replace(tiny_plan(user_file), seq_len=128)
    with counted_generate() as calls, pytest.raises(jaxspec.InvalidRequestError, match=r"seq_len \(96 there, 128 now\)"):
        corpus.build_corpus(chat_model, out_dir, changed)
    assert calls == []
    with pytest.raises(jaxspec.InvalidRequestError, match="answer_batch_size must be an integer >= 1"):
        corpus.CorpusPlan(answer_batch_size=0)


@pytest.fixture(scope="module")
def built_in_rounds(chat_model, user_file, tmp_path_factory):
    """The tiny plan in two rounds, uninterrupted: (its directory, the manifest, generate calls)."""
    out_dir = tmp_path_factory.mktemp("corpus") / "rounds"
    with counted_generate() as calls:
        manifest = corpus.build_corpus(chat_model, out_dir, dataclasses.replace(tiny_plan(user_file), rounds=2))
    return out_dir, manifest, len(calls)


def round_prompts(out_dir, index):
    return _read_jsonl(out_dir / f"round_{index:03d}" / "prompts.jsonl.gz")


def test_rounds_share_the_plan_without_repeating_a_prompt(built_in_rounds, spec_turns):
    out_dir, manifest, _ = built_in_rounds
    assert manifest["rounds_done"] == 2 and corpus.corpus_status(out_dir)["complete"]
    first, second = round_prompts(out_dir, 0), round_prompts(out_dir, 1)
    for records, index in ((first, 0), (second, 1)):
        assert all(r["id"].startswith(f"r{index:03d}-") for r in records)
    # The finite pools are split in disjoint slices: 8 topic prompts, 4 + 4.
    topics = [[r["text"] for r in records if r["source"] == "self_instruct_topic"] for records in (first, second)]
    assert len(topics[0]) == len(topics[1]) == 4
    assert sorted(topics[0] + topics[1]) == sorted(self_instruct.topic_prompts(8, 0))
    # No prompt of round 1 repeats one of round 0, nor is near one (the rounds' own checks), and
    # nothing is near Spec-Bench.
    texts = [r["text"] for r in first + second]
    assert len({corpus.normalize(t) for t in texts}) == len(texts)
    assert not any(corpus.hold_out_score(t, s) >= 0.6 for t in texts for s in spec_turns)
    # The top dataset is the rounds' rows in order, and its split is the split of their union.
    parts = [corpus.PackedCorpus.load(out_dir / f"round_{i:03d}" / "dataset.npz") for i in (0, 1)]
    top = corpus.PackedCorpus.load(out_dir / "dataset.npz")
    assert top.ids.tolist() == parts[0].ids.tolist() + parts[1].ids.tolist()
    assert top.data.fingerprint() == corpus.PackedCorpus.concatenate(parts).data.fingerprint()
    _, held = corpus.held_out_split(first + second, 0.2, 0)
    assert {i for i, h in zip(top.ids.tolist(), top.held_out) if h} == {r["id"] for r in held} & set(top.ids.tolist())
    assert manifest["rows"]["total"] == len(top.data) == sum(len(p.data) for p in parts)
    assert manifest["prompts"] == len(first) + len(second)
    assert manifest["tokens"]["assistant_tokens_in_window"] == int(top.data.assistant.sum())


def test_a_corpus_of_rounds_is_usable_between_rounds_and_resumes_to_the_same(built_in_rounds, chat_model, user_file,
                                                                           tmp_path):
    out_dir, _, total_calls = built_in_rounds
    plan = dataclasses.replace(tiny_plan(user_file), rounds=2)
    killed = tmp_path / "killed"
    with counted_generate(fail_at=total_calls - 1), pytest.raises(KeyboardInterrupt):
        corpus.build_corpus(chat_model, killed, plan)
    status = corpus.corpus_status(killed)
    assert status["rounds"] == {"done": 1, "total": 2} and status["next"].startswith("round 1: ")
    between = json.loads((killed / "manifest.json").read_text())
    assert between["rounds_done"] == 1
    round_zero = corpus.PackedCorpus.load(out_dir / "round_000" / "dataset.npz")
    assert corpus.PackedCorpus.load(killed / "dataset.npz").data.fingerprint() == round_zero.data.fingerprint()
    with counted_generate() as calls:
        corpus.build_corpus(chat_model, killed, plan)
    assert 0 < len(calls) < total_calls
    assert corpus_files(killed) == corpus_files(out_dir)
    with pytest.raises(jaxspec.InvalidRequestError, match=r"rounds \(2 there, 3 now\)"):
        corpus.build_corpus(chat_model, killed, dataclasses.replace(plan, rounds=3))
    with pytest.raises(jaxspec.InvalidRequestError, match="rounds must be an integer >= 1"):
        corpus.CorpusPlan(rounds=0)


def test_workers_share_a_corpus_through_claims(built_in_rounds, chat_model, user_file, tmp_path):
    """A worker skips what another live worker has claimed and goes on to what it can make (the
    next round); once the claimant is gone its claim is stale, taken over, and the corpus comes
    out as one worker alone makes it."""
    out_dir, _, _ = built_in_rounds
    plan = dataclasses.replace(tiny_plan(user_file), rounds=2)
    shared = tmp_path / "shared"
    claim = shared / "round_000" / "answers" / ".shard_00000.jsonl.gz.claim"
    claim.parent.mkdir(parents=True)
    (shared / "plan.json").write_bytes((out_dir / "plan.json").read_bytes())  # the other worker started it
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        claim.write_text(f"{socket.gethostname()} {other.pid}\n")
        status = corpus.build_corpus(chat_model, shared, plan, wait=False)
        assert status["busy"] and status["rounds"]["done"] == 0 and status["next"] == "round 0: answers"
        assert not (shared / "round_000" / "answers" / "shard_00000.jsonl.gz").exists()
        assert (shared / "round_000" / "answers" / "shard_00001.jsonl.gz").is_file()
        assert (shared / "round_001" / "manifest.json").is_file()  # the next round went ahead
        assert not (shared / "dataset.npz").exists()  # nothing to cover until round 0 is done
    finally:
        other.kill()
        other.wait()
    with counted_generate() as calls:
        manifest = corpus.build_corpus(chat_model, shared, plan)
    assert calls and manifest["rounds_done"] == 2 and not list(shared.rglob(".*.claim"))
    assert corpus_files(shared) == corpus_files(out_dir)


# ----------------------------------------------------------------------------------------------
# The real default model
# ----------------------------------------------------------------------------------------------

@requires_default_model
@pytest.mark.real_model
def test_smollm2_writes_clean_user_prompts(spec_turns):
    model = jaxspec.load()
    assert corpus.magpie_prefix(model.tokenizer).endswith("<|im_end|>\n<|im_start|>user\n")
    synthesis = corpus.synthesize_user_prompts(model, 8, seed=0, batch_size=8, max_new_tokens=24, max_batches=2,
                                               spec_bench=spec_turns)
    assert synthesis.texts and len(set(synthesis.texts)) == len(synthesis.texts)
    assert all(len(text.split()) >= 3 and "<|im_" not in text for text in synthesis.texts)
    assert not any(corpus.near_flags(synthesis.texts, spec_turns))


def test_cli_corpus_reports_its_status_and_refuses_a_bad_plan(tmp_path, capsys):
    from jaxspec import cli

    assert cli.main(["corpus", "--out", str(tmp_path / "c"), "--status"]) == 0
    assert json.loads(capsys.readouterr().out)["next"] == "plan"
    assert cli.main(["corpus", "--out", str(tmp_path / "c"), "--magpie", "-3", "--prompts", "x.jsonl"]) == 2
    assert "magpie must be an integer >= 0" in capsys.readouterr().err
