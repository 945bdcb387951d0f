"""A GGUF's tokenizer metadata as a `tokenizers` byte-level BPE, split the way llama.cpp splits.

A GGUF carries no `tokenizer.json`, only llama.cpp's description of one (tokens, merges, token
types and a pre-tokenizer *name*). The pre-tokenizer is rebuilt from the regexes llama.cpp uses for
that name (`src/llama-vocab.cpp`, `llm_tokenizer_bpe`), applied the way llama.cpp applies them: each
regex in turn splits every piece further, keeping matched and unmatched text as pieces (HF
`Split(behavior="isolated")`), then byte-level encoding without a regex of its own. jaxspec.tokenizer
wraps the result (BOS/EOS flags, chat template) as it wraps every other source.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers


class TokenType(enum.IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# --- llama.cpp pre-tokenizers -------------------------------------------------------------------
# The regexes are llama.cpp's (`llm_tokenizer_bpe` constructor), verbatim; llama.cpp rewrote the
# case-insensitive `(?i:'s|...)` of the original tokenizer.json files as `'[sS]|...`.

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreTokenizerSpec:
    """How llama.cpp splits text for one `tokenizer.ggml.pre` value."""

    regexes: tuple[str, ...]
    # llama.cpp looks a whole pre-token up in the vocab before merging (Llama 3's tokenizer.json
    # sets `ignore_merges` too): some of its tokens are not reachable by the merges alone.
    ignore_merges: bool = False
    # What llama.cpp assumes when the file has no `tokenizer.ggml.add_bos_token`.
    add_bos: bool = False


_DEFAULT_SPEC = PreTokenizerSpec(
    regexes=(r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]")
)
_GPT2_SPEC = PreTokenizerSpec(regexes=(_GPT2_REGEX,))
# Every digit is its own piece, then GPT-2's regex: SmolLM's tokenizer.json says the same as
# Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)].
_DIGITS_GPT2_SPEC = PreTokenizerSpec(regexes=(r"\p{N}", _GPT2_REGEX))
_LLAMA3_SPEC = PreTokenizerSpec(regexes=(_LLAMA3_REGEX,), ignore_merges=True, add_bos=True)
_QWEN2_SPEC = PreTokenizerSpec(regexes=(_QWEN2_REGEX,))

# `tokenizer.ggml.pre` -> spec; names and groupings as in llama.cpp's `llama_vocab::impl::load`.
PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": _DEFAULT_SPEC,
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais"), _GPT2_SPEC),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        _DIGITS_GPT2_SPEC,
    ),
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPEC,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _QWEN2_SPEC),
}



@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, in which byte-level vocabularies are spelled."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


@functools.cache
def _byte_level_alphabet() -> frozenset[str]:
    """The characters a byte-level vocabulary is spelled in (built once: a load checks ~50k tokens)."""
    return frozenset(_bytes_to_unicode().values())


def _byte_level_spelling(token: str) -> str:
    """A token as a byte-level vocabulary spells it; most GGUF tokens already are."""
    if _byte_level_alphabet().issuperset(token):
        return token
    alphabet = _bytes_to_unicode()
    return "".join(alphabet[byte] for byte in token.encode("utf-8"))


def byte_level_bpe(
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int],
    spec: PreTokenizerSpec,
) -> tokenizers.Tokenizer:
    """Byte-level BPE from llama.cpp's gpt2 vocabulary, with its special tokens made whole."""
    # Control, unknown and user-defined tokens are matched whole in the text before BPE runs (as
    # llama.cpp does), so they keep their literal spelling: re-spelling "<think>\n" byte-level would
    # make the added token a *new* id instead of the one the model was trained with.
    whole = {TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED}
    vocab: dict[str, int] = {}
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        spelled = token if token_type in whole else _byte_level_spelling(token)
        vocab.setdefault(spelled, token_id)
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges)
    hf = tokenizers.Tokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated") for regex in spec.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    hf.decoder = decoders.ByteLevel()
    added = [
        tokenizers.AddedToken(token, special=token_type != TokenType.USER_DEFINED, normalized=False)
        for token, token_type in zip(tokens, token_types, strict=True)
        if token_type in whole
    ]
    hf.add_special_tokens([token for token in added if token.special])
    hf.add_tokens([token for token in added if not token.special])
    return hf
