"""Grammar automata (jaxspec.grammar) against outlines-core's own Index, on tiny tokenizers and SmolLM2.

The oracle is outlines-core's `Index` built over the same vocabulary bytes: walking our table with
`advance` must allow exactly what `get_allowed_tokens` allows (EOS ids only in final states, into
DONE) and land where `get_next_state` lands. Dense and sparse layouts must agree on every
(state, token) of the table. Strings that match (python `re`, hypothesis `from_regex`, json.dumps
of valid objects) must walk to a final state; strings that do not must hit DEAD or stop short.
"""

from __future__ import annotations

import json
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import outlines_core
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers

from jaxspec import grammar as G
from jaxspec.errors import InvalidRequestError
from jaxspec.grammar import DEAD, DONE, FREE, GrammarError, build_table, compile_grammar
from jaxspec.tokenizer import Tokenizer
from tests.conftest import requires_default_model

LAYOUTS = ("dense", "classes", "sparse")
CHATML = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


# --- tiny tokenizers -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    """GGUF-style byte-level BPE: 3 control tokens, the 256 byte symbols, a few merges. EOS ids are
    <|endoftext|> (0) and <|im_end|> (2, written by the chat template)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ Ġ", "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "y e", "ye s", "n o", "1 2", "\" :"]
    tokens = specials + alphabet + [m.replace(" ", "") for m in merges]
    return Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * 3 + [1] * (len(tokens) - 3), "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": 0, "tokenizer.chat_template": CHATML,
    })


