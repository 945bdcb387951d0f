"""The public API (jaxspec.api): seeds, streaming, what recompiles, errors before compile, the
compile notice, and the Qwen3.5 hybrid under every KV format and a deep layer-skip draft."""

import dataclasses
import importlib
import inspect
import pathlib
import re
import typing

import jax
import pytest

import jaxspec
from jaxspec import api, checkpoints, compilation
from jaxspec.models import llama, qwen35
from jaxspec.models.qwen35 import LayerType, Qwen35Config
from jaxspec.tokenizer import Tokenizer
from tests.conftest import random_drafts
from tests.test_tokenizer import _tiny_metadata

score_lib = importlib.import_module("jaxspec.score")  # the module (jaxspec.score is also the function)

PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


def test_same_seed_same_sample(tiny_model):
    kwargs = dict(max_new_tokens=16, temperature=1.0, top_k=30, top_p=0.9, ignore_eos=True)
    first = jaxspec.generate(tiny_model, None, PROMPTS, seed=7, **kwargs)
    again = jaxspec.generate(tiny_model, None, PROMPTS, seed=7, **kwargs)
    other = jaxspec.generate(tiny_model, None, PROMPTS, seed=8, **kwargs)
    assert first.tokens == again.tokens
    assert first.tokens != other.tokens


def test_stream_yields_the_same_tokens(tiny_model):
    stream = jaxspec.stream(tiny_model, prompt=PROMPTS[2], max_new_tokens=10, ignore_eos=True)
    streamed = list(stream)
    whole = jaxspec.generate(tiny_model, None, PROMPTS[2], max_new_tokens=10, ignore_eos=True)
    assert streamed == whole.tokens[0] == stream.result.tokens[0]
    assert stream.result.stats.target_forwards == 9


def test_stream_compiles_both_programs_before_the_first_token(tiny_model, capsys):
    """On a terminal the notices go to stderr and the answer to stdout: every compile happens
    before the first token, so no notice lands inside the answer's first line."""
    capsys.readouterr()
    tokens = iter(jaxspec.stream(tiny_model, None, [1, 2, 3], method="ngram",
                                 num_draft_tokens=7, max_new_tokens=12, ignore_eos=True))  # a new k: new programs
    first = next(tokens)
    before_first = capsys.readouterr().err
    rest = list(tokens)
    assert [line.split(" [")[0] for line in before_first.splitlines() if "preparing" in line] == [
        "jaxspec: preparing prefill", "jaxspec: preparing decode round"]
    assert "preparing" not in capsys.readouterr().err
    assert len([first, *rest]) == 12


def test_what_does_not_recompile(tiny_model):
    """Within a prompt bucket and a max_new_tokens bucket, new stop tokens, EOS on or off and,
    when sampling, min_p on or off reuse the programs already compiled."""
    first = jaxspec.generate(tiny_model, None, [1, 2, 3], max_new_tokens=64)
    assert first.stats.compile_seconds >= 0.0
    for prompt, options in (([4, 5, 6, 7, 8, 9], dict(max_new_tokens=64)),
                            ([1, 2, 3], dict(max_new_tokens=65)),
                            ([7] * 16, dict(max_new_tokens=1)),
                            ([1, 2, 3], dict(max_new_tokens=64, stop_token_ids=[9, 10], ignore_eos=True))):
        again = jaxspec.generate(tiny_model, None, prompt, **options)
        assert again.stats.compile_seconds == 0.0, (len(prompt), options)
    jaxspec.generate(tiny_model, None, [1, 2, 3], max_new_tokens=8, temperature=0.8)
    with_min_p = jaxspec.generate(tiny_model, None, [1, 2, 3], max_new_tokens=8, temperature=0.8, min_p=0.1)
    assert with_min_p.stats.compile_seconds == 0.0


