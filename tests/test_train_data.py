"""Training data (jaxspec.train.data): self-distillation, packing, the response mask, batch order,
the draft vocabulary, prompt files."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import train
from jaxspec.models import eagle3
from train_fixtures import ANSWER, CYCLE, SEQ_LEN, distilled_toy


@pytest.fixture(scope="module")
def toy():
    return distilled_toy()


def test_self_distill_answers_with_the_targets_greedy_tokens(toy):
    _, prompts, examples, data = toy
    for prompt, example in zip(prompts, examples):
        assert example.tokens[: example.prompt_length] == tuple(prompt)
        answer = example.tokens[example.prompt_length:]
        assert len(answer) == ANSWER
        expected = [(prompt[-1] + 1 + i) % CYCLE for i in range(ANSWER)]
        assert list(answer) == expected
    assert data.tokens.shape == (len(prompts), SEQ_LEN)
    assert data.lengths.tolist() == [min(len(p) + ANSWER, SEQ_LEN) for p in prompts]


def test_pack_and_response_mask():
    examples = [train.Example(tokens=(5, 6, 7, 8, 9), prompt_length=2),  # fits
                train.Example(tokens=(1, 2, 3, 4, 5, 6, 7), prompt_length=3),  # truncated to 6
                train.Example(tokens=(1, 2, 3, 4, 5, 6, 7), prompt_length=6)]  # prompt fills it: dropped
    data = train.pack(examples, 6)
    np.testing.assert_array_equal(data.tokens, [[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(data.lengths, [5, 6])
    # Position t counts when its next token is an answer token: prompt_length - 1 <= t < length - 1.
    mask = train.response_mask(jnp.asarray(data.lengths), jnp.asarray(data.prompt_lengths), 6)
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0]])
    with pytest.raises(jaxspec.InvalidRequestError, match="no example has a response token"):
        train.pack(examples[2:], 6)


def test_a_two_turn_conversation_trains_on_both_answers_only(tmp_path):
    """An explicit assistant mask (user, answer, user, answer): the loss counts the positions
    before every assistant token and none before a user token; it is what the single-turn mask
    is when there is one turn; it survives subset, save and load, and changes the fingerprint."""
    tokens = np.asarray([[1, 2, 10, 11, 3, 4, 12, 13, 0, 0],
                         [1, 2, 3, 14, 15, 16, 0, 0, 0, 0]], np.int32)
    lengths = np.asarray([8, 6], np.int32)
    assistant = np.zeros_like(tokens, bool)
    assistant[0, [2, 3, 6, 7]] = True  # both answers of row 0
    assistant[1, 3:6] = True  # row 1: one turn, prompt of 3
    data = train.Dataset(tokens, lengths, np.asarray([2, 3], np.int32), assistant)
    mask = np.asarray(data.batch([0, 1, -1])["loss_mask"])
    np.testing.assert_array_equal(mask[0], [0, 1, 1, 0, 0, 1, 1, 0, 0, 0])  # t before tokens 2, 3, 6, 7
    single = train.response_mask(jnp.asarray([6]), jnp.asarray([3]), 10)[0]
    np.testing.assert_array_equal(mask[1], single)
    assert not mask[2].any()  # the empty row
    vocab = train.draft_vocab(data, vocab_size=20, draft_vocab_size=7)
    assert vocab.target_ids.tolist() == [10, 11, 12, 13, 14, 15, 16]  # answers only, never 3 or 4
    path = tmp_path / "two_turns.npz"
    data.subset([0]).save(path)
    loaded = train.Dataset.load(path)
    np.testing.assert_array_equal(loaded.assistant, assistant[:1])
    assert loaded.fingerprint() == data.subset([0]).fingerprint()
    assert data.fingerprint() != train.Dataset(tokens, lengths, data.prompt_lengths).fingerprint()


def test_the_draft_vocabulary_can_be_sized_by_the_answers_it_covers():
    # 1000 answer tokens over 600 ids: id i (< 300) appears 3 times, id 300 + j (< 100) once.
    answers = [i for i in range(300) for _ in range(3)] + [300 + j for j in range(100)]
    data = train.pack([train.Example(tokens=(1, 2, *answers), prompt_length=2)], 1002)
    coverage = train.answer_token_coverage(data, vocab_size=600)
    assert coverage[299] == pytest.approx(0.9) and coverage[399] == pytest.approx(1.0)
    assert train.draft_vocab_size_for(data, 600, 0.5) == 256  # 167 tokens, rounded up to 256
    assert train.draft_vocab_size_for(data, 600, 0.9) == 512  # 300 tokens
    assert train.draft_vocab_size_for(data, 600, 1.0) == 512  # 400 tokens
    assert train.draft_vocab_size_for(data, 300, 1.0) == 300  # never past the vocabulary
    # Measured on held-out answers: 150 tokens the ranking has (ids < 150) and 50 it has never
    # seen (ids 500-549, ranked after the 400 seen ids, by id). In-sample, 0.9 needs 300
    # ranked tokens; held out, 0.9 (180 tokens) needs 30 of the unseen ids, up to rank 530.
    held_answers = list(range(150)) + list(range(500, 550))
    held = train.pack([train.Example(tokens=(1, 2, *held_answers), prompt_length=2)], 1002)
    held_coverage = train.answer_token_coverage(data, 600, measured_on=held)
    assert held_coverage[149] == pytest.approx(0.75) and held_coverage[499] == pytest.approx(0.75)
    assert held_coverage[509] == pytest.approx(0.8) and held_coverage[549] == pytest.approx(1.0)
    assert train.draft_vocab_size_for(data, 600, 0.7, measured_on=held) == 256  # 140 tokens
    assert train.draft_vocab_size_for(data, 1000, 0.9, measured_on=held) == 768  # 530 tokens (in-sample 512)
    # The vocabulary is the ranking's head, so the coverage measured is the coverage drafted.
    for size in (256, 512, 530, 600):
        drafted = train.draft_vocab(data, 600, size).t2d[np.asarray(held_answers)].mean()
        assert drafted == pytest.approx(held_coverage[size - 1])
    with pytest.raises(jaxspec.InvalidRequestError, match="not both"):
        train.TrainConfig(draft_vocab_size=256, draft_vocab_coverage=0.9)
    with pytest.raises(jaxspec.InvalidRequestError, match="keep_init_vocab .* needs method eagle3 and init_from"):
        train.TrainConfig(keep_init_vocab=True)
    with pytest.raises(jaxspec.InvalidRequestError, match="draft_vocab_coverage must be in"):
        train.TrainConfig(draft_vocab_coverage=1.5)


def test_a_training_run_sizes_its_draft_vocabulary_on_the_validation_answers():
    """A run's head setup (train() passes it the validation rows) measures coverage on the
    validation answers (text the ranking never saw), not on the training rows, whose every
    token the ranking already holds; without answers to measure it falls back to those."""
    import dataclasses
    import types

    from train_fixtures import TOY

    from jaxspec.train.run import _head_setup

    target = types.SimpleNamespace(config=dataclasses.replace(TOY, vocab_size=1024))
    fit = train.pack([train.Example(tokens=(1, 2, *[i for i in range(300) for _ in range(3)]), prompt_length=2)], 1002)
    val = train.pack([train.Example(tokens=(1, 2, *range(150), *range(600, 680)), prompt_length=2)], 1002)
    cfg = train.TrainConfig(draft_vocab_coverage=0.9)
    # In-sample 0.9 is 270 of the 300 ids (512); on val it is 207 of 230 tokens: 57 of the
    # unseen ids, ranked 600-656 (768).
    assert len(_head_setup(target, fit, cfg)[2].target_ids) == 512
    assert len(_head_setup(target, fit, cfg, val)[2].target_ids) == 768
    no_answers = train.Dataset(val.tokens, val.prompt_lengths.copy(), val.prompt_lengths)  # prompts only
    assert len(_head_setup(target, fit, cfg, no_answers)[2].target_ids) == 512


def test_rows_the_data_holds_out_are_the_validation_rows(tmp_path):
    """A corpus's own split (by template and source) wins over the random one, and survives a save."""
    data = train.pack([train.Example(tokens=(1, 2, 3 + i), prompt_length=2) for i in range(6)], 4)
    held = np.asarray([0, 1, 0, 0, 1, 0], bool)
    marked = train.Dataset(data.tokens, data.lengths, data.prompt_lengths, held_out=held)
    train_rows, val_rows = train.split_rows(marked, 0.5, seed=0)
    assert train_rows.tolist() == [0, 2, 3, 5] and val_rows.tolist() == [1, 4]
    assert [r.tolist() for r in train.split_rows(data, 0.5, seed=0)] == [r.tolist() for r in train.split(6, 0.5, 0)]
    marked.save(tmp_path / "held.npz")
    assert train.Dataset.load(tmp_path / "held.npz").held_out.tolist() == held.tolist()
    with pytest.raises(jaxspec.InvalidRequestError, match="every row of the data is held out"):
        train.split_rows(train.Dataset(data.tokens, data.lengths, data.prompt_lengths, held_out=np.ones(6, bool)), 0, 0)