@pytest.fixture(scope="module")
def sentencepiece() -> Tokenizer:
    """A Llama-2-style tokenizer.json: "▁" for spaces, <0xNN> byte fallback, decoders
    Sequence[Replace("▁", " "), ByteFallback, Fuse, Strip] (what jaxspec.spm builds)."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "a", "b", "c", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "ll", "he", "hell", "hello",
               "▁hello", "or", "wor", "▁wor", "▁world", "ld", "▁a", "ab"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    merges = [("▁", "h"), ("▁", "w"), ("l", "l"), ("h", "e"), ("he", "ll"), ("hell", "o"), ("▁h", "ello"),
              ("o", "r"), ("w", "or"), ("▁", "wor"), ("l", "d"), ("▁wor", "ld"), ("▁", "a"), ("a", "b")]
    merges = [(a, b) for a, b in merges if a in vocab and b in vocab and a + b in vocab]
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", split=False, prepend_scheme="first")
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(content=" ", left=1, right=0)])
    hf.add_special_tokens([tokenizers.AddedToken(p, special=True, normalized=False) for p in pieces[:3]])
    return Tokenizer(hf, bos_token_id=1, eos_token_id=2, unk_token_id=0)


# --- helpers -------------------------------------------------------------------------------------


def outlines_index(tokenizer: Tokenizer, grammar: G.Grammar) -> outlines_core.Index:
    """outlines-core's own Index for the grammar's regex over the tokenizer's ordinary tokens (without
    jaxspec.grammar's end marker, so it shows outlines-core 0.2.14's missing transitions)."""
    pieces, special = G.token_bytes(tokenizer)
    eos = grammar.eos_token_ids
    by_bytes: dict[bytes, list[int]] = {}
    for token_id, piece in enumerate(pieces[: grammar.vocab_size]):
        if piece and token_id not in special and token_id not in eos:
            by_bytes.setdefault(piece, []).append(token_id)
    return outlines_core.Index(grammar.regex, outlines_core.Vocabulary(eos[0], by_bytes))


class PrefixOracle:
    """Independent of outlines-core: a token is allowed after the text so far when text + token is
    a prefix of some match (the `regex` module's partial matching, on bytes); final when it matches.
    Exact for vocabularies that spell every byte (the tiny byte-level one)."""

    def __init__(self, tokenizer: Tokenizer, pattern: bytes, vocab_size: int):
        import regex

        self.pattern = regex.compile(pattern)
        pieces, special = G.token_bytes(tokenizer)
        self.pieces = [None if i in special else piece for i, piece in enumerate(pieces[:vocab_size])]

    def allowed(self, text: bytes) -> set[int]:
        return {i for i, piece in enumerate(self.pieces)
                if piece and self.pattern.fullmatch(text + piece, partial=True)}

    def final(self, text: bytes) -> bool:
        return bool(self.pattern.fullmatch(text))


@jax.jit
def _query(table, states, tokens):
    return table.allowed(states), table.advance(states, tokens), table.ended(states)


def query(table, state: int, token: int = 0) -> tuple[np.ndarray, int, bool]:
    """(allowed [V], advance(state, token), ended) of one state."""
    allowed, nxt, ended = _query(table, jnp.asarray([state], jnp.int32), jnp.asarray([token], jnp.int32))
    return np.asarray(allowed[0]), int(nxt[0]), bool(ended[0])


def full_table(table: G.GrammarTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """allowed [Q, V], advance [Q, V] and ended [Q] for every (state, token) of the table."""
    q, v = table.num_states, table.vocab_size
    states = jnp.arange(q, dtype=jnp.int32)  # [Q]
    allowed, _, ended = _query(table, states, states)
    grid = jnp.broadcast_to(states[:, None], (q, v)), jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), (q, v))
    nxt = jax.jit(lambda t, s, x: t.advance(s, x))(table, *grid)  # [Q, V]
    return np.asarray(allowed), np.asarray(nxt), np.asarray(ended)


def assert_layouts_agree(grammars, vocab_size):
    """Every layout: same initial states and the same allowed/advance/ended on every (state, token)
    as the dense table (the reference: one entry per state and token)."""
    built = [build_table(grammars, vocab_size, layout=lay) for lay in LAYOUTS]
    assert tuple(table.layout for table, _ in built) == LAYOUTS
    (dense, init_d), others = built[0], built[1:]
    reference = full_table(dense)
    for table, initial in others:
        np.testing.assert_array_equal(initial, init_d)
        for a, b in zip(full_table(table), reference):
            np.testing.assert_array_equal(a, b)
    return dense, others[-1][0], init_d


def walk(table, start: int, tokens) -> tuple[list[int], list[np.ndarray]]:
    """The states visited feeding `tokens` from `start` (first = start), and the allowed mask at each."""
    states, masks = [start], []
    for token in tokens:
        allowed, nxt, _ = query(table, states[-1], token)
        masks.append(allowed)
        states.append(nxt)
    return states, masks


def accepts(table, start: int, token_ids, eos: int) -> bool:
    """Whether the walk along `token_ids` never meets a forbidden token and ends in a final state
    (where `eos` is allowed and leads to DONE)."""
    states, masks = walk(table, start, token_ids)
    if DEAD in states:
        return False
    assert all(mask[token] for mask, token in zip(masks, token_ids))
    allowed, nxt, _ = query(table, states[-1], eos)
    assert allowed[eos] == (nxt == DONE)
    return bool(allowed[eos])


def check_against_prefix_oracle(tokenizer, grammar, table, start, pattern: bytes, walks=6, steps=25, seed=0):
    """Random walks: our allowed set, EOS, ended and DEAD agree with PrefixOracle at every step."""
    reference = PrefixOracle(tokenizer, pattern, grammar.vocab_size)
    eos = set(grammar.eos_token_ids)
    rng = random.Random(seed)
    for _ in range(walks):
        state, text = start, b""
        for _ in range(steps):
            allowed, _, ended = query(table, state)
            expected, final = reference.allowed(text), reference.final(text)
            assert set(np.flatnonzero(allowed).tolist()) - eos == expected, text
            assert all(allowed[e] == final for e in eos)  # every EOS id, exactly in final states
            assert ended == (final and not expected)
            assert query(table, state, int(rng.choice(np.flatnonzero(~allowed))))[1] == DEAD
            choice = rng.choice(sorted(expected | (eos if final else set())))
            state = query(table, state, choice)[1]
            if choice in eos:
                assert state == DONE and query(table, state)[2]
                break
            text += reference.pieces[choice]


def check_against_outlines(tokenizer, grammar, table, start, walks=3, steps=30, seed=0, exact=True):
    """Random walks along tokens outlines-core allows: at every step we allow what its Index allows
    (`exact`: nothing more; its 0.2.14 Index misses tokens out of states where the regex could end,
    see jaxspec.grammar.END), EOS exactly in its final states, and ended where it allows only EOS."""
    index = outlines_index(tokenizer, grammar)
    eos = set(grammar.eos_token_ids)
    rng = random.Random(seed)
    for _ in range(walks):
        ours, theirs = start, index.get_initial_state()
        for _ in range(steps):
            allowed, _, ended = query(table, ours)
            expected = set(index.get_allowed_tokens(theirs)) - eos
            final = index.is_final_state(theirs)
            mine = set(np.flatnonzero(allowed).tolist()) - eos
            assert mine == expected if exact else mine >= expected
            assert all(allowed[e] == final for e in eos)
            if exact:
                assert ended == (final and not expected)
            assert query(table, ours, int(rng.choice(np.flatnonzero(~allowed))))[1] == DEAD
            choice = rng.choice(sorted(expected | (eos if final else set())))
            ours = query(table, ours, choice)[1]
            if choice in eos:
                assert ours == DONE and query(table, ours)[2]
                break
            theirs = index.get_next_state(theirs, choice)


def single(grammar, layout="auto") -> tuple[G.GrammarTable, int]:
    table, initial = build_table([grammar], grammar.vocab_size, layout=layout)
    return table, int(initial[0])


# --- tiny tokenizers: oracle, layouts, matching strings ------------------------------------------


REGEXES = [r"(yes|no)", r"[a-z]{1,6}( [a-z]{1,6}){0,3}", r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
           r"\{\"[a-z]{1,4}\":(true|false|[0-9]{1,2})\}", r"h(e|a)l+o*"]


@pytest.mark.parametrize("regex", REGEXES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_byte_level_walks_agree_with_the_oracles(byte_level, regex, layout):
    grammar = compile_grammar(byte_level, byte_level.vocab_size, regex=regex)
    table, start = single(grammar, layout)
    assert table.layout == layout
    check_against_prefix_oracle(byte_level, grammar, table, start, regex.encode(), walks=4)
    check_against_outlines(byte_level, grammar, table, start, exact=regex == "(yes|no)")


def test_outlines_core_misses_tokens_after_a_possible_end(byte_level):
    """The outlines-core 0.2.14 bug the end marker works around: "." after "0" in "0(\\.[0-9])?"."""
    grammar = compile_grammar(byte_level, byte_level.vocab_size, regex=r"0(\.[0-9])?")
    index = outlines_index(byte_level, grammar)
    zero, dot = byte_level.encode("0.")
    assert dot not in index.get_allowed_tokens(index.get_next_state(index.get_initial_state(), zero))
    table, start = single(grammar)
    assert accepts(table, start, byte_level.encode("0.5"), 0) and accepts(table, start, [zero], 0)


def test_both_layouts_agree_on_every_state_and_token(byte_level, sentencepiece):
    grammars = [compile_grammar(byte_level, byte_level.vocab_size, regex=r) for r in REGEXES]
    assert_layouts_agree([grammars[0], None, *grammars[1:]], byte_level.vocab_size)
    assert_layouts_agree([compile_grammar(sentencepiece, sentencepiece.vocab_size, regex=r"(hello|a) world!?")],
                         sentencepiece.vocab_size)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_strings_matching_the_regex_walk_to_a_final_state(byte_level, data):
    regex = data.draw(st.sampled_from(REGEXES[1:]))
    grammar = compile_grammar(byte_level, byte_level.vocab_size, regex=regex)
    table, start = single(grammar)
    text = data.draw(st.from_regex(regex, fullmatch=True, alphabet=st.characters(codec="ascii")))
    assert accepts(table, start, byte_level.encode(text), 0)
    # An arbitrary string is accepted exactly when Python's re agrees that it matches.
    other = data.draw(st.text(alphabet="abz {}\":01-.9truefalsyh", max_size=12))
    assert accepts(table, start, byte_level.encode(other), 0) == bool(re.fullmatch(regex, other)), other


def test_a_non_matching_string_hits_dead(byte_level):
    table, start = single(compile_grammar(byte_level, byte_level.vocab_size, regex=r"[0-9]+"))
    ids = byte_level.encode("12a3")
    states, masks = walk(table, start, ids)
    assert [byte_level.decode([i]) for i in ids] == ["12", "a", "3"]
    assert states[1] not in (DEAD, FREE) and not masks[1][ids[1]]
    assert states[2:] == [DEAD, DEAD]  # "a" is forbidden, and DEAD stays DEAD (allowing everything)
    assert masks[2].all()
    assert DEAD == walk(table, DEAD, byte_level.encode("x"))[0][-1]


def test_sentencepiece_spaces_and_byte_fallback(sentencepiece):
    # A text's first piece carries sentencepiece's dummy-prefix "▁": a token's bytes are " hello"
    # ("▁" is a space) wherever it stands, as in outlines-core's own vocabularies.
    grammar = compile_grammar(sentencepiece, sentencepiece.vocab_size, regex=r" hello world(é|!)")
    table, start = single(grammar)
    check_against_outlines(sentencepiece, grammar, table, start, walks=6)
    hf = sentencepiece.hf_tokenizer
    for text in ["hello world!", "hello worldé"]:  # "▁w" is " w"; é is <0xC3><0xA9>
        encoding = hf.encode(text, add_special_tokens=False)
        assert accepts(table, start, encoding.ids, 2), encoding.tokens
    assert "▁w" in hf.encode("hello world!").tokens and "<0xC3>" in hf.encode("worldé").tokens
    assert not accepts(table, start, hf.encode("hello  world!").ids, 2)
    assert G.token_bytes(sentencepiece)[0][hf.token_to_id("▁hello")] == b" hello"


def test_token_bytes_of_byte_level_tokens(byte_level):
    pieces, special = G.token_bytes(byte_level)
    hf = byte_level.hf_tokenizer
    assert special == {0, 1, 2}
    assert pieces[hf.token_to_id("Ġwor")] == b" wor"
    assert sorted(pieces[3:259]) == [bytes([b]) for b in range(256)]  # the alphabet spells every byte


def test_special_tokens_are_never_allowed_and_eos_only_when_final(byte_level):
    grammar = compile_grammar(byte_level, byte_level.vocab_size, choices=["yes", "no"])
    table, start = single(grammar, "dense")
    assert grammar.eos_token_ids == (0, 2)
    states, masks = walk(table, start, byte_level.encode("yes"))
    assert not any(mask[[0, 1, 2]].any() for mask in masks)  # no EOS before the choice is complete
    allowed = np.asarray(table.allowed(jnp.int32(states[-1])))
    assert np.flatnonzero(allowed).tolist() == [0, 2]  # <|im_start|> never; both EOS ids
    for eos in (0, 2):
        assert int(table.advance(jnp.int32(states[-1]), jnp.int32(eos))) == DONE


def test_ids_past_the_tokenizer_are_never_allowed(byte_level):
    vocab_size = byte_level.vocab_size + 13  # the model's embedding is padded past the tokenizer
    grammar = compile_grammar(byte_level, vocab_size, regex=r"[a-z]+")
    for layout in LAYOUTS:
        table, initial = build_table([grammar, None], vocab_size, layout=layout)
        allowed = np.asarray(table.allowed(jnp.asarray(initial)))  # [2, V]
        assert allowed.shape == (2, vocab_size)
        assert not allowed[0, byte_level.vocab_size:].any() and allowed[1].all()
        assert int(table.advance(jnp.int32(initial[0]), jnp.int32(vocab_size - 1))) == DEAD


# --- choices -------------------------------------------------------------------------------------


CHOICES = ["yes", "yesterday", "a.b", "x*", "(paren) [b]", "{1,2}", "tab\there", "line\nnext", "back\\slash",
           "a|b", "^$", "#-&~", "café", "日本語", "😀 ok", "  spaced  ", "?+"]


def test_choices_accept_exactly_themselves(byte_level):
    grammar = compile_grammar(byte_level, byte_level.vocab_size, choices=CHOICES)
    table, start = single(grammar)
    # the oracle's alternation is escaped by Python's re, ours for Rust's regex syntax
    pattern = b"(?:" + b"|".join(re.escape(c.encode()) for c in CHOICES) + b")"
    check_against_prefix_oracle(byte_level, grammar, table, start, pattern, walks=12)
    for choice in CHOICES:
        assert accepts(table, start, byte_level.encode(choice), 0), choice
    for other in ["ye", "yesterda", "axb", "xx", "x", "a", "b", "(paren) [b", "1", "tab here", "back\\\\slash",
                  "yes ", "cafe", "日本", "", "#-&", "a.bx"]:
        assert not accepts(table, start, byte_level.encode(other), 0), other


def test_ended_after_a_full_choice(byte_level):
    grammar = compile_grammar(byte_level, byte_level.vocab_size, choices=["red", "green", "yes", "yesterday"])
    for layout in LAYOUTS:
        table, start = single(grammar, layout)
        def ended(state, table=table):
            return bool(table.ended(jnp.int32(state)))

        red = walk(table, start, byte_level.encode("red"))[0]
        assert [ended(s) for s in red] == [False, False, False, True]  # only EOS can follow "red"
        yes = walk(table, start, byte_level.encode("yes"))[0][-1]
        assert not ended(yes)  # final, but "terday" may follow
        assert ended(walk(table, start, byte_level.encode("yesterday"))[0][-1])
        assert not ended(FREE) and not ended(DEAD) and ended(DONE)
        # [B, T] queries, as the loop makes them
        states = jnp.asarray([[FREE, DEAD, DONE, red[-1]], [start, yes, red[1], DEAD]], jnp.int32)
        assert jax.jit(lambda t, s: t.ended(s))(table, states).tolist() == [[False, False, True, True],
                                                                          [False, False, False, False]]
        assert jax.jit(lambda t, s: t.allowed(s))(table, states).shape == (2, 4, byte_level.vocab_size)
        assert jax.jit(lambda t, s: t.advance(s, s))(table, states).shape == (2, 4)


# --- merged tables -------------------------------------------------------------------------------


def test_merged_table_rows_walk_as_their_own_tables(byte_level):
    v = byte_level.vocab_size
    digits = compile_grammar(byte_level, v, regex=r"[0-9]{1,4}")
    words = compile_grammar(byte_level, v, regex=r"hel+o( world)?")
    for layout in LAYOUTS:
        merged, initial = build_table([digits, None, words, digits], v, layout=layout)
        assert initial[1] == FREE and initial[0] == initial[3] != initial[2]
        # digits stored once (then padded to the bucket)
        assert merged.num_states == G.table._bucket(3 + digits.num_states + words.num_states)
        for row, grammar, text in [(0, digits, "1234"), (0, digits, "12a"), (2, words, "hello world"),
                                   (2, words, "hellp"), (1, None, "anything")]:
            ids = byte_level.encode(text)
            states, masks = walk(merged, int(initial[row]), ids)
            if grammar is None:
                assert states == [FREE] * (len(ids) + 1) and all(m.all() for m in masks)
                continue
            own, own_start = single(grammar, layout)
            own_states, own_masks = walk(own, own_start, ids)
            def local(s, first):  # reserved states are shared, the rest offset by the row's first state
                return s if s < 3 else s - first

            assert [local(s, initial[row]) for s in states] == [local(s, own_start) for s in own_states]
            for a, b in zip(masks, own_masks):
                np.testing.assert_array_equal(a, b)


def test_table_sizes_and_layout_choice(byte_level):
    grammar = compile_grammar(byte_level, byte_level.vocab_size, regex=r"[a-z]{1,3}")
    dense, _ = build_table([grammar], byte_level.vocab_size, layout="dense")
    sparse, _ = build_table([grammar], byte_level.vocab_size, layout="sparse")
    assert dense.next.dtype == jnp.int16 and dense.next.shape == (dense.num_states, byte_level.vocab_size)
    assert sparse.mask.shape == (sparse.num_states, -(-byte_level.vocab_size // 32))
    assert dense.nbytes == dense.next.nbytes + dense.num_states  # + ended bool[Q]
    classes, _ = build_table([grammar], byte_level.vocab_size, layout="classes")
    # [a-z]{1,3}: the 26 letters act alike, as do all other ordinary tokens, and EOS: few classes.
    assert classes.next.shape == (classes.num_states, 16) and classes.token_class.shape == (byte_level.vocab_size,)
    assert classes.nbytes == classes.next.nbytes + classes.token_class.nbytes + classes.num_states
    auto = build_table([grammar], byte_level.vocab_size)[0]  # the smallest
    assert auto.layout == "classes" and auto.nbytes == min(dense.nbytes, classes.nbytes)
    unconstrained, initial = build_table([None, None], byte_level.vocab_size)
    assert initial.tolist() == [FREE, FREE] and initial.dtype == np.int32
    assert unconstrained.num_states == 16  # reserved + padding


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "problem"), [
    ({}, "exactly one of regex, json_schema, choices; got none"),
    ({"regex": "a", "choices": ["a"]}, "got regex, choices"),
    ({"regex": "(ab"}, "invalid regex"),
    ({"regex": "[z-a]"}, "invalid regex"),
    ({"regex": "a)(b"}, "invalid regex"),  # not hidden by the group the end marker adds
    ({"regex": "^[0-9]+$"}, None),  # anchors are redundant (matches are whole) but accepted
    ({"regex": 3}, "regex must be a str"),
    ({"regex": ""}, "regex is empty"),
    ({"regex": "a|"}, None),  # the empty alternative is fine: "a" is still a path
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": "[1, 2]"}, "json_schema must be a JSON object, got a JSON list"),
    ({"json_schema": {"type": "nonsense"}}, "json_schema cannot be compiled: Unsupported type: nonsense"),
    ({"json_schema": 12}, "json_schema must be JSON text or a dict"),
    ({"choices": []}, "choices is empty"),
    ({"choices": "yes"}, "choices must be a list of strings"),
    ({"choices": ["a", 1]}, "choices[1] is a int, not a str"),
    ({"choices": ["a", ""]}, "choices[1] is an empty string"),
    ({"choices": ["a\ud800"]}, "lone surrogate"),
])
def test_request_errors_name_the_problem(byte_level, kwargs, problem):
    if problem is None:
        compile_grammar(byte_level, byte_level.vocab_size, **kwargs)
        return
    with pytest.raises(InvalidRequestError) as info:
        compile_grammar(byte_level, byte_level.vocab_size, **kwargs)
    assert problem in str(info.value) and "\n" not in str(info.value)


def test_grammars_without_a_path_through_the_vocabulary(sentencepiece):
    # With byte fallback every byte is spelled; a model vocab_size cut below the byte pieces is not:
    # ids 0..3 are <unk>, <s>, </s> (EOS) and <0x00>.
    with pytest.raises(GrammarError, match="regex has no path through the vocabulary"):
        compile_grammar(sentencepiece, 4, regex="q")  # no token starts a match
    with pytest.raises(GrammarError, match="regex has no path through the vocabulary"):
        compile_grammar(sentencepiece, 4, regex="\x00q")  # a first token, but no final state after it
    with pytest.raises(GrammarError, match="choices has no path through the vocabulary"):
        compile_grammar(sentencepiece, 4, choices=["q"])


def test_dead_end_states_are_pruned(byte_level):
    # With ids below "z" only, "q" can never be followed by "z": the "qz" branch is cut (outlines-core
    # alone refuses the whole regex), the "a" branch stays.
    token = byte_level.hf_tokenizer.token_to_id
    grammar = compile_grammar(byte_level, token("z"), regex="(qz|a)")
    table, start = single(grammar)
    allowed = query(table, start)[0]
    assert not allowed[token("q")] and allowed[token("a")] and allowed.sum() == 1
    with pytest.raises(ValueError, match="incompatible"):
        outlines_index(byte_level, grammar)
    with pytest.raises(GrammarError, match="regex has no path through the vocabulary"):
        compile_grammar(byte_level, token("z"), regex="qz")


def test_unsupported_tokenizers_and_arguments(byte_level):
    wordpiece = tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    with pytest.raises(GrammarError, match="decoder 'WordPiece' is not supported"):
        compile_grammar(Tokenizer(wordpiece, eos_token_id=0), 3, regex="a")
    bare = tokenizers.Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    with pytest.raises(GrammarError, match="has none"):
        compile_grammar(Tokenizer(bare, eos_token_id=0), 2, regex="a")
    no_eos = tokenizers.Tokenizer(models.BPE({"a": 0, "b": 1}, []))
    no_eos.decoder = decoders.ByteLevel()
    with pytest.raises(GrammarError, match="needs an EOS token"):
        compile_grammar(Tokenizer(no_eos), 2, regex="a")
    with pytest.raises(GrammarError, match="needs a jaxspec Tokenizer"):
        compile_grammar(byte_level.hf_tokenizer, 10, regex="a")
    with pytest.raises(GrammarError, match="vocab_size must be a positive integer"):
        compile_grammar(byte_level, 0, regex="a")
    grammar = compile_grammar(byte_level, byte_level.vocab_size, regex="a")
    with pytest.raises(GrammarError, match="compiled for vocab_size"):
        build_table([grammar], byte_level.vocab_size + 1)
    with pytest.raises(GrammarError, match="layout must be one of"):
        build_table([grammar], byte_level.vocab_size, layout="csr")
    with pytest.raises(GrammarError, match=r"grammars\[0\] is a str"):
        build_table(["a"], byte_level.vocab_size)


def test_compile_is_cached(byte_level):
    v = byte_level.vocab_size
    a = compile_grammar(byte_level, v, json_schema={"type": "object", "properties": {"k": {"type": "integer"}}})
    b = compile_grammar(byte_level, v, json_schema='{"type": "object", "properties": {"k": {"type": "integer"}}}')
    assert a is b and a.kind == "json_schema"
    assert compile_grammar(byte_level, v, choices=["x", "y"]) is compile_grammar(byte_level, v, choices=["x", "y"])
    assert compile_grammar(byte_level, v, choices=["x", "y"]) is not compile_grammar(byte_level, v, regex="(?:x|y)")


# --- the real SmolLM2 vocabulary ---------------------------------------------------------------


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b c", "dé"]}}, "ok": {"type": "boolean"}},
    "required": ["name", "age"]}


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    import jaxspec

    return jaxspec.load().tokenizer


@requires_default_model
@pytest.mark.real_model
def test_smollm2_token_bytes_decode_like_the_tokenizer(smollm2):
    pieces, special = G.token_bytes(smollm2)
    texts = smollm2.hf_tokenizer.decode_batch([[i] for i in range(len(pieces))], skip_special_tokens=False)
    checked = 0
    for token_id, (piece, text) in enumerate(zip(pieces, texts)):
        if token_id not in special and piece.decode("utf-8", "replace") == piece.decode("utf-8", "ignore"):
            assert piece.decode("utf-8") == text, token_id
            checked += 1
    assert checked > 45000 and 0 in special and smollm2.eos_token_ids == (2,)


@requires_default_model
@pytest.mark.real_model
def test_smollm2_json_schema(smollm2):
    v = smollm2.vocab_size
    grammar = compile_grammar(smollm2, v, json_schema=SCHEMA)
    dense, sparse, initial = assert_layouts_agree([grammar], v)
    assert dense.nbytes > 4 * sparse.nbytes  # the string states are one bitmask row each in sparse
    start = int(initial[0])
    # not exact: outlines-core's Index misses tokens wherever the schema could end (jaxspec.grammar.END)
    check_against_outlines(smollm2, grammar, sparse, start, walks=3, steps=30, exact=False)
    for value in [{"name": "Ada", "age": 36}, {"name": "日本 \"q\"", "age": -7, "tags": ["b c", "dé"], "ok": True},
                  {"name": "", "age": 0, "tags": []}]:
        ids = smollm2.encode(json.dumps(value, ensure_ascii=False))
        assert accepts(sparse, start, ids, 2), value
        state = walk(sparse, start, ids)[0][-1]
        assert int(sparse.advance(jnp.int32(state), jnp.int32(2))) == DONE
    for bad in [{"name": "x" * 21, "age": 1}, {"age": 1, "name": "x"}, {"name": "x", "age": 1.5}]:
        assert not accepts(sparse, start, smollm2.encode(json.dumps(bad)), 2), bad