def test_a_new_shape_prints_one_notice_line_a_program_unless_silenced(tiny_model, capsys):
    capsys.readouterr()
    jaxspec.generate(tiny_model, None, [[1, 2]] * 5, max_new_tokens=4)  # batch 5: a new program
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxspec: preparing")]
    assert len(lines) == 2 and "prefill" in lines[0] and "decode loop" in lines[1] and "batch 5" in lines[0]
    assert all(" compiled in " in line for line in lines)
    jaxspec.generate(tiny_model, None, [[1, 2]] * 5, max_new_tokens=4)
    assert "preparing" not in capsys.readouterr().err  # compiled already
    jaxspec.set_compile_notices(False)
    try:
        jaxspec.generate(tiny_model, None, [[1, 2]] * 6, max_new_tokens=4)
    finally:
        jaxspec.set_compile_notices(True)
    assert "preparing" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt=[]), "non-empty"),
        (dict(prompt=[[1, 2], []]), "prompt 1 is empty"),
        (dict(prompt=[1, 128]), "token id 128 outside the vocabulary"),
        (dict(prompt=[1, -1]), "token id -1"),
        (dict(prompt=[[True, 5]]), "prompt 0 must be a string, a list of messages or a list of token ids"),
        (dict(prompt=b"\x01\x02"), "prompt is bytes"),
        (dict(prompt=[b"\x01\x02"]), "prompt 0 must be a string, a list of messages or a list of token ids"),
        (dict(prompt="text"), "no tokenizer"),
        (dict(prompt=[1], max_new_tokens=0), "max_new_tokens"),
        (dict(prompt=[1, 2], max_new_tokens=255), "exceeds the model's context of 256"),
        (dict(prompt=[1], temperature=-0.5), "temperature must be >= 0"),
        (dict(prompt=[1], top_p=0.0), "top_p must be in (0, 1]"),
        (dict(prompt=[1], top_p=1.5), "top_p must be in (0, 1]"),
        (dict(prompt=[1], top_k=-2), "top_k"),
        (dict(prompt=[1], min_p=2.0), "min_p"),
        (dict(prompt=[1], repetition_penalty=0.0), "repetition_penalty"),
        (dict(prompt=[1], stop_token_ids=[999]), "stop token id 999"),
        (dict(prompt=[1], stop="x"), "stop strings need a tokenizer"),
        (dict(prompt=[1], max_tokens=4), "unknown generate option"),
        (dict(prompt=[1], kv_format="q4"), "q4"),
    ],
)
def test_bad_requests_fail_before_compile_with_a_clear_message(tiny_model, kwargs, message):
    with compilation.CompileWatch("a bad request") as watch:
        with pytest.raises(jaxspec.JaxspecError, match=message.replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("]", r"\]")):
            jaxspec.generate(tiny_model, None, **kwargs)
    assert watch.seconds == 0.0


def test_a_kv_cache_larger_than_the_machine_is_refused_before_compile(tiny_model):
    """A model of a huge context and a request for 2**31 new tokens: 2**31 slots x 512 bytes a
    token is a TiB of KV cache, refused by prepare with the figures, not an allocation failure."""
    huge_context = dataclasses.replace(tiny_model, config=dataclasses.replace(tiny_model.config,
                                                                              max_position_embeddings=2**40))
    with compilation.CompileWatch("a request too large for memory") as watch:
        with pytest.raises(jaxspec.InvalidRequestError, match=r"the KV cache for 1 row\(s\) x \d+ slots needs"):
            jaxspec.generate(huge_context, None, [1, 2], max_new_tokens=2**31)
    assert watch.seconds == 0.0
    # bf16 halves the bytes; still far too large, and named the same way.
    with pytest.raises(jaxspec.InvalidRequestError, match="GiB"):
        jaxspec.generate(huge_context, None, [1, 2], max_new_tokens=2**31, kv_format="bf16")


def test_stream_takes_one_prompt(tiny_model):
    with pytest.raises(jaxspec.InvalidRequestError, match="one prompt"):
        jaxspec.stream(tiny_model, prompt=PROMPTS)


# ----------------------------------------------------------------------------------------------
# One call shape: generate, stream and prepare take (model, draft_params=None, prompt, **options)
# ----------------------------------------------------------------------------------------------


