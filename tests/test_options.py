"""GenerateOptions (jaxspec.options): one set of defaults for generate, stream and the CLI, and
every setting checked when the options are made, before any model is touched."""

import dataclasses

import numpy as np
import pytest

import jaxspec
from jaxspec import cli
from jaxspec.cache import KVFormat
from jaxspec.options import GenerateOptions
from jaxspec.pallas.flash_decode import Attention
from jaxspec.spec.methods import Method


def test_defaults_are_normalised():
    options = GenerateOptions()
    assert options.method is None and options.num_draft_tokens is None and options.max_new_tokens == 128
    assert options.draft_options.num_draft_tokens == 4 and options.chat is None  # a chain of 4; the model's template
    assert options.attention is Attention.AUTO and options.stop == () and options.stop_token_ids == ()
    assert options.sampler.greedy and not options.sampler.top_p


def test_names_become_enums_and_sequences_tuples():
    options = GenerateOptions(method="ngram", kv_format=("q8_0", "q5_1"), stop="###", stop_token_ids=[5, 6])
    assert options.method is Method.NGRAM
    assert options.kv_format == KVFormat.parse(("q8_0", "q5_1"))
    assert options.stop == ("###",) and options.stop_token_ids == (5, 6)


def test_the_cli_takes_its_defaults_from_the_options():
    defaults = vars(cli.build_parser().parse_args(["generate", "hi"]))
    options = GenerateOptions()
    for name in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                 "num_draft_tokens", "chat"):
        assert defaults[name] == getattr(options, name), name
    assert defaults["attention"] == options.attention.value


def test_every_option_is_a_keyword(tiny_model):
    """generate and stream hand their keywords to `prepare`, which builds the options from them."""
    every = {field.name: getattr(GenerateOptions(), field.name) for field in dataclasses.fields(GenerateOptions)}
    assert jaxspec.prepare(tiny_model, prompt=[1, 2], **every).options == GenerateOptions()
    assert jaxspec.prepare(tiny_model, prompt=[1, 2], **{**every, "max_new_tokens": 7}).options.max_new_tokens == 7


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_draft_tokens=33), "num_draft_tokens must be an integer in"),
        (dict(num_draft_tokens=True), "num_draft_tokens must be an integer in"),
        (dict(exit_layer=0), "exit_layer must be an integer >= 1"),
        (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1"),
        (dict(temperature="hot"), "temperature must be a number"),
        (dict(temperature=[0.5, -1.0]), "temperature must be >= 0"),
        (dict(top_k=1.5), r"top_k must be an integer .*; got 1\.5$"),
        (dict(top_k=-3), r"top_k must be an integer .*; got -3$"),  # as given, not -3.0
        (dict(temperature=float("inf")), r"temperature must be >= 0; got inf$"),
        (dict(seed=1.0), "seed must be an integer"),
        (dict(seed=2**64), r"seed must be an integer in \[0, 2\*\*32\)"),
        (dict(seed=-1), "seed must be an integer in"),
        (dict(top_k=2**40), "top_k must be an integer in"),
        (dict(temperature="0.5"), "temperature must be a number"),
        (dict(stop=["ok", ""]), "stop must be a non-empty string or a sequence of them"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be a sequence of token ids"),
        (dict(stop_token_ids=1), "stop_token_ids must be a sequence of token ids"),
        (dict(stop=5), "stop must be a non-empty string or a sequence of them"),
        (dict(stop=["ok", "x\udcff"]), "stop string 1 holds .* at index 1, a lone surrogate"),
        (dict(chat="yes"), "chat must be True, False or None"),
        (dict(tree="3,4,12", num_draft_tokens=3), r"num_draft_tokens \(3\) and a tree \(3,4,12\) were both given"),
        (dict(ignore_eos=1), "ignore_eos must be True or False"),
        (dict(kv_format="q3"), "q3"),
        (dict(attention="fast"), "fast"),
        (dict(method="beam"), "method must be one of"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(jaxspec.JaxspecError, match=message):
        GenerateOptions(**kwargs)


def test_numpy_integers_are_taken_as_the_ints_they_are():
    options = GenerateOptions(max_new_tokens=np.int64(4), num_draft_tokens=np.int32(3), seed=np.uint32(7),
                              exit_layer=np.int16(2))
    assert (options.max_new_tokens, options.num_draft_tokens, options.seed, options.exit_layer) == (4, 3, 7, 2)
    assert all(type(value) is int for value in (options.max_new_tokens, options.seed, options.exit_layer))


def test_unknown_options_are_named():
    with pytest.raises(jaxspec.InvalidRequestError, match="max_tokens"):
        GenerateOptions.from_kwargs(max_tokens=4)
