"""Draft trees end to end: tree greedy equals plain greedy for every proposer, a draft equal to
the target accepts what a tree allows, quantized KV and weights, the stats, streaming and the CLI,
and the requests a tree refuses before anything compiles.

Each (proposer, tree shape, batch) is its own compiled program, so the three shapes - depth 1
(1, 3, 3), a chain (4, 1, 4) and a bushy tree (3, 4, 12) - are spread over the proposers rather
than crossed with them: every proposer runs a ragged batch with one shape and a single prompt
with another, and every shape runs at both batch sizes. The reference is plain greedy decoding
(itself checked against full recomputation in test_loop.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import cli, compilation
from jaxspec.models import eagle3, mtp, qwen35
from tests.conftest import TINY, assert_plain_greedy
from tests.test_cli import run, stats_lines, tiny, tiny_cache  # noqa: F401 (fixtures)
from tests.test_eagle3 import HEAD
from tests.test_kv_quant import TINY32, random_params
from tests.test_qwen35 import SPEC_CFG as HYBRID
from tests.test_spec import PROMPTS

DRAFT = dataclasses.replace(TINY, num_layers=1, dim=32, num_heads=2, num_kv_heads=1, ffn_dim=48)  # test_spec's
DEPTH_ONE, CHAIN, BUSHY = (1, 3, 3), (4, 1, 4), (3, 4, 12)
SINGLE = PROMPTS[2]  # 21 tokens with repeats: prompt lookup finds matches
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def plain(tiny_model):
    """Plain greedy on the ragged batch and on the single prompt: every tree run's reference."""
    return {"ragged": jaxspec.generate(tiny_model, None, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True),
            "single": jaxspec.generate(tiny_model, None, SINGLE, max_new_tokens=NEW_TOKENS, ignore_eos=True)}


@pytest.fixture(scope="module")
def draft_model():
    """An unrelated 1-layer random draft of the same vocabulary: low but nonzero acceptance."""
    return jaxspec.Model(config=DRAFT, params=random_params(DRAFT, seed=7))


@pytest.fixture(scope="module")
def eagle3_head():
    """test_eagle3's head sized for the tiny target (aux streams of its 2 layers), drawn with
    numpy as random_params does (jax.random would compile per shape): norms 1, weights
    N(0, 0.2), d2t 0 (draft id i is target id i)."""
    cfg = dataclasses.replace(HEAD, dim=TINY.dim, vocab_size=TINY.vocab_size, aux_layer_ids=(0, 1, 1))
    rng = np.random.RandomState(1)

    def draw(path, leaf):
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            return jnp.zeros(leaf.shape, leaf.dtype)
        if path[-1].name.endswith("norm"):
            return jnp.ones(leaf.shape, leaf.dtype)
        return jnp.asarray(0.2 * rng.randn(*leaf.shape), leaf.dtype)

    shapes = jax.eval_shape(lambda: eagle3.init_params(cfg, jax.random.PRNGKey(0)))
    return jaxspec.Model(config=cfg, params=jax.tree_util.tree_map_with_path(draw, shapes))


@pytest.fixture(scope="module")
def mtp_head():
    """A random MTP head on the Llama target, as test_mtp's test_random_head_on_a_llama_target."""
    cfg = mtp.MtpConfig(block=TINY)
    return jaxspec.Model(config=cfg, params=mtp.init_params(cfg, jax.random.PRNGKey(3)))


def assert_tree_stats(stats: jaxspec.SpecStats, tree: tuple[int, int, int]) -> None:
    """What a tree's counters must satisfy whatever was accepted."""
    depth, _, num_nodes = tree
    assert stats.tree == ",".join(map(str, tree)) and stats.num_draft_tokens == depth
    assert len(stats.accepted_depths) == depth + 1 and len(stats.acceptance_by_position) == depth
    assert sum(stats.accepted_depths) == stats.rounds  # each round accepts exactly one depth
    assert sum(n * rounds for n, rounds in enumerate(stats.accepted_depths)) == stats.accepted
    assert 0 <= stats.accepted <= stats.proposed <= num_nodes * stats.rounds
    assert stats.mean_accepted == stats.accepted / stats.rounds
    # Every round commits its accepted depth + 1 tokens; only a row's last round may be cut
    # short by max_new_tokens, by at most depth tokens.
    assert stats.rounds + stats.accepted - depth * stats.rows <= stats.decode_tokens <= stats.rounds + stats.accepted


