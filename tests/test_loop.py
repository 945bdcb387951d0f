"""The on-device loop (jaxspec.spec.loop) on a tiny random model: greedy against full
recomputation, ragged batches, per-row stops, stop sequences, max_new_tokens, streaming rounds."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.cache import KVCache
from jaxspec.models import llama
from jaxspec.spec import loop
from tests.conftest import random_drafts
from tests.conftest import TINY

PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
forward = jax.jit(llama.forward, static_argnums=1)


def _greedy_by_recompute(params, prompt, steps):
    """Reference greedy: rerun the whole sequence every step from an empty cache, no cache reuse.

    The sequence is right-padded to one length (causal attention never reads the padding), so
    this compiles once, not once per length.
    """
    seq = list(prompt)
    width = len(prompt) + steps
    for _ in range(steps):
        padded = jnp.asarray([seq + [0] * (width - len(seq))])
        logits, _, _ = forward(params, TINY, padded, KVCache.create(TINY, 1, 64),
                               logit_indices=jnp.array([[len(seq) - 1]]))
        seq.append(int(jnp.argmax(logits[0, -1])))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def free_running(tiny_model):
    """Each prompt's greedy continuation, 20 tokens, EOS ignored (one batched run)."""
    return jaxspec.generate(tiny_model, None, PROMPTS, max_new_tokens=20, ignore_eos=True).tokens


def test_greedy_matches_full_recompute(tiny_model):
    result = jaxspec.generate(tiny_model, None, PROMPTS[0], max_new_tokens=24, ignore_eos=True)
    assert result.tokens[0] == _greedy_by_recompute(tiny_model.params, PROMPTS[0], 24)
    assert result.finish_reason == ["length"]
    assert result.stats.new_tokens == 24 and result.stats.target_forwards == 23


def test_batch_rows_equal_each_prompt_alone(tiny_model, free_running):
    for row, prompt in enumerate(PROMPTS):
        alone = jaxspec.generate(tiny_model, None, prompt, max_new_tokens=20, ignore_eos=True)
        assert free_running[row] == alone.tokens[0]


def test_eos_stops_a_row_and_keeps_the_eos(tiny_model, free_running):
    free = free_running[1]
    stop_token = free[5]
    first_hit = free.index(stop_token)
    result = jaxspec.generate(tiny_model, None, PROMPTS[1], max_new_tokens=20, stop_token_ids=[stop_token],
                              ignore_eos=True)
    assert result.tokens[0] == free[: first_hit + 1]
    assert result.finish_reason == ["stop"]


def test_multi_token_stop_sequence_on_device(tiny_model, free_running):
    free = free_running[0]
    sequence = tuple(free[6:9])
    prepared = jaxspec.prepare(tiny_model, prompt=PROMPTS[0], max_new_tokens=20, ignore_eos=True)
    spec = dataclasses.replace(prepared.spec, stop_sequences=(sequence,))
    state = loop.decode_jit(tiny_model.params, None, loop.prefill_jit(tiny_model.params, None, prepared.request, spec=spec),
                            prepared.request, spec=spec)
    end = next(i for i in range(2, 20) if tuple(free[i - 2:i + 1]) == sequence)
    assert loop.generated_tokens(state, 1)[0] == free[: end + 1]
    assert int(state.finish_reason[0]) == loop.FINISH_STOP


def test_rows_finish_independently(tiny_model, free_running):
    stop_token = free_running[0][2]
    result = jaxspec.generate(tiny_model, None, PROMPTS, max_new_tokens=20, stop_token_ids=[stop_token],
                              ignore_eos=True)
    for row in range(3):
        free = free_running[row]
        expected = free[: free.index(stop_token) + 1] if stop_token in free else free
        assert result.tokens[row] == expected
    assert result.finish_reason[0] == "stop"


def test_stream_step_reports_exactly_the_tokens_it_committed(tiny_model, free_running):
    """The streaming round hands the host only the round's tokens; together they are the output."""
    prepared = jaxspec.prepare(tiny_model, tiny_model, PROMPTS, max_new_tokens=20, ignore_eos=True,
                               num_draft_tokens=3)
    args = (tiny_model.params, prepared.speculation.draft_inputs(tiny_model))
    state = loop.prefill_jit(*args, prepared.request, spec=prepared.spec)
    streamed = [[int(t)] for t in np.asarray(state.pending)]
    while bool(np.any(np.asarray(state.running))):
        state, committed = loop.stream_step_jit(*args, state, prepared.request, spec=prepared.spec)
        chex.assert_shape(committed.tokens, (3, 4))  # [B, k + 1]
        for row in range(3):
            streamed[row] += np.asarray(committed.tokens)[row, : int(committed.count[row])].tolist()
    assert streamed == free_running  # a draft equal to the target accepts all: counts of 4


@pytest.mark.parametrize("max_new", [7, 9, 10])
def test_max_new_tokens_is_never_overshot(tiny_model, free_running, max_new):
    result = jaxspec.generate(tiny_model, tiny_model, PROMPTS, max_new_tokens=max_new, ignore_eos=True,
                              num_draft_tokens=4)
    assert result.tokens == [free[:max_new] for free in free_running]
    assert result.finish_reason == ["length"] * 3


def test_eos_inside_accepted_drafts_ends_the_row_there(tiny_model, free_running):
    stop = free_running[0][6]  # mid-round for k = 4 (rounds commit 5 tokens after the prefill's first)
    kwargs = dict(ignore_eos=True, stop_token_ids=[stop], max_new_tokens=20)
    reference = jaxspec.generate(tiny_model, None, PROMPTS, **kwargs)
    result = jaxspec.generate(tiny_model, tiny_model, PROMPTS, num_draft_tokens=4, **kwargs)
    assert result.tokens == reference.tokens
    assert result.finish_reason == reference.finish_reason
    assert result.tokens[0][-1] == stop and len(result.tokens[0]) == free_running[0].index(stop) + 1


