"""`jaxspec.score`: teacher-forced log-probs equal log_softmax of transformers' logits at the next
tokens; how rows are run (batched and ragged, or alone; in chunks of any size, through a KV or a
hybrid cache) changes nothing beyond float rounding; perplexity is exp(-mean); bad input is refused
before anything compiles; the CLI's `score` subcommand.

Compiles are shared: the tiny Llama runs ROWS (batch bucket 4, length bucket 32) and each row
alone, the hybrid the same; everything else reuses those shapes or is one extra program.
"""

from __future__ import annotations

import json
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

import ckpt_fixtures as fx
import jaxspec
from jaxspec import cli, compilation, models
from jaxspec.models import llama, mtp, qwen35
from jaxspec.score import score_chunk
from tests.conftest import HYBRID_CONFIG, TINY, max_relative_error, requires_default_model

# Ragged: 20, 7 and 2 tokens (the shortest scorable row), ids anywhere in TINY's vocabulary (128).
ROWS = [
    [5, 17, 3, 99, 42, 0, 64, 64, 127, 8, 11, 12, 13, 90, 91, 2, 7, 7, 7, 100],
    [9, 8, 7, 6, 5, 4, 3],
    [126, 1],
]
# Words of the tiny checkpoint's tokenizer (whitespace-split word level), after its specials.
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "."]
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the checkpoint's config says bos 1, eos 2


@pytest.fixture(scope="module")
def hybrid_model() -> jaxspec.Model:
    params = qwen35.init_params(HYBRID_CONFIG, jax.random.PRNGKey(1), scale=0.3)
    return jaxspec.Model(config=HYBRID_CONFIG, params=params)


@pytest.fixture(scope="module")
def tiny_scores(tiny_model) -> jaxspec.ScoreResult:
    return jaxspec.score(tiny_model, ROWS)


def write_word_tokenizer(directory) -> None:
    """A word-level tokenizer.json over fx.TINY's vocabulary: SPECIALS, WORDS, then fillers."""
    vocab = SPECIALS + WORDS
    vocab += [f"w{i}" for i in range(fx.TINY["vocab_size"] - len(vocab))]
    word_level = tokenizers.models.WordLevel({token: i for i, token in enumerate(vocab)}, unk_token="<unk>")
    tokenizer = tokenizers.Tokenizer(word_level)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny random HF LlamaForCausalLM saved with a word tokenizer, and jaxspec's load of it."""
    import torch
    import transformers

    directory = tmp_path_factory.mktemp("hf-llama")
    fx.make_hf_checkpoint(directory)
    write_word_tokenizer(directory)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model = jaxspec.load(str(directory))  # an HF directory is read directly: nothing is cached
    return hf_model, model, directory


# ---------------------------------------------------------------------------------------------
# What the numbers are
# ---------------------------------------------------------------------------------------------


def test_logprobs_equal_log_softmax_of_transformers_logits(hf_llama):
    import torch

    hf_model, model, _ = hf_llama
    rows = [[1, 40, 3, 77, 9, 127, 0, 64, 5, 5, 12, 100, 33], [1, 8, 99, 2], [70, 71]]
    result = jaxspec.score(model, rows, chunk_tokens=4)
    for row, ours in zip(rows, result.logprobs):
        with torch.no_grad():
            logits = hf_model(torch.tensor([row])).logits[0].double()  # [N, V], the row alone
        reference = torch.log_softmax(logits, dim=-1)[torch.arange(len(row) - 1), torch.tensor(row[1:])].numpy()
        error = max_relative_error(ours, reference)
        assert error <= 1e-4, f"max relative log-prob error {error:.2e}"


def test_result_holds_n_minus_one_float32_logprobs_per_row_and_float64_perplexity(tiny_scores):
    assert len(tiny_scores.logprobs) == len(tiny_scores.tokens) == len(ROWS)
    for row, logprobs, tokens in zip(ROWS, tiny_scores.logprobs, tiny_scores.tokens):
        chex.assert_shape(logprobs, (len(row) - 1,))
        assert logprobs.dtype == np.float32 and np.all(logprobs < 0)
        np.testing.assert_array_equal(tokens, row)
    chex.assert_shape(tiny_scores.perplexity, (len(ROWS),))
    assert tiny_scores.perplexity.dtype == np.float64
    chex.assert_tree_all_finite(tiny_scores.logprobs)


def test_perplexity_is_exp_of_minus_the_mean_logprob(tiny_scores):
    for logprobs, perplexity in zip(tiny_scores.logprobs, tiny_scores.perplexity):
        assert perplexity == pytest.approx(np.exp(-np.mean(logprobs.astype(np.float64))), rel=1e-12)