def method_kwargs(method, draft_model, eagle3_head, mtp_head) -> dict:
    return {"ngram": dict(method="ngram"), "draft": dict(draft_params=draft_model),
            "layer_skip": dict(method="layer_skip", exit_layer=1), "eagle3": dict(draft_params=eagle3_head),
            "mtp": dict(draft_params=mtp_head)}[method]


# (method, the ragged batch's tree, the single prompt's tree): each proposer sees two shapes, and
# each shape runs at both batch sizes.
PROPOSER_TREES = [
    ("ngram", BUSHY, CHAIN),
    ("draft", DEPTH_ONE, BUSHY),
    ("layer_skip", CHAIN, DEPTH_ONE),
    ("eagle3", BUSHY, DEPTH_ONE),
    ("mtp", CHAIN, BUSHY),
]


@pytest.mark.parametrize("method, ragged_tree, single_tree", PROPOSER_TREES, ids=[p[0] for p in PROPOSER_TREES])
def test_tree_greedy_equals_plain_greedy(tiny_model, plain, draft_model, eagle3_head, mtp_head, method,
                                         ragged_tree, single_tree):
    kwargs = method_kwargs(method, draft_model, eagle3_head, mtp_head)
    ragged = jaxspec.generate(tiny_model, prompt=PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                              tree=ragged_tree, **kwargs)
    assert_plain_greedy(tiny_model, PROMPTS, ragged, plain["ragged"])
    assert ragged.stats.method == method and ragged.stats.proposed > 0
    assert_tree_stats(ragged.stats, ragged_tree)
    single = jaxspec.generate(tiny_model, prompt=SINGLE, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                              tree=single_tree, **kwargs)
    assert_plain_greedy(tiny_model, [SINGLE], single, plain["single"])
    assert_tree_stats(single.stats, single_tree)


def test_a_draft_equal_to_the_target_accepts_a_whole_chain_every_round(tiny_model, plain):
    """Every round accepts all 4 drafts, which needs the drafter's tree attention and its K/V
    (the accepted path's scratch slots gathered) to be right round after round."""
    new_tokens = 21  # the first token from prefill, then 4 rounds of 4 drafts + the bonus
    result = jaxspec.generate(tiny_model, tiny_model, PROMPTS, max_new_tokens=new_tokens, ignore_eos=True,
                              tree=jaxspec.DraftTree(*CHAIN))
    assert result.tokens == [tokens[:new_tokens] for tokens in plain["ragged"].tokens]
    stats = result.stats
    assert_tree_stats(stats, CHAIN)
    assert stats.accepted_depths == (0, 0, 0, 0, 4 * len(PROMPTS))
    assert stats.acceptance_by_position == (1.0,) * 4
    assert stats.target_forwards == 4 and stats.tau == 5 == 1 + stats.mean_accepted


def test_a_draft_equal_to_the_target_always_accepts_a_bushy_trees_first_depth(tiny_model, plain):
    """The drafter's best child is the target's argmax, and the best node is always kept."""
    result = jaxspec.generate(tiny_model, tiny_model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                              tree="3,4,12")
    assert result.tokens == plain["ragged"].tokens
    stats = result.stats
    assert_tree_stats(stats, BUSHY)
    assert stats.accepted_depths[0] == 0 and stats.acceptance_by_position[0] == 1.0


def test_a_stop_token_inside_an_accepted_path_ends_the_row_there(tiny_model, plain):
    """Rounds accept several tokens at once; the row still ends at the stop token's first
    occurrence and keeps nothing past it (the same program as above: stop ids are an array)."""
    stop = plain["ragged"].tokens[0][10]
    result = jaxspec.generate(tiny_model, tiny_model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                              stop_token_ids=[stop], tree=BUSHY)
    for tokens, reference in zip(result.tokens, plain["ragged"].tokens):
        assert tokens == (reference[:reference.index(stop) + 1] if stop in reference else reference)
    assert result.finish_reason[0] == "stop" and result.stats.multi_token_rounds > 0