def test_generate_stream_and_prepare_take_the_same_arguments():
    def head(function):  # the parameters before the options
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()][:3]

    assert head(jaxspec.generate) == head(jaxspec.stream) == head(jaxspec.prepare) == [
        ("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
        ("draft_params", inspect.Parameter.POSITIONAL_OR_KEYWORD, None),
        ("prompt", inspect.Parameter.POSITIONAL_OR_KEYWORD, api.REQUIRED)]


def test_the_prompt_goes_third_or_by_name_and_is_required(tiny_model):
    by_name = jaxspec.prepare(tiny_model, prompt=[1, 2, 3], method="ngram")
    third = jaxspec.prepare(tiny_model, None, [1, 2, 3], method="ngram")
    assert by_name.rows == third.rows == [[1, 2, 3]]
    for call in (jaxspec.generate, jaxspec.stream, jaxspec.prepare):
        with pytest.raises(jaxspec.InvalidRequestError, match=r"no prompt given: pass it by name"):
            call(tiny_model, max_new_tokens=4)
        # The order before this API: the prompt second, where the draft goes.
        with pytest.raises(jaxspec.InvalidRequestError, match=r"draft_params is a list, not a Model: .* third"):
            call(tiny_model, [1, 2, 3])


def test_chat_defaults_to_the_models_template(tiny_model):
    """As in the CLI: a text prompt goes through the chat template when the tokenizer has one,
    raw when it has none or with chat=False."""
    templated = Tokenizer.from_gguf_metadata(_tiny_metadata())
    untemplated = Tokenizer.from_gguf_metadata(
        {k: v for k, v in _tiny_metadata().items() if k != "tokenizer.chat_template"})
    config = dataclasses.replace(tiny_model.config, vocab_size=templated.vocab_size)  # prepare reads no weight
    model = dataclasses.replace(tiny_model, config=config, tokenizer=templated)
    assert jaxspec.prepare(model, prompt="hello").rows == [templated.encode_chat("hello")]
    assert jaxspec.prepare(model, prompt="hello", chat=False).rows == [templated.encode("hello")]
    raw = dataclasses.replace(model, tokenizer=untemplated)
    assert jaxspec.prepare(raw, prompt="hello").rows == [untemplated.encode("hello")]
    assert templated.encode_chat("hello") != templated.encode("hello")


def _templated_model(tiny_model, chat_template: bool = True):
    """tiny_model with a byte-level tokenizer (a ChatML template, or none) and its vocabulary size
    (prepare reads no weight)."""
    metadata = _tiny_metadata()
    if not chat_template:
        del metadata["tokenizer.chat_template"]
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    config = dataclasses.replace(tiny_model.config, vocab_size=tokenizer.vocab_size)
    return dataclasses.replace(tiny_model, config=config, tokenizer=tokenizer)


def test_a_conversation_goes_through_the_template_whatever_chat_says(tiny_model):
    model = _templated_model(tiny_model)
    talk = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "world"}]
    expected = model.tokenizer.encode_chat(talk)
    for chat in (None, True, False):
        assert jaxspec.prepare(model, prompt=talk, chat=chat).rows == [expected]
    batch = jaxspec.prepare(model, prompt=[talk, talk[1:2], "hello"], chat=False).rows
    assert batch == [expected, model.tokenizer.encode_chat(talk[1:2]), model.tokenizer.encode("hello")]
    # score: the conversation as it stands, no cue for another turn.
    as_it_stands = model.tokenizer.encode_chat(talk, add_generation_prompt=False)
    assert score_lib._rows(model, talk, add_bos=None) == [as_it_stands]


@pytest.mark.parametrize("prompt, message", [
    ({"role": "user", "content": "hello"}, "prompt is one message; a conversation is a list of messages"),
    ([{"role": "user"}], r"prompt 0, message 0 needs a string 'content'; got None"),
    ([{"role": "user", "content": "hi"}, "hello"], r"prompt 0, message 1 must be a dict with 'role' and 'content'"),
    ([[{"role": 3, "content": "hi"}]], r"prompt 0, message 0 needs a string 'role'; got 3"),
    ([{"role": "user", "content": "hi\udcff"}], r"lone surrogate"),
])
def test_a_malformed_conversation_is_named(tiny_model, prompt, message):
    with pytest.raises(jaxspec.InvalidRequestError, match=message):
        jaxspec.prepare(_templated_model(tiny_model), prompt=prompt)