def test_the_in_run_tau_prompts_are_a_seeded_draw_of_the_held_out_rows():
    """train_head measures tau on held-out prompts drawn across the split, not its first rows: a
    corpus lists its held-out rows by source, so the first few would all be one source's."""
    # 40 rows, prompt (i, i + 100); rows 20-29 hold out one source, rows 30-39 another.
    data = train.pack([train.Example(tokens=(i, i + 100, 7), prompt_length=2) for i in range(40)], 4)
    held = np.arange(40) >= 20
    marked = train.Dataset(data.tokens, data.lengths, data.prompt_lengths, held_out=held)
    drawn = train.held_out_prompts(marked, 0.05, seed=0, count=8)
    firsts = [prompt[0] for prompt in drawn]
    assert len(drawn) == 8 and len(set(firsts)) == 8
    assert all(prompt == [i, i + 100] for prompt, i in zip(drawn, firsts))  # whole prompts, no answer token
    assert all(20 <= i < 40 for i in firsts)  # held-out rows only
    assert any(i < 30 for i in firsts) and any(i >= 30 for i in firsts)  # both sources
    assert drawn == train.held_out_prompts(marked, 0.05, seed=0, count=8)  # reproducible
    assert drawn != train.held_out_prompts(marked, 0.05, seed=1, count=8)
    assert sorted(p[0] for p in train.held_out_prompts(marked, 0.05, seed=0, count=99)) == list(range(20, 40))
    assert train.held_out_prompts(marked, 0.05, seed=0, count=0) == []