def _dot_precisions(program_text: str) -> list[str]:
    """The `precision = [...]` of every dot_general in a lowered program's StableHLO."""
    dots = [line for line in program_text.splitlines() if "stablehlo.dot_general" in line]
    return [line.split("precision = ")[1].split("]")[0] + "]" if "precision = " in line else "(none)"
            for line in dots]


def test_every_engine_program_traces_float32_products_at_full_precision_on_a_gpu(tiny_model, monkeypatch):
    """On a GPU XLA's default float32 product is TF32, which rounds a T = 1 step and a T = k + 1
    verify differently (on an H200 speculative greedy left plain greedy); the engine's programs
    pin full precision there themselves, whatever the caller's setting (jaxspec.compilation).
    On CPU they are left as they were. The GPU's choice is forced here and lowered for CPU."""
    import importlib

    from jaxspec import compilation

    score = importlib.import_module("jaxspec.score")  # the module, not jaxspec.score the function
    prepared = jaxspec.prepare(tiny_model, tiny_model, PROMPTS, max_new_tokens=4, ignore_eos=True,
                               num_draft_tokens=2)
    args = (tiny_model.params, prepared.speculation.draft_inputs(tiny_model))

    def lowered_programs():
        jax.clear_caches()  # jit's trace cache does not key on the backend check
        state = jax.eval_shape(lambda: loop.prefill_jit(*args, prepared.request, spec=prepared.spec))
        return {
            "prefill": loop.prefill_jit.lower(*args, prepared.request, spec=prepared.spec),
            "decode": loop.decode_jit.lower(*args, state, prepared.request, spec=prepared.spec),
            "stream_step": loop.stream_step_jit.lower(*args, state, prepared.request, spec=prepared.spec),
            "score": score.score_chunk_jit.lower(tiny_model.params, KVCache.create(TINY, 1, 8),
                                                 jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32),
                                                 cfg=TINY),
        }

    with jax.default_matmul_precision("default"):  # the caller's context asks for the GPU default
        on_cpu = lowered_programs()
        monkeypatch.setattr(compilation, "pins_full_precision", lambda: True)
        on_gpu = lowered_programs()
    monkeypatch.undo()
    jax.clear_caches()  # later tests trace their CPU programs afresh
    for name in on_gpu:
        pinned = _dot_precisions(on_gpu[name].as_text())
        assert pinned and set(pinned) == {"[HIGHEST, HIGHEST]"}, (name, sorted(set(pinned)))
        assert set(_dot_precisions(on_cpu[name].as_text())) == {"[DEFAULT, DEFAULT]"}, name


@pytest.mark.parametrize("draft", [None, "model"], ids=["plain", "draft-model"])
def test_a_batch_of_one_writes_its_kv_cache_in_place(tiny_model, draft):
    """At batch 1 a decode step writes one K/V entry per layer. XLA:CPU turns a one-window
    scatter into a dynamic-update-slice and duplicates it into each reader, copying every layer's
    whole buffer several times a step (29% of the default model's q4 step); `cache.write_rows`
    keeps it a scatter. The compiled decode loop must copy no buffer of a KV cache's shape."""
    from tests.conftest import ENGINE_COMPILER_OPTIONS

    options = dict(num_draft_tokens=2) if draft else {}
    prepared = jaxspec.prepare(tiny_model, tiny_model if draft else None, [[5, 6, 7]], max_new_tokens=4,
                               ignore_eos=True, **options)
    args = (tiny_model.params, prepared.speculation.draft_inputs(tiny_model))
    state = jax.eval_shape(lambda: loop.prefill_jit(*args, prepared.request, spec=prepared.spec))
    program = loop.decode_jit.lower(*args, state, prepared.request, spec=prepared.spec).compile(
        compiler_options=ENGINE_COMPILER_OPTIONS).as_text()
    kv_shapes = {"f32[%s]" % ",".join(map(str, buffer.shape)) for buffer in state.cache.keys}
    copied = [line.split(" copy(")[0].split("= ")[1] for line in program.splitlines() if " copy(" in line]
    assert kv_shapes and not [shape for shape in copied if shape.split("{")[0] in kv_shapes], copied


def test_methods_that_read_no_target_stream_share_one_compiled_prefill(tiny_model):
    """Plain decoding, prompt lookup and a draft model differ only in the proposer the prefill
    sets up: the trunk's prefill (`prefill_target`) compiles once for all three, at one shape;
    EAGLE-3, which reads three of the target's streams, gets a prefill of its own."""
    prompt = [[3, 4, 5, 3, 4, 5, 3, 4]] * 3  # a batch of 3: a shape no other test compiles
    target_before, start_before = loop.prefill_target_jit._cache_size(), loop.start_jit._cache_size()
    outputs = [jaxspec.generate(tiny_model, prompt=prompt, max_new_tokens=6, ignore_eos=True, **drafts)
               for drafts in ({}, random_drafts("ngram"), random_drafts("draft"), random_drafts("eagle3"))]
    assert loop.prefill_target_jit._cache_size() - target_before == 2  # plain/ngram/draft, and eagle3's
    assert loop.start_jit._cache_size() - start_before == 4
    assert all(out.tokens == outputs[0].tokens for out in outputs)  # greedy: every method equals plain