def test_a_conversation_needs_a_chat_template(tiny_model):
    talk = [{"role": "user", "content": "hello"}]
    for model in (_templated_model(tiny_model, chat_template=False), tiny_model):  # no template; no tokenizer
        with pytest.raises(jaxspec.InvalidRequestError, match="prompt 0 is a list of messages, but this model's "
                                                              "tokenizer has no chat template"):
            jaxspec.prepare(model, prompt=talk)


def test_logprobs_carry_each_tokens_text(tiny_model):
    tokenizer = Tokenizer.from_gguf_metadata(_tiny_metadata())
    cfg = dataclasses.replace(tiny_model.config, vocab_size=tokenizer.vocab_size)
    model = jaxspec.Model(config=cfg, params=llama.init_params(cfg, jax.random.PRNGKey(4), scale=0.2),
                          tokenizer=tokenizer)
    result = jaxspec.generate(model, prompt="hello world", max_new_tokens=6, ignore_eos=True, logprobs=3)
    entries = result.logprobs[0]
    assert [entry.token for entry in entries] == result.tokens[0]
    for entry in entries:
        assert entry.text == tokenizer.decode([entry.token], skip_special_tokens=False)
        assert entry.top_text == tuple(tokenizer.decode([token], skip_special_tokens=False) for token, _ in entry.top)
        assert len(entry.top_text) == 3
    assert "".join(entry.text for entry in entries) == tokenizer.decode(result.tokens[0], skip_special_tokens=False)
    assert all(entry.text is None and entry.top_text == () for entry in
               jaxspec.generate(tiny_model, prompt=[1, 2], max_new_tokens=2, logprobs=1).logprobs[0])


def test_a_tree_drafts_to_its_depth_and_refuses_a_num_draft_tokens(tiny_model):
    prepared = jaxspec.prepare(tiny_model, prompt=[1, 2, 3], method="ngram", tree="3,4,12")
    assert prepared.spec.num_draft == 3 and prepared.options.num_draft_tokens is None
    with pytest.raises(jaxspec.InvalidRequestError, match=r"num_draft_tokens \(4\) and a tree \(3,4,12\) were both"):
        jaxspec.prepare(tiny_model, prompt=[1, 2, 3], method="ngram", tree="3,4,12", num_draft_tokens=4)
    assert jaxspec.prepare(tiny_model, prompt=[1, 2, 3], method="ngram").spec.num_draft == 4  # a chain's default


def test_the_targets_own_mtp_head_is_read_once(tiny_model, monkeypatch):
    """method="mtp" with no draft reads the head the target's checkpoint carries: once per target."""
    head = random_drafts("mtp")["draft_params"]
    reads = []
    monkeypatch.setattr(checkpoints, "resolve_model", lambda source: pathlib.Path(source))
    monkeypatch.setattr(checkpoints, "is_mtp_head_dir", lambda path: False)
    monkeypatch.setattr(checkpoints, "has_mtp", lambda path: True)
    monkeypatch.setattr(checkpoints, "load_mtp", lambda path: reads.append(path) or (head.config, head.params))
    target = dataclasses.replace(tiny_model, source="target-dir")  # a Model of its own: no head read for it yet
    for _ in range(2):
        prepared = jaxspec.prepare(target, prompt=[1, 2, 3], method="mtp", num_draft_tokens=2)
        assert prepared.speculation.method is jaxspec.Method.MTP and prepared.speculation.draft.config == head.config
    assert reads == [pathlib.Path("target-dir")]


# ----------------------------------------------------------------------------------------------
# What a user can name: every type an option or load takes, every error raised for bad input
# ----------------------------------------------------------------------------------------------


def _jaxspec_classes(annotation) -> set[type]:
    """The jaxspec classes inside a type annotation (unions and generics walked)."""
    if isinstance(annotation, type):
        return {annotation} if annotation.__module__.startswith("jaxspec") else set()
    return {cls for arg in typing.get_args(annotation) for cls in _jaxspec_classes(arg)}


