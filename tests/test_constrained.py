"""Constrained generation inside the speculative loop: `generate(regex=..., json_schema=...,
choices=...)` (jaxspec.grammar compiles, jaxspec.spec.loop masks).

Tiny random models carry a tiny byte-level tokenizer (ASCII characters plus a few multi-character
pieces), so real grammars compile over their 128-id vocabulary. What is checked:
  * every output matches its regex / validates against its schema (hypothesis over small finite
    grammars), for plain, prompt lookup, a draft model and EAGLE-3, greedy and sampled, with
    rows of one batch carrying different grammars or none;
  * speculative greedy == plain greedy under a grammar, chains and trees;
  * sampling stays lossless with the mask (exact enumeration on a 12-token vocabulary), and a
    verifier that masks every position by the row's state instead of the draft path's fails the
    same test;
  * a complete grammar stops its row ("stop"); log-probs see the mask; bad grammars are refused
    before anything compiles.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxspec
from jaxspec import cli, grammar
from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.models import eagle3, llama
from jaxspec.sampling import SamplingParams, distribution, spec_for
from jaxspec.spec import loop
from jaxspec.tokenizer import Tokenizer
from tests.test_spec_sampling import SIGNIFICANCE, assert_broken_run_detected, chi_square_p_value


SPECIALS = ["<unk>", "<s>", "<pad>", "</s>"]  # </s> (id 3) is EOS, as TINY's config says
PIECES = ['{"', '":', '",', '"}', ' "', "true", "false", "null", "00", "10", "42", "ab", "cd", "the", " the",
          "  ", "yes", "no", "ma", "ybe", '":"', '","', "]}", "[t", ", ", "e}", "xx", "12", "a,"]
TARGET = ModelConfig(vocab_size=128, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=96,
                     rotary_dim=16, max_position_embeddings=512, eos_token_ids=(3,))
HEAD = eagle3.Eagle3Config(dim=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=64, draft_vocab_size=96,
                           vocab_size=128, rope_theta=10000.0, rotary_dim=16, norm_eps=1e-5,
                           max_position_embeddings=512, aux_layer_ids=(1, 2, 3))
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [40, 41, 42, 40, 41, 42, 40], [9, 8, 7, 6, 5, 4]]


def _byte_level(text: str) -> str:
    """GPT-2's byte-to-unicode spelling of ASCII text (space -> "Ġ")."""
    return text.replace(" ", "\u0120")


def byte_level_tokenizer(tokens: list[str], specials: frozenset[str], eos: str) -> Tokenizer:
    """A byte-level BPE tokenizer over `tokens` in id order; those in `specials` are special added
    tokens, the rest text pieces."""
    vocab = {token if token in specials else _byte_level(token): i for i, token in enumerate(tokens)}
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    hf.add_special_tokens([tokenizers.AddedToken(token, special=True) for token in specials])
    return Tokenizer(hf, eos_token_id=vocab[eos])



@pytest.fixture(scope="module")
def tokenizer():
    characters = [chr(c) for c in range(32, 127)]
    return byte_level_tokenizer(SPECIALS + characters + PIECES, frozenset(SPECIALS), "</s>")


@pytest.fixture(scope="module")
def target(tokenizer):
    return jaxspec.Model(config=TARGET, params=llama.init_params(TARGET, jax.random.PRNGKey(0), scale=0.2),
                         tokenizer=tokenizer)


@pytest.fixture(scope="module")
def draft():
    cfg = dataclasses.replace(TARGET, num_layers=1, dim=32, num_heads=2, num_kv_heads=1, ffn_dim=48)
    return jaxspec.Model(config=cfg, params=llama.init_params(cfg, jax.random.PRNGKey(7), scale=0.2))


@pytest.fixture(scope="module")
def head():
    return jaxspec.Model(config=HEAD, params=eagle3.init_params(HEAD, jax.random.PRNGKey(2), scale=0.2))


def _draft_of(method, draft, head):
    return {"plain": (None, {}), "ngram": (None, {"method": "ngram"}), "draft": (draft, {}),
            "eagle3": (head, {}), "layer_skip": (None, {"method": "layer_skip", "exit_layer": 2})}[method]


def _walk(table, start: int, tokens: list[int]) -> int:
    state = jnp.int32(start)
    for token in tokens:
        state = table.advance(state, jnp.int32(token))
    return int(state)


