"""Speculation methods (jaxspec.spec.methods): one name everywhere, a builder per method, and
every request error a method can raise named before anything compiles."""

import dataclasses

import jax
import pytest

import jaxspec
from jaxspec import compilation
from jaxspec.models import eagle3, llama, mtp
from jaxspec.spec.drafting import DRAFTERS, Method, names
from tests.conftest import TINY


def test_every_method_is_a_registered_drafter():
    assert names() == ("plain", "ngram", "layer_skip", "draft", "eagle3", "mtp", "assistant")
    assert all(DRAFTERS[name].method == name and DRAFTERS[name].method is Method.parse(name) for name in names())
    assert Method.parse("layer_skip") is Method.LAYER_SKIP and Method.LAYER_SKIP == "layer_skip"


def test_the_method_is_inferred_from_the_draft(tiny_model):
    head = eagle3.Eagle3Config(dim=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=96, draft_vocab_size=96,
                               vocab_size=128, rope_theta=10000.0, rotary_dim=16, norm_eps=1e-6,
                               max_position_embeddings=256)
    assert Method.infer(None) is Method.PLAIN
    assert Method.infer(tiny_model) is Method.DRAFT
    assert Method.infer(jaxspec.layer_skip(tiny_model, 1)) is Method.LAYER_SKIP
    assert Method.infer(jaxspec.Model(config=head, params={})) is Method.EAGLE3
    assert Method.infer(jaxspec.Model(config=mtp.MtpConfig(block=TINY), params={})) is Method.MTP


def test_a_layer_skip_draft_passed_as_draft_params_reports_layer_skip(tiny_model):
    prepared = jaxspec.prepare(tiny_model, jaxspec.layer_skip(tiny_model, 1), [1, 2, 3])
    assert prepared.speculation.method is Method.LAYER_SKIP
    assert prepared.speculation.proposer.name == "layer_skip"
    draft_inputs = prepared.speculation.draft_inputs(tiny_model)
    assert draft_inputs.layers == tiny_model.params.layers[:1]  # the target's own first layer, not a copy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="ngram", num_draft_tokens=0), "num_draft_tokens must be an integer in"),
        (dict(method="ngram", num_draft_tokens=1000), "num_draft_tokens must be an integer in"),
        (dict(method="beam"), "method must be one of"),
        (dict(method="draft"), "needs draft_params"),
        (dict(method="eagle3"), "needs draft_params: an EAGLE-3 head"),
        (dict(method="layer_skip", exit_layer=2), "exit_layer must be an integer in"),
        (dict(method="ngram", exit_layer=1), "exit_layer applies to method='layer_skip' only"),
        (dict(method="ngram", temperature=0.5, draft_sampling="sample"), "no q for draft_sampling"),
        (dict(method="layer_skip", exit_layer=1, temperature=0.5, draft_sampling="best"), "draft_sampling must be one of"),
        (dict(method="ngram", max_new_tokens=248, num_draft_tokens=8), r"num_draft_tokens \(8\) exceeds"),
        (dict(method="ngram", ngram_min=3, ngram_max=2), "ngram_min <= ngram_max"),
        (dict(method="mtp"), "no source directory"),
    ],
)
def test_bad_speculative_requests_fail_before_compile(tiny_model, kwargs, message):
    with compilation.CompileWatch("a bad request") as watch:
        with pytest.raises(jaxspec.InvalidRequestError, match=message):
            jaxspec.generate(tiny_model, prompt=[1, 2, 3], **kwargs)
    assert watch.seconds == 0.0


def test_drafts_that_do_not_fit_the_target_are_refused(tiny_model):
    cfg = dataclasses.replace(TINY, vocab_size=64)
    other = jaxspec.Model(config=cfg, params=llama.init_params(cfg, jax.random.PRNGKey(3)))
    with pytest.raises(jaxspec.InvalidRequestError, match="vocabulary"):
        jaxspec.generate(tiny_model, other, [1, 2, 3])
    with pytest.raises(jaxspec.InvalidRequestError, match="method='plain' takes no draft_params"):
        jaxspec.generate(tiny_model, tiny_model, [1, 2, 3], method="plain")
    with pytest.raises(jaxspec.InvalidRequestError, match="not both"):
        jaxspec.generate(tiny_model, jaxspec.layer_skip(tiny_model, 1), [1, 2, 3], method="layer_skip", exit_layer=1)
    head = jaxspec.Model(config=mtp.MtpConfig(block=dataclasses.replace(TINY, dim=32)), params={})
    with pytest.raises(jaxspec.InvalidRequestError, match="hidden_size"):
        jaxspec.generate(tiny_model, head, [1, 2, 3])