def test_every_option_type_is_exported():
    hints = [typing.get_type_hints(jaxspec.GenerateOptions)]
    hints += [typing.get_type_hints(function) for function in
              (jaxspec.load, jaxspec.generate, jaxspec.stream, jaxspec.prepare, jaxspec.score, jaxspec.shard)]
    named = {cls for hint in hints for name, annotation in hint.items() if name != "return"
             for cls in _jaxspec_classes(annotation)}
    assert {jaxspec.KVFormat, jaxspec.Attention, jaxspec.Method, jaxspec.DraftTree, jaxspec.WeightFormat,
            jaxspec.Products} <= named
    for cls in named:
        assert getattr(jaxspec, cls.__name__, None) is cls and cls.__name__ in jaxspec.__all__, cls


def test_every_user_error_is_exported_and_every_other_exception_is_internal():
    """Found in the source (so a new module's error is seen): every public exception class is a
    JaxspecError exported as jaxspec.<Name>, or an internal RuntimeError (a bug, not bad input:
    the CLI lets it keep its traceback)."""
    package = pathlib.Path(jaxspec.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        for name in re.findall(r"^class (\w+)\(", path.read_text(encoding="utf-8"), re.MULTILINE):
            if name.startswith("_"):
                continue
            module = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
            cls = getattr(importlib.import_module(module), name)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                found.append(cls)
    assert {jaxspec.GrammarError, jaxspec.ShardingError} <= set(found)
    for cls in found:
        if issubclass(cls, jaxspec.JaxspecError):
            assert getattr(jaxspec, cls.__name__, None) is cls and cls.__name__ in jaxspec.__all__, cls
        else:
            assert issubclass(cls, RuntimeError), f"{cls.__module__}.{cls.__name__} is neither"
    from jaxspec.cache import StateRollbackError

    assert StateRollbackError in found and not hasattr(jaxspec, "StateRollbackError")


# ----------------------------------------------------------------------------------------------
# The Qwen3.5 hybrid: KV formats, and a layer-skip draft deeper than the default state ring
# ----------------------------------------------------------------------------------------------

LIN, FULL = LayerType.LINEAR_ATTENTION, LayerType.FULL_ATTENTION
# head_dim 32: the q8_0 block tiles it. rollback_states 8 (the default) is too few for k = 12.
HYBRID = Qwen35Config(vocab_size=128, dim=64, num_layers=2, layer_types=(LIN, FULL), ffn_dim=96, num_heads=2,
                      num_kv_heads=1, head_dim=32, rotary_dim=4, rope_theta=10000.0, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                      max_position_embeddings=256)
HYBRID_PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [40, 41, 42, 40, 41, 42]]


@pytest.fixture(scope="module")
def hybrid():
    return jaxspec.Model(config=HYBRID, params=qwen35.init_params(HYBRID, jax.random.PRNGKey(0), 0.25))


@pytest.mark.parametrize("kv_format, attention, method, k",
                         [("q8_0", "auto", "layer_skip", 12), ("bf16", "reference", "ngram", 4)])
def test_hybrid_speculation_equals_plain_under_the_same_kv_format(hybrid, kv_format, attention, method, k):
    assert HYBRID.rollback_states < k + 2 or method != "layer_skip"
    kwargs = dict(max_new_tokens=24, ignore_eos=True, kv_format=kv_format, attention=attention)
    plain = jaxspec.generate(hybrid, None, HYBRID_PROMPTS, **kwargs)
    spec = jaxspec.generate(hybrid, None, HYBRID_PROMPTS, method=method, num_draft_tokens=k, **kwargs)
    assert spec.tokens == plain.tokens
    assert spec.stats.method == method and spec.stats.rounds > 0


def test_a_hybrid_layer_skip_draft_gets_a_ring_for_its_k(hybrid):
    prepared = jaxspec.prepare(hybrid, prompt=HYBRID_PROMPTS[0], method="layer_skip", num_draft_tokens=12)
    sized, draft = prepared.speculation.proposer.config, prepared.speculation.draft.config
    assert sized.rollback_states == 14  # k + 2: a row that already finished rolls back k + 1
    assert draft.rollback_states == HYBRID.rollback_states  # the draft Model itself is not changed
    assert dataclasses.replace(sized, rollback_states=HYBRID.rollback_states) == draft