def test_greedy_with_repetition_penalty_is_exact_through_the_tree_verifier(tiny_model):
    """Temperature 0 with a repetition penalty verifies by sampling over point masses, the
    distribution after each node penalised by the committed tokens and the tokens on its path:
    the output equals plain greedy's (penalising by the committed tokens alone fails this)."""
    options = dict(max_new_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.4)
    reference = jaxspec.generate(tiny_model, None, PROMPTS, **options)
    result = jaxspec.generate(tiny_model, prompt=PROMPTS, method="layer_skip", exit_layer=1, tree=BUSHY, **options)
    assert result.tokens == reference.tokens
    assert_tree_stats(result.stats, BUSHY)
    assert result.stats.accepted > 0


@pytest.fixture(scope="module")
def tiny32():
    """head_dim 32: the block KV formats (q8_0, q5_1) need H % 32 == 0."""
    return jaxspec.Model(config=TINY32, params=random_params(TINY32, seed=0))


@pytest.mark.parametrize("weights, kv_format, attention", [
    ("f32", "q8_0", "auto"),
    ("f32", ("q8_0", "q5_1"), "interpret"),
    ("int8", None, "auto"),
    ("bf16", None, "auto"),
], ids=["f32-q8_0", "f32-q8_0,q5_1-interpret", "int8", "bf16"])
def test_quantized_kv_and_weights_keep_tree_greedy_exact(tiny32, weights, kv_format, attention):
    """The verify writes quantized K/V for every node and the accepted path's are gathered into
    place; the Pallas kernel (interpreted) reads the tree mask; int8 weights pad the verify with
    filler tokens to their token lanes. The layer-skip draft accepts real paths, so all of that is
    exercised.

    Float32 weights make tree greedy exact (a divergence only at a float near-tie). Under int8 a
    tree node's last-bit attention differences can flip an activation's rounding, so exactness is
    not guaranteed there (docs/design.md; the default model diverges, bench/RESULTS.md); on this
    2-layer model the flips stay below the argmax margins, so the int8 case checks the filler
    mechanics (a wrong logit index or a filler seen by a node breaks it) with the same assertion;
    bf16 likewise, its products in bf16 (quant._bf16_product)."""
    model = jaxspec.convert_weights(tiny32, weights)
    options = dict(max_new_tokens=NEW_TOKENS, ignore_eos=True, kv_format=kv_format, attention=attention)
    reference = jaxspec.generate(model, None, PROMPTS, **options)
    result = jaxspec.generate(model, prompt=PROMPTS, method="layer_skip", exit_layer=1, tree=BUSHY, **options)
    assert_plain_greedy(model, PROMPTS, result, reference)
    assert_tree_stats(result.stats, BUSHY)
    assert result.stats.accepted > 0


def test_stream_and_the_cli_give_generates_text_and_the_tree_stats(tiny, tiny_cache, capsys):
    """A tokenizer model: stream() yields generate()'s text, and the CLI prints that text and a
    stats line naming the tree and the rounds by accepted depth."""
    model = jaxspec.load(str(tiny["gguf"]))
    # chat=False: the CLI's --no-chat below.
    prompt, options = "tok1tok2", dict(method="layer_skip", tree=BUSHY, max_new_tokens=12, chat=False)
    expected = jaxspec.generate(model, None, prompt, **options)
    stream = jaxspec.stream(model, prompt=prompt, **options)
    assert "".join(stream) == expected.text[0] and expected.text[0]
    assert stream.result.tokens == expected.tokens
    assert stream.result.stats.accepted_depths == expected.stats.accepted_depths
    assert_tree_stats(stream.result.stats, BUSHY)

    code, out, err = run(capsys, "generate", prompt, "--no-chat", "--max-new-tokens", "12", "--model",
                         str(tiny["gguf"]), "--method", "layer_skip", "--tree", "3,4,12")
    assert code == 0, err
    assert out == expected.text[0]
    [line] = stats_lines(err)
    depths = " ".join(f"{n}:{rounds}" for n, rounds in enumerate(expected.stats.accepted_depths))
    assert "layer_skip tree 3,4,12: tau " in line and f"(rounds by depth {depths})" in line