def test_rows_cut_after_their_prompts_keep_the_answers_opening():
    """cut_after_prompt (train-head --answer-window N): each row ends N tokens after its prompt,
    or where it ended; the tokens and the assistant mask past the cut are gone, the held-out flags
    kept; the cut rows find the same features as rows written that way (the cache's row key)."""
    tokens = np.asarray([[1, 2, 10, 11, 12, 13, 14, 0],
                         [1, 2, 3, 15, 4, 5, 16, 17],
                         [1, 2, 3, 4, 18, 0, 0, 0]], np.int32)
    assistant = np.zeros_like(tokens, bool)
    assistant[0, 2:7] = True
    assistant[1, [3, 6, 7]] = True  # a one-token answer, a user turn, a second answer
    assistant[2, 4] = True
    data = train.Dataset(tokens, np.asarray([7, 8, 5], np.int32), np.asarray([2, 3, 4], np.int32), assistant,
                         held_out=np.asarray([0, 1, 0], bool))
    cut = data.cut_after_prompt(3)
    assert cut.lengths.tolist() == [5, 6, 5] and cut.seq_len == 6
    np.testing.assert_array_equal(cut.tokens, [[1, 2, 10, 11, 12, 0], [1, 2, 3, 15, 4, 5], [1, 2, 3, 4, 18, 0]])
    np.testing.assert_array_equal(cut.assistant, [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0]])
    assert cut.held_out.tolist() == [False, True, False] and cut.prompt_lengths.tolist() == [2, 3, 4]
    written = train.Dataset(cut.tokens, cut.lengths, cut.prompt_lengths, cut.assistant)
    np.testing.assert_array_equal(train.features.row_keys(cut), train.features.row_keys(written))
    assert data.cut_after_prompt(99).fingerprint() == data.fingerprint()
    for bad in (0, -1, 2.5, True):
        with pytest.raises(jaxspec.InvalidRequestError, match="answer_tokens must be an integer >= 1"):
            data.cut_after_prompt(bad)