def test_ragged_batch_equals_each_row_scored_alone(tiny_model, tiny_scores):
    for row, batched in zip(ROWS, tiny_scores.logprobs):
        alone = jaxspec.score(tiny_model, row)
        chex.assert_trees_all_close(batched, alone.logprobs[0], rtol=1e-6, atol=0)


def test_chunk_size_does_not_change_the_logprobs(tiny_model, tiny_scores):
    chunked = jaxspec.score(tiny_model, ROWS, chunk_tokens=3)
    chex.assert_trees_all_close(chunked.logprobs, tiny_scores.logprobs, rtol=0, atol=1e-5)


def test_hybrid_ragged_batch_equals_each_row_alone_and_chunking_agrees(hybrid_model):
    # chunk 32 runs the DeltaNet layers' chunked form (T > recorded_steps = 16), chunk 3 their
    # recurrent form: the cache carries the state across chunks either way.
    rows = [[token % HYBRID_CONFIG.vocab_size for token in row] for row in ROWS]
    batched = jaxspec.score(hybrid_model, rows)
    for row, logprobs in zip(rows, batched.logprobs):
        alone = jaxspec.score(hybrid_model, row)
        chex.assert_trees_all_close(logprobs, alone.logprobs[0], rtol=1e-6, atol=0)
    chunked = jaxspec.score(hybrid_model, rows, chunk_tokens=3)
    chex.assert_trees_all_close(chunked.logprobs, batched.logprobs, rtol=0, atol=1e-5)


