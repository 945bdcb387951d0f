"""End to end on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers
loading the same GGUF file (`gguf_file=`), which dequantizes it with its own code path."""

from __future__ import annotations

import numpy as np
import pytest

import jaxspec
from jaxspec import checkpoints
from jaxspec.cache import KVCache
from jaxspec.models import llama
from tests.conftest import assert_same_greedy, max_relative_error, requires_default_model

pytestmark = [requires_default_model, pytest.mark.real_model]

# The shipped EAGLE-3 head (v2) reaches tau 1.56 at k = 4 on the two prompts of its test (v1:
# 1.52; greedy, so the figure is fixed; per Spec-Bench group in its model card); a random head
# stays at ~1.0. Below the measured figure, well above chance.
TRAINED_HEAD_MIN_TAU = 1.25

PROMPT = ("Speculative decoding lets a small draft model propose several tokens that the large "
          "model then verifies in a single forward pass. Explain why the output is unchanged:")


@pytest.fixture(scope="module")
def model():
    return jaxspec.load()


@pytest.fixture(scope="module")
def hf_model():
    import torch
    import transformers

    path = checkpoints.default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def _hf_logits(hf_model, ids):
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].numpy()


def test_default_model_config(model):
    cfg = model.config
    assert (cfg.num_layers, cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_embeddings and cfg.rotary_dim == 64 and cfg.rope_theta == 100000.0


def test_logits_on_a_64_token_prompt_match_transformers(model, hf_model):
    ids = model.tokenizer.encode(PROMPT * 3)[:64]
    assert len(ids) == 64
    logits, _, _ = llama.forward(model.params, model.config, np.asarray([ids], np.int32),
                                 KVCache.create(model.config, 1, 64))
    error = max_relative_error(logits[0], _hf_logits(hf_model, ids))
    assert error <= 1e-3, f"max relative logits error {error:.2e}"


def test_64_greedy_tokens_match_transformers(model, hf_model):
    import torch

    ids = model.tokenizer.encode_chat(PROMPT)
    ours = jaxspec.generate(model, None, ids, max_new_tokens=64, ignore_eos=True).tokens[0]
    with torch.no_grad():
        # An explicit all-ones mask: HF would otherwise mask every pad-id token in the prompt.
        reference = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=64, min_new_tokens=64,
                                      do_sample=False, eos_token_id=None, pad_token_id=2)[0, len(ids):]
    reference = reference.tolist()
    assert_same_greedy(ours, reference, lambda step: _hf_logits(hf_model, ids + reference[:step])[-1])


def test_batch_of_three_prompts_equals_each_alone(model):
    prompts = ["What is 17 times 3?", "Write one sentence about the sea.",
               "List three colours of the rainbow, then explain how rainbows form in two sentences."]
    batch = jaxspec.generate(model, None, prompts, chat=True, max_new_tokens=24)
    assert len({len(model.tokenizer.encode_chat(p)) for p in prompts}) == 3  # ragged prompts
    for row, prompt in enumerate(prompts):
        alone = jaxspec.generate(model, None, prompt, chat=True, max_new_tokens=24)
        assert batch.tokens[row] == alone.tokens[0]
        assert batch.text[row] == alone.text[0]


def test_chat_answer_is_sensible_and_stops_at_end_of_turn(model):
    result = jaxspec.generate(model, None, "What is the capital of France?", chat=True, max_new_tokens=48)
    assert "Paris" in result.text[0]
    assert result.finish_reason == ["stop"]
    assert result.tokens[0][-1] in model.tokenizer.eos_token_ids


def test_stream_text_equals_generate_text(model):
    stream = jaxspec.stream(model, prompt="Count from one to five in words.", chat=True, max_new_tokens=24)
    streamed = "".join(stream)
    whole = jaxspec.generate(model, None, "Count from one to five in words.", chat=True, max_new_tokens=24)
    assert streamed == whole.text[0] == stream.result.text[0]