def test_several_data_files_train_as_one_in_order(tmp_path):
    """load_datasets (train-head --data A B ...): rows in file order, every array carried; a
    part without an assistant mask gets the one its prompt lengths imply; parts of another
    window, or held-out flags on some parts only, are refused by name."""
    first = train.pack([train.Example(tokens=(1, 2, 3 + i), prompt_length=2) for i in range(3)], 6)
    masked = train.Dataset(first.tokens[:2] + 10, first.lengths[:2], first.prompt_lengths[:2],
                           assistant=np.asarray([[0, 1, 0, 1, 0, 0], [0, 0, 1, 0, 0, 0]], bool))
    first.save(tmp_path / "a.npz")
    masked.save(tmp_path / "b.npz")
    both = train.load_datasets([tmp_path / "a.npz", tmp_path / "b.npz"])
    np.testing.assert_array_equal(both.tokens, np.concatenate([first.tokens, masked.tokens]))
    np.testing.assert_array_equal(both.lengths, [3, 3, 3, 3, 3])
    np.testing.assert_array_equal(both.assistant, np.concatenate([first.assistant_tokens(), masked.assistant]))
    assert both.held_out is None
    assert train.load_datasets([tmp_path / "b.npz", tmp_path / "a.npz"]).tokens[0].tolist() == masked.tokens[0].tolist()

    held = np.asarray([1, 0, 0], bool)
    flagged = train.Dataset(first.tokens, first.lengths, first.prompt_lengths, held_out=held)
    joined = train.concatenate_datasets([flagged, flagged])
    assert joined.held_out.tolist() == held.tolist() * 2 and joined.assistant is None
    with pytest.raises(jaxspec.InvalidRequestError, match="held-out flags are on some"):
        train.concatenate_datasets([flagged, first])
    wider = train.pack([train.Example(tokens=(1, 2, 3), prompt_length=2)], 8)
    with pytest.raises(jaxspec.InvalidRequestError, match=r"different windows.*\[6, 8\]"):
        train.concatenate_datasets([first, wider])
    with pytest.raises(jaxspec.CheckpointError, match="not a readable training data file"):
        train.load_datasets([tmp_path / "a.npz", tmp_path / "missing.npz"])


def test_batch_order_depends_only_on_seed_and_step():
    first = [train.batch_indices(3, step, 4, 10).tolist() for step in range(5)]
    assert first == [train.batch_indices(3, step, 4, 10).tolist() for step in range(5)]
    epoch = sorted(first[0] + first[1] + first[2][:2])  # 10 rows: one epoch covers each once
    assert epoch == list(range(10))
    assert first != [train.batch_indices(4, step, 4, 10).tolist() for step in range(5)]


def test_draft_vocab_picks_the_most_frequent_answer_tokens():
    # Answers (after the 2-token prompts): 7 x3, 2 x2, 9 x1; prompt tokens 4 x2, 5 x1.
    data = train.pack([train.Example(tokens=(4, 5, 7, 7, 2, 9), prompt_length=2),
                       train.Example(tokens=(4, 4, 7, 2), prompt_length=2)], 8)
    vocab = train.draft_vocab(data, vocab_size=12, draft_vocab_size=4)
    # 7, 2, 9 from the answers, then 4 (the commonest prompt token); ascending target ids.
    np.testing.assert_array_equal(vocab.target_ids, [2, 4, 7, 9])
    np.testing.assert_array_equal(vocab.d2t, [2, 3, 5, 6])
    np.testing.assert_array_equal(np.flatnonzero(vocab.t2d), [2, 4, 7, 9])
    np.testing.assert_array_equal(vocab.target_to_draft[[2, 4, 7, 9, 0, 5]], [0, 1, 2, 3, -1, -1])
    d2t = jnp.asarray(vocab.d2t, jnp.int32)
    head = eagle3.params_from(lambda name: d2t if name == "d2t" else None)  # the map reads d2t alone
    mapped = eagle3.to_target_ids(head, jnp.arange(4))
    np.testing.assert_array_equal(mapped, vocab.target_ids)
    # More draft slots than seen tokens: the lowest unused ids fill in.
    np.testing.assert_array_equal(train.draft_vocab(data, 12, 7).target_ids, [0, 1, 2, 4, 5, 7, 9])
    with pytest.raises(jaxspec.InvalidRequestError, match="draft_vocab_size must be an integer in"):
        train.draft_vocab(data, 12, 13)