# ----------------------------------------------------------------------------------------------
# Refusals: named, and before anything compiles
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="ngram", tree=(0, 2, 2)), r"DraftTree depth must be an integer >= 1; got 0"),
    (dict(method="ngram", tree=(2, -1, 4)), r"DraftTree top_k must be an integer >= 1; got -1"),
    (dict(method="ngram", tree="3,2,2"), r"num_nodes \(2\) must be >= depth \(3\)"),
    (dict(method="ngram", tree=(2, 2, 7)), r"num_nodes \(7\) exceeds the 6 candidates"),
    (dict(method="ngram", tree=(2, 16, 129)), r"num_nodes \(129\) must be <= 128"),
    (dict(method="ngram", tree="3,x,4"), r"a tree is DEPTH,TOPK,NODES"),
    (dict(method="ngram", tree=(3, 4)), r"a \(depth, top_k, num_nodes\) triple"),
    # 13 + 235 + the tree's 12 slots per round pass 256 positions (a chain of 4 would fit)
    (dict(method="ngram", tree=BUSHY, max_new_tokens=235), r"the tree's 12 slots per round \(tree 3,4,12\) exceeds"),
    (dict(method="plain", tree=CHAIN), r"a draft tree needs a proposer"),
    (dict(method="layer_skip", exit_layer=1, tree=CHAIN, temperature=0.8, draft_sampling="sample"),
     r"draft_sampling='sample' applies to chains"),
    (dict(method="layer_skip", exit_layer=1, tree=(1, 100000, 3)), r"tree top_k \(100000\) exceeds the \d+ tokens"),
])
def test_bad_tree_requests_fail_before_compile(tiny_model, kwargs, message):
    with compilation.CompileWatch("a bad tree request") as watch:
        with pytest.raises(jaxspec.InvalidRequestError, match=message):
            jaxspec.generate(tiny_model, prompt=PROMPTS[0], **kwargs)
    assert watch.seconds == 0.0


def test_a_chain_fits_where_the_tree_overflows(tiny_model):
    """The context refusal above is the tree's: the same request with a chain of 4 is prepared."""
    prepared = jaxspec.prepare(tiny_model, prompt=PROMPTS[0], method="ngram", num_draft_tokens=4, max_new_tokens=235)
    assert prepared.spec.tree is None and prepared.spec.num_draft == 4


def test_qwen35_hybrid_targets_and_drafts_refuse_trees(tiny_model):
    """A DeltaNet layer keeps one recurrent state per position, not per tree node."""
    hybrid = jaxspec.Model(config=HYBRID, params=qwen35.init_params(HYBRID, jax.random.PRNGKey(0), 0.25))
    assert HYBRID.vocab_size == TINY.vocab_size  # so the hybrid is a valid draft but for the tree
    with compilation.CompileWatch("a tree on a hybrid") as watch:
        with pytest.raises(jaxspec.UnsupportedModelError, match="the target is a Qwen3.5 hybrid"):
            jaxspec.generate(hybrid, prompt=PROMPTS[0], method="ngram", tree=CHAIN)
        with pytest.raises(jaxspec.UnsupportedModelError, match="the draft is a Qwen3.5 hybrid"):
            jaxspec.generate(tiny_model, hybrid, PROMPTS[0], tree=CHAIN)
    assert watch.seconds == 0.0


def test_cli_refuses_a_bad_tree_in_one_line(capsys):
    """Checked before any model loads: the model path need not exist."""
    code, out, err = run(capsys, "generate", "hi", "--model", "/nonexistent", "--method", "ngram", "--tree", "2,0,3")
    assert code == cli.EXIT_BAD_INPUT and out == ""
    # The tree's top_k, not the sampling flag --top-k.
    assert err.strip().splitlines() == ["error: --tree: DraftTree top_k must be an integer >= 1; got 0"]
    code, out, err = run(capsys, "generate", "hi", "--model", "/nonexistent", "--method", "ngram", "--tree", "2,2,7")
    assert err.strip().splitlines() == [
        "error: --tree: DraftTree num_nodes (7) exceeds the 6 candidates a depth-2, top_k-2 tree grows "
        "(top_k + (depth - 1) * top_k^2)"]
    # Two numbers, not three: the tree's own format, its top_k not renamed to the sampling flag.
    code, out, err = run(capsys, "generate", "hi", "--model", "/nonexistent", "--method", "ngram", "--tree", "4,4")
    assert err.strip().splitlines() == [
        "error: --tree: tree must be a DraftTree, a (depth, top_k, num_nodes) triple or 'DEPTH,TOPK,NODES'; got '4,4'"]