def test_stop_string_cuts_text_and_stops(model):
    prompt = "Write a short poem about the sea."
    free = jaxspec.generate(model, None, prompt, chat=True, max_new_tokens=40)
    stop = " " + free.text[0].split()[5]  # a word from the middle of the free-running answer
    cut = free.text[0].index(stop)
    stopped = jaxspec.generate(model, None, prompt, chat=True, max_new_tokens=40, stop=stop)
    assert stopped.finish_reason == ["stop"]
    assert stopped.text[0] == free.text[0][:cut]
    assert len(stopped.tokens[0]) < len(free.tokens[0])  # it stopped on device, not just cut text


def test_seeded_sampling_is_reproducible(model):
    kwargs = dict(chat=True, max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=40)
    first = jaxspec.generate(model, None, "Tell me a story.", seed=11, **kwargs)
    again = jaxspec.generate(model, None, "Tell me a story.", seed=11, **kwargs)
    assert first.tokens == again.tokens


def _shortest_spec_bench(model, category: str, count: int) -> list[str]:
    """The `count` shortest first turns of a Spec-Bench category (short prompts keep the suite fast)."""
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "data" / "spec_bench" / "question.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [row["turns"][0] for row in rows if row["category"] == category]
    return sorted(prompts, key=lambda p: len(model.tokenizer.encode_chat(p)))[:count]


def _assert_rows_equal_plain_greedy(model, prompts, ours, plain):
    """Each chat prompt's speculative tokens equal its plain greedy ones (a divergence only at a
    near-tie of the full-recompute reference, shown)."""
    for row, prompt in enumerate(prompts):
        ids = model.tokenizer.encode_chat(prompt)
        reference = plain[row]

        def reference_logits_at(step):
            seq = ids + reference[:step]
            logits, _, _ = llama.forward(model.params, model.config, np.asarray([seq], np.int32),
                                         KVCache.create(model.config, 1, len(seq)))
            return logits[0, -1]

        assert_same_greedy(ours[row], reference, reference_logits_at)


def test_prompt_lookup_on_summarization_equals_plain_greedy(model):
    """96 tokens on 2 Spec-Bench summarization prompts, as one ragged batch."""
    prompts = _shortest_spec_bench(model, "summarization", 2)
    plain = jaxspec.generate(model, None, prompts, chat=True, max_new_tokens=96, ignore_eos=True)
    ngram = jaxspec.generate(model, None, prompts, chat=True, max_new_tokens=96, ignore_eos=True,
                             method="ngram", num_draft_tokens=4)
    _assert_rows_equal_plain_greedy(model, prompts, ngram.tokens, plain.tokens)
    stats = ngram.stats
    assert stats.tau > 1.3, f"prompt lookup on summarization should accept drafts; tau {stats.tau:.2f}"
    assert stats.target_forwards < plain.stats.target_forwards


def test_shipped_eagle3_head_loads_by_name_drafts_exactly_and_is_accepted(model):
    """The trained head in jaxspec/heads/: under the 25 MB budget, and on two chat prompts (in
    neither its training data nor Spec-Bench) its speculative output equals plain greedy while
    it is accepted far more often than chance (a random head gets tau ~1.0)."""
    path = checkpoints.packaged_head_path("eagle3-smollm2-135m")
    assert sum(f.stat().st_size for f in path.iterdir()) < 25_000_000
    head = jaxspec.load("EAGLE3-SmolLM2-135M")  # names are case-insensitive
    assert head.config.dim == model.config.dim and head.config.vocab_size == model.config.vocab_size
    assert head.source == str(path) and (path / "README.md").is_file()  # the model card
    prompts = ["Write a short travel blog post about a weekend in Lisbon.",
               "Explain how the human body fights a common cold."]
    plain = jaxspec.generate(model, None, prompts, chat=True, max_new_tokens=64, ignore_eos=True)
    spec = jaxspec.generate(model, head, prompts, chat=True, max_new_tokens=64, ignore_eos=True, num_draft_tokens=4)
    assert spec.stats.method == "eagle3"
    _assert_rows_equal_plain_greedy(model, prompts, spec.tokens, plain.tokens)
    assert spec.stats.tau > TRAINED_HEAD_MIN_TAU, spec.stats


def test_packaged_head_names_resolve_or_fail_clearly():
    with pytest.raises(jaxspec.CheckpointError, match="packaged head 'eagle3-none' is incomplete"):
        checkpoints.packaged_head_path("eagle3-none")