def test_read_prompts_jsonl(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "hello"}\n\n{"text": "world", "id": 3}\n{"prompt": [5, 6, 7]}\n')
    assert train.read_prompts_jsonl(good) == ["hello", "world", [5, 6, 7]]
    cases = [('{"prompt": "a"}\n{"prompt": "b",}\n', r"bad.jsonl:2: not valid JSON"),
             ('{"prompt": "a"}\n["b"]\n', r"bad.jsonl:2: expected a JSON object"),
             ('{"question": "a"}\n', r'bad.jsonl:1: the object has no "prompt" or "text" field'),
             ('{"prompt": "  "}\n', r"bad.jsonl:1: .* must be a non-empty string"),
             ('\n\n', r"holds no prompts")]
    for content, message in cases:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(content)
        with pytest.raises(jaxspec.InvalidRequestError, match=message):
            train.read_prompts_jsonl(bad)
    with pytest.raises(jaxspec.InvalidRequestError, match="prompt file not found"):
        train.read_prompts_jsonl(tmp_path / "missing.jsonl")


def test_self_instruct_needs_a_tokenizer(toy):
    target, _, _, _ = toy
    with pytest.raises(jaxspec.InvalidRequestError, match="needs a tokenizer"):
        train.self_instruct_examples(target, 4, 0)


def test_a_kept_vocabulary_comes_first_then_the_data_ranking_fills_it():
    """`first` (a start head's tokens, keep_init_vocab): those ids lead the ranking, in the data's
    order among themselves, whatever the data thinks of them; the rest follow in the data's order;
    a size by coverage counts their tokens and never drops one of them."""
    # 1000 answer tokens over 600 ids: id i (< 300) appears 3 times, id 300 + j (< 100) once.
    answers = [i for i in range(300) for _ in range(3)] + [300 + j for j in range(100)]
    data = train.pack([train.Example(tokens=(1, 2, *answers), prompt_length=2)], 1002)
    kept = np.asarray([599, 350, 5, 598])  # two ids no answer uses, one rare, one common
    ranking = train.draft_token_ranking(data, 600, first=kept)
    assert ranking[:4].tolist() == [5, 350, 598, 599]  # by count, then by id (598, 599 unused)
    plain = train.draft_token_ranking(data, 600)
    np.testing.assert_array_equal(ranking[4:], plain[~np.isin(plain, kept)])
    vocab = train.draft_vocab(data, 600, 10, first=kept)
    assert vocab.target_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 350, 598, 599]  # kept + the top 6 others
    assert vocab.t2d[kept].all() and vocab.t2d.sum() == 10
    # Coverage: 0.5 of the answers takes 167 ranked tokens without `first`; with it the kept ids
    # count their 4 answers (5 three times, 350 once) and the data fills the rest, in 256s.
    coverage = train.answer_token_coverage(data, 600, first=kept)
    assert coverage[3] == pytest.approx(0.004)
    assert train.draft_vocab_size_for(data, 600, 0.5, first=kept) == 256
    # A kept vocabulary larger than the coverage asks for is kept whole.
    many = np.arange(300, 600)  # 300 ids: the 100 rare ones and 200 unused
    assert train.draft_vocab_size_for(data, 600, 0.05, first=many) == 512  # >= 300, rounded up
    assert train.draft_vocab_size_for(data, 600, 0.05, first=many[:0]) == 256  # none kept: the plain size
    with pytest.raises(jaxspec.InvalidRequestError, match="ids to rank first"):
        train.draft_token_ranking(data, 600, first=np.asarray([600]))