class ScoreChunkVariantsTest(chex.TestCase):
    """The per-chunk step, eager or compiled: the log_softmax of the trunk's logits at the next
    tokens, and the cache advanced by the chunk."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_gathers_log_softmax_at_the_next_tokens(self):
        params = llama.init_params(TINY, jax.random.PRNGKey(0), scale=0.2)
        tokens = jnp.asarray([ROWS[0][:5], ROWS[0][5:10]], jnp.int32)  # [B, C]
        next_tokens = jnp.asarray([ROWS[0][1:6], ROWS[0][6:11]], jnp.int32)
        step = self.variant(lambda p, cache, t, n: score_chunk(p, cache, t, n, cfg=TINY))
        picked, cache = step(params, models.create_cache(TINY, 2, 16), tokens, next_tokens)
        logits, _, _ = models.forward(params, TINY, tokens, models.create_cache(TINY, 2, 16))  # [B, C, V]
        expected = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), next_tokens[:, :, None], axis=-1)[..., 0]
        chex.assert_shape(picked, (2, 5))
        chex.assert_trees_all_close(picked, expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(cache.length, [5, 5])


# ---------------------------------------------------------------------------------------------
# Texts and BOS
# ---------------------------------------------------------------------------------------------


def test_texts_are_scored_as_their_tokens(hf_llama):
    _, model, _ = hf_llama
    text = "the cat sat on the mat ."
    ids = model.tokenizer.encode(text)
    assert ids == [len(SPECIALS) + WORDS.index(word) for word in text.split()]  # no BOS: the tokenizer adds none
    from_text = jaxspec.score(model, [text, "a dog ran"])
    from_ids = jaxspec.score(model, [ids, model.tokenizer.encode("a dog ran")])
    np.testing.assert_array_equal(from_text.tokens[0], ids)
    chex.assert_trees_all_close(from_text.logprobs, from_ids.logprobs, rtol=0, atol=0)


def test_add_bos_starts_every_row_with_bos_or_none(hf_llama):
    _, model, _ = hf_llama
    bos = SPECIALS.index("<s>")
    rows = [[40, 3, 77], [bos, 8, 99, 4]]
    with_bos = jaxspec.score(model, rows, add_bos=True)
    assert [r.tolist() for r in with_bos.tokens] == [[bos, 40, 3, 77], [bos, 8, 99, 4]]
    chex.assert_trees_all_close(with_bos.logprobs, jaxspec.score(model, [[bos, 40, 3, 77], rows[1]]).logprobs)
    without = jaxspec.score(model, rows, add_bos=False)
    assert [r.tolist() for r in without.tokens] == [[40, 3, 77], [8, 99, 4]]
    as_given = jaxspec.score(model, rows)
    assert [r.tolist() for r in as_given.tokens] == rows


# ---------------------------------------------------------------------------------------------
# Bad input: InvalidRequestError naming the problem, before anything compiles
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "texts_or_ids, options, needle",
    [
        ([], {}, "non-empty"),
        ([[5, 6], []], {}, "prompt 1 is empty"),
        ([[5, 6], [7]], {}, "row 1 has 1 token(s); scoring needs at least 2"),
        ([5, 128], {}, "token id 128 outside the vocabulary [0, 128)"),
        ([[5, 6], [-1, 4]], {}, "token id -1 outside the vocabulary"),
        ([5, 6.5], {}, "must be a string, a list of messages or a list of token ids"),
        ("the cat", {}, "no tokenizer"),
        ([1] * (TINY.max_position_embeddings + 1), {}, "row 0 has 257 tokens, beyond the model's context of 256"),
        ([5, 6], {"chunk_tokens": 0}, "chunk_tokens must be an integer >= 1"),
        ([5, 6], {"chunk_tokens": 2.5}, "chunk_tokens must be an integer >= 1"),
        ([5, 6], {"add_bos": "yes"}, "add_bos must be None, True or False"),
        ([5, 6], {"add_bos": True}, "names no BOS token"),
    ],
    ids=["empty-list", "empty-row", "one-token-row", "id-past-vocab", "negative-id", "float-id",
         "text-without-tokenizer", "longer-than-context", "chunk-0", "chunk-float", "add-bos-not-bool",
         "add-bos-without-bos"],
)
def test_bad_input_is_refused_before_anything_compiles(tiny_model, texts_or_ids, options, needle):
    with compilation.CompileWatch("a refused request") as watch:
        with pytest.raises(jaxspec.InvalidRequestError) as error:
            jaxspec.score(tiny_model, texts_or_ids, **options)
    assert needle in str(error.value)
    assert watch.seconds == 0.0


@pytest.mark.parametrize(
    "texts, needle",
    [("", "prompt 0 is an empty string"), (["the cat", ""], "prompt 1 is an empty string"),
     ("cat", "row 0 has 1 token(s)")],
    ids=["empty", "one-empty", "one-word"],
)
def test_bad_texts_are_refused(hf_llama, texts, needle):
    _, model, _ = hf_llama
    with pytest.raises(jaxspec.InvalidRequestError, match=re.escape(needle)):
        jaxspec.score(model, texts)


def test_a_draft_head_is_refused(tiny_model):
    head_config = mtp.MtpConfig(block=TINY)
    head = jaxspec.Model(config=head_config, params=mtp.init_params(head_config, jax.random.PRNGKey(0)))
    with pytest.raises(jaxspec.InvalidRequestError, match="score needs a trunk model; got a draft head"):
        jaxspec.score(head, [5, 6, 7])
    with pytest.raises(jaxspec.InvalidRequestError, match="must be a jaxspec Model"):
        jaxspec.score(tiny_model.params, [5, 6, 7])


# ---------------------------------------------------------------------------------------------
# The CLI and the default model
# ---------------------------------------------------------------------------------------------


def test_cli_prints_each_tokens_logprob_then_the_perplexity(hf_llama, capsys):
    _, model, directory = hf_llama
    text = "the cat sat on the mat ."
    expected = jaxspec.score(model, text)
    capsys.readouterr()
    assert cli.main(["score", text, "--model", str(directory), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [token["text"] for token in report["tokens"]] == text.split()[1:]
    assert [token["id"] for token in report["tokens"]] == expected.tokens[0][1:].tolist()
    np.testing.assert_allclose([token["logprob"] for token in report["tokens"]], expected.logprobs[0], rtol=1e-6)
    assert report["perplexity"] == pytest.approx(expected.perplexity[0], rel=1e-12)

    assert cli.main(["score", text, "--model", str(directory)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(text.split())  # a line per scored token, then the perplexity
    assert lines[0].split() == [f"{expected.logprobs[0][0]:.4f}", '"cat"']
    assert lines[-1] == f"perplexity {expected.perplexity[0]:.4f} over {len(text.split()) - 1} tokens"


def test_cli_bad_input_exits_2_with_one_line(hf_llama, capsys):
    _, _, directory = hf_llama
    capsys.readouterr()
    code = cli.main(["score", "cat", "--model", str(directory)])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_BAD_INPUT and out == "" and "Traceback" not in err
    # The last stderr line; the load's progress bar comes before it.
    assert err.splitlines()[-1] == (
        "error: row 0 has 1 token(s); scoring needs at least 2 (the first token is only context)")


@requires_default_model
@pytest.mark.real_model
def test_default_model_finds_english_likelier_than_its_tokens_shuffled():
    model = jaxspec.load()
    sentence = "The quick brown fox jumps over the lazy dog, and then it runs back into the forest."
    ids = model.tokenizer.encode(sentence)
    shuffled = np.random.RandomState(0).permutation(ids).tolist()
    assert shuffled != ids
    result = jaxspec.score(model, [ids, shuffled])
    chex.assert_tree_all_finite(result.perplexity)
    ordered, scrambled = result.perplexity
    assert ordered < scrambled / 10, (ordered, scrambled)
