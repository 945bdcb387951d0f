"""A GGUF's tokenizer metadata as a byte-level BPE (jaxspec.gguf_tokenizer): llama.cpp's splits.

The pre-tokenizer regexes are checked against the pieces llama.cpp produces for each
`tokenizer.ggml.pre` name, and against the original tokenizer.json regexes llama.cpp rewrote.
(The Tokenizer built on top, from GGUF metadata, is tested in test_tokenizer.py.)
"""

from __future__ import annotations

import pytest
from tokenizers import Regex, pre_tokenizers

from jaxspec import gguf_tokenizer

ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols: every text encodes


def split(pre: str, text: str) -> list[str]:
    """The byte-level pieces `pre`'s pre-tokenizer cuts `text` into."""
    spec = gguf_tokenizer.PRE_TOKENIZERS[pre]
    hf = gguf_tokenizer.byte_level_bpe(ALPHABET, [], [gguf_tokenizer.TokenType.NORMAL] * len(ALPHABET), spec)
    return [piece for piece, _ in hf.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        # llama.cpp's regexes for each name (src/llama-vocab.cpp), as byte-level pieces.
        ("smollm", "  12 ab", ["ĠĠ", "1", "2", "Ġab"]),
        ("gpt-2", "  12 ab", ["Ġ", "Ġ12", "Ġab"]),
        ("llama-bpe", "12345 I'M", ["123", "45", "ĠI", "'M"]),
        ("qwen2", "12345 I'M", ["1", "2", "3", "4", "5", "ĠI", "'M"]),
        # llama.cpp's default: punctuation runs, GPT-2, digit runs, then groups of three digits.
        ("default", "a,b 12345", ["a", ",", "b", "Ġ", "123", "45"]),
    ],
)
def test_pre_tokenizer_splits(pre, text, pieces):
    assert split(pre, text) == pieces


# The original tokenizer.json regexes (quoted in llama.cpp's comments beside its rewrites).
ORIGINAL_SPLITS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


@pytest.mark.parametrize("pre", sorted(ORIGINAL_SPLITS))
def test_llama_cpp_regexes_split_like_the_original_tokenizer_json(pre):
    """llama.cpp rewrote `(?i:'s|...)` as `'[sS]|...`; the splits must equal the original's."""
    reference = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(ORIGINAL_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    for text in ["I'M here, it's 2024!\n\n  ok\t\tx", "WE'LL see  123456 ÄÖ 日本\r\n", "  "]:
        expected = [piece for piece, _ in reference.pre_tokenize_str(text)]
        assert split(pre, text) == expected, text


def test_control_tokens_keep_their_spelling_and_match_whole():
    """A control token is matched whole in text (as llama.cpp does), never re-spelled byte-level,
    and a normal token with a space is spelled byte-level ("Ġ")."""
    normal, control = gguf_tokenizer.TokenType.NORMAL, gguf_tokenizer.TokenType.CONTROL
    tokens = [*ALPHABET, "<think>\n", " h", " hi"]
    types = [normal] * len(ALPHABET) + [control, normal, normal]
    hf = gguf_tokenizer.byte_level_bpe(tokens, ["Ġ h", "Ġh i"], types, gguf_tokenizer.PRE_TOKENIZERS["gpt2"])
    think, hi = len(ALPHABET), len(ALPHABET) + 2
    assert (hf.token_to_id("<think>\n"), hf.token_to_id("Ġhi")) == (think, hi)
    assert hf.encode("<think>\n hi", add_special_tokens=False).ids == [think, hi]