def test_lookup_predicted_marks_what_a_prompt_lookup_of_the_row_would_propose():
    """Token t is marked when the token after the last earlier occurrence of its n preceding
    tokens is t itself; the first occurrence of a context, and a context whose last follower
    differs, are not."""
    row = [5, 1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 4]
    tokens = np.zeros((2, 16), np.int32)
    tokens[0, : len(row)] = row
    tokens[1, :4] = [1, 2, 1, 2]
    data = train.Dataset(tokens, np.asarray([len(row), 4], np.int32), np.asarray([1, 1], np.int32))
    marked = train.lookup_predicted(data, n=2)
    # row 0: (1, 2) -> 3 at t=3 is new; t=4: (2, 3) -> 1 new; t=5: (3, 1) -> 2 new; t=6: (1, 2) last
    # followed by 3: yes; t=7: (2, 3) -> 1 yes; t=8: (3, 1) -> 2 yes; t=9: (1, 2) -> 3 but 4: no;
    # t=10: (2, 4) new; t=11: (4, 1) new; t=12: (1, 2) last followed by 4: yes. Padding: never.
    assert np.flatnonzero(marked[0]).tolist() == [6, 7, 8, 12]
    assert not marked[1].any()  # t=2: (1, 2) seen for the first time; t=3: (2, 1) too
    assert np.flatnonzero(train.lookup_predicted(data, n=1)[1]).tolist() == [3]  # (1,) was followed by 2
    with pytest.raises(jaxspec.InvalidRequestError, match="n must be an integer >= 1"):
        train.lookup_predicted(data, n=0)


def test_answer_positions_count_within_each_assistant_turn():
    tokens = np.arange(10, dtype=np.int32)[None, :]
    assistant = np.asarray([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0]], bool)  # two turns, then padding
    data = train.Dataset(tokens, np.asarray([9], np.int32), np.asarray([2], np.int32), assistant)
    assert train.answer_positions(data).tolist() == [[-1, -1, 0, 1, 2, -1, -1, 0, 1, -1]]
    single = train.Dataset(tokens, np.asarray([6], np.int32), np.asarray([3], np.int32))
    assert train.answer_positions(single).tolist() == [[-1, -1, -1, 0, 1, 2, -1, -1, -1, -1]]


def test_a_batchs_lookup_mask_is_aligned_with_its_loss_mask():
    """`next_is_lookup_predicted(rows, width)[b, t]` is `lookup_predicted` of token t + 1, as the
    loss mask at t is about token t + 1; nothing past a row's end, nothing for an empty row."""
    tokens = np.random.default_rng(0).integers(0, 3, (3, 12)).astype(np.int32)
    tokens[2] = [0, 1, 2] * 4  # a loop: every token from t = 4 on is what the lookup proposes
    data = train.Dataset(tokens, np.asarray([12, 7, 9], np.int32), np.asarray([2, 2, 3], np.int32))
    whole = train.lookup_predicted(data, n=2)
    batch = data.next_is_lookup_predicted(np.asarray([2, -1, 1]), 12, n=2)
    np.testing.assert_array_equal(batch[0, :8], whole[2, 1:9])
    assert not batch[0, 8:].any() and not batch[1].any()
    np.testing.assert_array_equal(batch[2, :6], whole[1, 1:7])
    assert whole[2, 1:9].any() and not batch[2, 6:].any()


def test_a_batchs_answer_positions_are_aligned_with_its_loss_mask():
    tokens = np.arange(10, dtype=np.int32)[None, :].repeat(2, axis=0)
    assistant = np.asarray([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0]] * 2, bool)
    data = train.Dataset(tokens, np.asarray([9, 9], np.int32), np.asarray([2, 2], np.int32), assistant)
    # Position t holds the answer index of token t + 1: token 2 opens the first turn, token 7 the second.
    assert data.next_answer_positions(np.asarray([1, -1]), 9).tolist() == [[-1, 0, 1, 2, -1, -1, 0, 1, -1],
                                                                            [-1] * 9]