def _matches(kind: str, source, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(source, text) is not None
    if kind == "choices":
        return text in source
    try:
        jsonschema.validate(json.loads(text), json.loads(source) if isinstance(source, str) else source)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Small finite grammars (finite, so even a random model's output ends inside max_new_tokens)
# ---------------------------------------------------------------------------------------------

REGEX_PIECES = ["[a-c]{1,3}", "(yes|no|maybe)", "[0-9]{2}", "(ab)?", "x{2,3}", "-", "the", "[A-Z]"]
VALUE_SCHEMAS = [{"type": "boolean"}, {"type": "null"}, {"enum": ["ab", "cd", 42]},
                 {"type": "string", "maxLength": 3}, {"type": "integer", "maxDigits": 2},
                 {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, {"const": "yes"}]

regexes = st.lists(st.sampled_from(REGEX_PIECES), min_size=1, max_size=4).map("".join)
schemas = st.lists(st.tuples(st.sampled_from(["a", "b", "name", "n"]), st.sampled_from(VALUE_SCHEMAS)),
                   min_size=1, max_size=3, unique_by=lambda kv: kv[0]).map(
    lambda items: {"type": "object", "properties": dict(items), "required": [k for k, _ in items]})
choice_sets = st.lists(st.sampled_from(["yes", "no", "maybe", "the end", "a,b", "{x}", "42"]), min_size=1,
                       max_size=4, unique=True)
row_grammars = st.one_of(regexes.map(lambda r: ("regex", r)), schemas.map(lambda s: ("json_schema", s)),
                         choice_sets.map(lambda c: ("choices", c)), st.none())


def _options(per_row: list) -> dict:
    """generate()'s grammar options for one batch whose rows carry `per_row` (kind, source) or None."""
    options = {}
    for kind in ("regex", "json_schema", "choices"):
        values = [source if row is not None and row[0] == kind else None for row in per_row
                  for source in [None if row is None else row[1]]]
        if any(value is not None for value in values):
            options[kind] = values
    return options


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("method", ["plain", "ngram", "eagle3"])
def test_every_output_matches_its_grammar(target, draft, head, method, temperature):
    drafted, method_options = _draft_of(method, draft, head)

    @settings(max_examples=2, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(row_grammars, min_size=3, max_size=3).filter(lambda rows: any(r is not None for r in rows)))
    def check(per_row):
        result = jaxspec.generate(target, drafted, PROMPTS, max_new_tokens=48, temperature=temperature, seed=1,
                                  **method_options, **_options(per_row))
        for row, row_grammar in enumerate(per_row):
            if row_grammar is None:
                continue
            kind, source = row_grammar
            text = result.text[row]
            assert result.finish_reason[row] == "stop", (per_row, row, text)
            assert _matches(kind, source, text), (kind, source, text)

    check()


# ---------------------------------------------------------------------------------------------
# Exactness: speculative == plain under a grammar
# ---------------------------------------------------------------------------------------------

MIXED = dict(json_schema=[{"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                            "ok": {"type": "boolean"}}, "required": ["name", "ok"]},
                          None, None],
             regex=[None, "(the|ab|[a-c]{2,5})+-[0-9]{1,3}", None])  # row 2: no grammar


@pytest.fixture(scope="module")
def plain_mixed(target):
    return jaxspec.generate(target, None, PROMPTS, max_new_tokens=40, **MIXED)


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle3", "layer_skip", "draft-tree", "ngram-tree",
                                    "eagle3-lookup", "eagle3-lookup-tree"])
def test_speculative_greedy_equals_plain_under_a_grammar(target, draft, head, plain_mixed, method):
    """Every drafter's greedy output under a grammar equals plain greedy under it; "-lookup" puts
    prompt lookup first (its copies are not drawn under the mask: the verify cuts them)."""
    tree = method.endswith("-tree")
    name = method.removesuffix("-tree")
    drafted, options = _draft_of(name.removesuffix("-lookup"), draft, head)
    if name.endswith("-lookup"):
        options = dict(options, lookup_first=2)
    result = jaxspec.generate(target, drafted, PROMPTS, max_new_tokens=40, tree=(3, 2, 6) if tree else None,
                              **options, **MIXED)
    assert result.tokens == plain_mixed.tokens
    assert result.finish_reason == plain_mixed.finish_reason
    assert _matches("json_schema", MIXED["json_schema"][0], result.text[0])
    assert re.fullmatch(MIXED["regex"][1], result.text[1])
    assert result.stats.proposed >= result.stats.accepted > 0


def test_grammar_rows_differ_from_their_free_runs_and_the_free_row_does_not(target, plain_mixed):
    free = jaxspec.generate(target, None, PROMPTS, max_new_tokens=40)
    assert free.tokens[2] == plain_mixed.tokens[2]  # a free row beside constrained ones is untouched
    assert free.tokens[0] != plain_mixed.tokens[0] and free.tokens[1] != plain_mixed.tokens[1]


def test_prompt_lookup_drafts_are_cut_at_the_first_forbidden_token(target):
    """A prompt of repeats makes prompt lookup propose its continuation, which the grammar forbids:
    every such draft is cut before it is counted, so nothing forbidden is proposed."""
    prompt = target.tokenizer.encode("zzzz zzzz zzzz zzzz", add_special_tokens=False)
    result = jaxspec.generate(target, None, prompt, max_new_tokens=30, method="ngram", regex="[a-c]{10,20}")
    free = jaxspec.generate(target, None, prompt, max_new_tokens=30, method="ngram")
    assert free.stats.proposed > 0 and result.stats.proposed < free.stats.proposed
    assert re.fullmatch("[a-c]{10,20}", result.text[0])


# ---------------------------------------------------------------------------------------------
# Lossless sampling under a mask: exact enumeration on a 12-token vocabulary
# ---------------------------------------------------------------------------------------------

SMALL = ModelConfig(vocab_size=12, dim=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                    ffn_dim=48, rotary_dim=16, max_position_embeddings=64, eos_token_ids=(11,))
SMALL_PROMPT = [1, 2, 3, 1, 2, 4, 5, 1, 2]
# Tokens 0..10 are the letters a..k; the grammar allows a different set at each of the first three.
SMALL_REGEX = "[a-f][c-h][b-j]+"
SMALL_ALLOWED = [range(0, 6), range(2, 8), range(1, 10)]
ROWS, SEEDS = 5000, 2


@pytest.fixture(scope="module")
def small():
    tokenizer = byte_level_tokenizer([chr(ord("a") + i) for i in range(11)] + ["</s>"], frozenset(["</s>"]), "</s>")
    target = jaxspec.Model(config=SMALL, params=llama.init_params(SMALL, jax.random.PRNGKey(0), scale=0.5),
                           tokenizer=tokenizer)
    cfg = dataclasses.replace(SMALL, num_layers=1)
    return target, jaxspec.Model(config=cfg, params=llama.init_params(cfg, jax.random.PRNGKey(1), scale=0.5))


def exact_masked_joint(model, settings) -> np.ndarray:
    """p(t1, t2, t3 | prompt) of the processed distribution masked to SMALL_ALLOWED: [V, V, V]."""
    V = model.config.vocab_size
    spec = spec_for(**settings)
    forward = jax.jit(llama.forward, static_argnums=1)

    def next_probs(sequences, allowed):
        tokens = jnp.asarray(sequences, jnp.int32)
        logits, _, _ = forward(model.params, model.config, tokens, KVCache.create(model.config, len(sequences), 16))
        mask = np.zeros(V, bool)
        mask[list(allowed)] = True
        logits = jnp.where(jnp.asarray(mask), logits[:, -1], -jnp.inf)
        params = SamplingParams.create(len(sequences), **settings)
        return np.asarray(distribution(logits, params, spec), np.float64)

    p1 = next_probs([SMALL_PROMPT], SMALL_ALLOWED[0])[0]
    p2 = next_probs([SMALL_PROMPT + [a] for a in range(V)], SMALL_ALLOWED[1])
    p3 = next_probs([SMALL_PROMPT + [a, b] for a in range(V) for b in range(V)], SMALL_ALLOWED[2]).reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def masked_counts(model, draft_model, settings, **method) -> tuple[np.ndarray, jaxspec.SpecStats]:
    V = model.config.vocab_size
    counts = np.zeros((V, V, V), np.int64)
    for seed in range(SEEDS):
        result = jaxspec.generate(model, draft_model, [SMALL_PROMPT] * ROWS, max_new_tokens=3, ignore_eos=True,
                                  num_draft_tokens=2, seed=seed, regex=SMALL_REGEX, **settings, **method)
        tokens = np.asarray(result.tokens)
        np.add.at(counts, (tokens[:, 0], tokens[:, 1], tokens[:, 2]), 1)
    return counts, result.stats


MASKED_CASES = [
    ("plain-t1.0", dict(temperature=1.0), {}),
    ("draft-sample-t0.8-topk6", dict(temperature=0.8, top_k=6), dict(method="draft")),
    ("ngram-t1.0", dict(temperature=1.0), dict(method="ngram")),
]


@pytest.mark.parametrize("name, settings, method", MASKED_CASES, ids=[c[0] for c in MASKED_CASES])
def test_sampling_under_a_grammar_matches_the_exact_masked_distribution(small, name, settings, method):
    target, draft_model = small
    counts, stats = masked_counts(target, draft_model if method.get("method") == "draft" else None, settings,
                                  **method)
    p_value = chi_square_p_value(counts, exact_masked_joint(target, settings))
    assert p_value > SIGNIFICANCE, f"constrained samples differ from the masked distribution: p = {p_value:.2e}"
    if method:
        assert stats.accepted > 0


def test_a_verifier_masking_by_the_wrong_state_fails_the_same_test(small, monkeypatch):
    target, draft_model = small
    real_walk = loop._walk

    def broken_walk(grammar_table, start, tokens, parents=None):
        """A classic bug: every verify position masked by the row's current state, not the
        state the drafts before it reach."""
        if tokens.shape[1] == 2:  # the verify's walk along k = 2 drafts (commit walks k + 1 tokens)
            return jnp.repeat(start[:, None], 3, axis=1)
        return real_walk(grammar_table, start, tokens, parents)

    monkeypatch.setattr(loop, "_walk", broken_walk)
    settings = dict(temperature=1.0)
    assert_broken_run_detected(lambda: masked_counts(target, draft_model, settings, method="draft"),
                               exact_masked_joint(target, settings))


# ---------------------------------------------------------------------------------------------
# Stopping, log-probs, the CLI, bad input
# ---------------------------------------------------------------------------------------------


def test_a_complete_grammar_stops_its_row_without_emitting_eos(target):
    result = jaxspec.generate(target, None, PROMPTS, max_new_tokens=40, choices=["yes", "no", "maybe"],
                              ignore_eos=True)
    assert result.finish_reason == ["stop"] * 3
    assert all(text in ("yes", "no", "maybe") for text in result.text)
    assert all(target.tokenizer.eos_token_id not in tokens for tokens in result.tokens)


def test_max_new_tokens_still_ends_a_constrained_row(target):
    result = jaxspec.generate(target, None, PROMPTS[:1], max_new_tokens=5, regex="[a-c]{20}")
    assert result.finish_reason == ["length"] and len(result.tokens[0]) == 5
    assert re.fullmatch("[a-c]{5}", result.text[0])


def test_logprobs_see_the_mask(target):
    """Under [a-c]{20}, 8 tokens never complete the grammar: at every step exactly the pieces made
    of a, b and c are allowed (a, b, c, ab), they carry all the mass and the rest is at -inf."""
    regex = "[a-c]{20}"
    result = jaxspec.generate(target, None, PROMPTS[:1], max_new_tokens=8, regex=regex, logprobs=6)
    allowed = {i for i in range(128) if (piece := target.tokenizer.decode([i], skip_special_tokens=False))
               and set(piece) <= set("abc") and i != target.tokenizer.eos_token_id}
    assert len(allowed) == 4
    for entry in result.logprobs[0]:
        assert {token for token, _ in entry.top[:4]} == allowed
        assert all(value == -np.inf for _, value in entry.top[4:])
        assert np.isclose(np.logaddexp.reduce([value for _, value in entry.top[:4]]), 0.0, atol=1e-5)
    table, starts = grammar.build_table([grammar.compile_grammar(target.tokenizer, 128, regex=regex)], 128)
    assert _walk(table, int(starts[0]), result.tokens[0]) not in (grammar.DEAD, grammar.FREE)


@pytest.mark.parametrize("options, message", [
    (dict(regex="[a-"), "regex"),
    (dict(regex="\u00e9+"), "no path"),
    (dict(json_schema="{not json"), "json_schema is not valid JSON"),
    (dict(json_schema="[1, 2]"), "must be a JSON object"),
    (dict(choices=["yes", ""]), "choices"),
    (dict(regex=["a+", None]), "regex has 2 per-row entries for 3 prompt"),
    (dict(regex=["a+", None, None], choices=[["x"], None, None]), "prompt 0 has two grammars"),
])
def test_bad_grammars_are_refused_before_anything_compiles(target, options, message):
    with pytest.raises(jaxspec.InvalidRequestError, match=message):
        jaxspec.prepare(target, prompt=PROMPTS, **options)


def test_a_grammar_needs_a_tokenizer(tiny_model):
    with pytest.raises(jaxspec.InvalidRequestError, match="needs the model's tokenizer"):
        jaxspec.prepare(tiny_model, prompt=[[1, 2]], regex="a+")


def test_cli_reads_a_json_schema_file_and_refuses_a_missing_one(tmp_path, capsys):
    assert cli.main(["generate", "hi", "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "--json-schema" in capsys.readouterr().err
