"""A GGUF's tokenizer metadata as a `tokenizers` tokenizer that splits and merges as llama.cpp does.

A GGUF carries no `tokenizer.json`, only llama.cpp's description of one. Two kinds are rebuilt:

  * "gpt2", byte-level BPE (tokens, merges, token types and a pre-tokenizer *name*): the
    pre-tokenizer is rebuilt from the regexes llama.cpp uses for that name (`src/llama-vocab.cpp`,
    `llm_tokenizer_bpe`), applied the way llama.cpp applies them: each regex in turn splits every
    piece further, keeping matched and unmatched text as pieces (HF `Split(behavior="isolated")`),
    then byte-level encoding without a regex of its own (`byte_level_bpe`);
  * "llama", sentencepiece BPE (tokens, scores, token types; no merges, no pre-tokenizer): spaces
    become "▁" and the whole text between special tokens is one word, merged best-scored piece
    first, characters outside the vocabulary as `<0xNN>` byte tokens (`sentencepiece_bpe`).

In both, control and user-defined tokens are cut out of the raw text first and kept whole.
jaxspec.tokenizer wraps the result (BOS/EOS flags, chat template) as it wraps every other source.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from jaxspec import spm


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


# Control, unknown and user-defined tokens are matched whole in the raw text before anything else
# runs (llama.cpp's `tokenizer_st_partition`), with their literal spelling.
_WHOLE = frozenset({TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED})


def _add_whole_tokens(hf: tokenizers.Tokenizer, tokens: Sequence[str], token_types: Sequence[int]) -> None:
    """Control and unknown tokens as special added tokens, user-defined ones as plain added tokens;
    all matched in the raw text (not normalized), leftmost-longest, as llama.cpp matches them."""
    added = [
        tokenizers.AddedToken(token, special=token_type != TokenType.USER_DEFINED, normalized=False)
        for token, token_type in zip(tokens, token_types, strict=True)
        if token_type in _WHOLE
    ]
    hf.add_special_tokens([token for token in added if token.special])
    hf.add_tokens([token for token in added if not token.special])


def byte_level_bpe(
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int],
    spec: PreTokenizerSpec,
) -> tokenizers.Tokenizer:
    """Byte-level BPE from llama.cpp's gpt2 vocabulary, with its special tokens made whole."""
    # Whole tokens keep their literal spelling: re-spelling "<think>\n" byte-level would make the
    # added token a *new* id instead of the one the model was trained with.
    vocab: dict[str, int] = {}
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        spelled = token if token_type in _WHOLE else _byte_level_spelling(token)
        vocab.setdefault(spelled, token_id)
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges)
    hf = tokenizers.Tokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated") for regex in spec.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    hf.decoder = decoders.ByteLevel()
    _add_whole_tokens(hf, tokens, token_types)
    return hf


def sentencepiece_bpe(
    tokens: Sequence[str],
    scores: Sequence[float],
    token_types: Sequence[int],
    *,
    add_space_prefix: bool,
    unk_token_id: int | None = None,
) -> tokenizers.Tokenizer:
    """Sentencepiece BPE from llama.cpp's "llama" (SPM) vocabulary, encoding as `llm_tokenizer_spm`.

    llama.cpp cuts whole tokens out of the raw text, then for each remaining fragment prepends " "
    when `add_space_prefix` (to every fragment: after a special token as at the start), writes
    spaces as "▁" and merges the fragment as one word: repeatedly the adjacent pair whose
    concatenation is the best-scored token. As BPE merges that is every split of a token into two
    tokens, ranked by the token's score (jaxspec.spm.bpe_merges, as for a tokenizer.model). A
    character no token covers becomes its UTF-8 bytes' `<0xNN>` tokens.

    The merge order follows the scores, as in llama.cpp and sentencepiece. (transformers orders
    Gemma's merges by file position instead, because it merges runs of spaces out of its "▁▁"
    tokens; here those are user-defined tokens stored as real spaces and matched whole, as llama.cpp
    and sentencepiece match them, so their -1000 scores never rank a merge. For Gemma's normal
    tokens the two orders are the same.)
    """
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    # Control, unknown and byte tokens are never merged into: they are cut out whole, or stand for
    # bytes (a text "<0x41>" is not the byte 0x41).
    mergeable: dict[str, float] = {}
    for token, score, token_type in zip(tokens, scores, token_types, strict=True):
        if token_type not in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.BYTE):
            mergeable.setdefault(token, score)
    byte_fallback = TokenType.BYTE in token_types
    unk = tokens[unk_token_id] if unk_token_id is not None and 0 <= unk_token_id < len(tokens) else None
    bpe = models.BPE(vocab=vocab, merges=spm.bpe_merges(vocab, mergeable), unk_token=unk, fuse_unk=True,
                     byte_fallback=byte_fallback)
    hf = tokenizers.Tokenizer(bpe)
    # Normalizers run on each fragment between whole tokens, so the prefix goes before every one
    # (Metaspace's prepend would skip a fragment already starting with a space: " a" -> "▁a", where
    # llama.cpp writes "▁▁a"). No pre-tokenizer: the fragment is one word, as in llama.cpp.
    hf.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(spm.SPACE)] if add_space_prefix else []) + [normalizers.Replace(" ", spm.SPACE)]
    )
    hf.decoder = spm.sentencepiece_decoder(strip_prefix=add_space_prefix)
    _add_whole_tokens(hf, tokens, token_types)
    return hf


# --- end of turn, chat templates -----------------------------------------------------------------

# The token texts llama.cpp takes for end-of-turn / end-of-generation when the file names none
# (`llama_vocab::impl::load`, "auto-detect special tokens by text" and `special_eog_ids`).
END_OF_TURN_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<end_of_utterance>",
)


def end_of_turn_ids(tokens: Sequence[str], token_types: Sequence[int]) -> list[int]:
    """Ids of the control or user-defined tokens whose text llama.cpp takes as ending a turn
    (`<end_of_turn>`, `<|eot_id|>`, `<|im_end|>`, ...), in id order."""
    texts = frozenset(END_OF_TURN_TEXTS)
    return [
        token_id
        for token_id, (token, token_type) in enumerate(zip(tokens, token_types, strict=True))
        if token in texts and token_type in (TokenType.CONTROL, TokenType.USER_DEFINED)
    ]


# Gemma 3's turn format: "<start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n...", the
# assistant written "model", a system message folded into the first user turn ahead of a blank
# line (as written; the turns' texts are trimmed), BOS written by the template (so encode_chat adds none).
_GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(prefix='') -%}"
    "{%- set turns = messages -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}"
    "{%- if system is string -%}{%- set ns.prefix = system -%}"
    "{%- else -%}{%- for part in system if part['type'] == 'text' -%}"
    "{%- set ns.prefix = ns.prefix + part['text'] -%}{%- endfor -%}{%- endif -%}"
    "{%- set ns.prefix = ns.prefix + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 is even) -%}"
    "{{ raise_exception('Gemma conversations alternate user and assistant turns, starting with user') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{%- if loop.first %}{{ ns.prefix }}{% endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' %}{{ part['text'] | trim }}"
    "{%- elif part['type'] == 'image' %}{{ '<start_of_image>' }}{% endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif -%}"
)

_BUILTIN_CHAT_TEMPLATES = {"gemma3": _GEMMA3_CHAT_TEMPLATE}


def builtin_chat_template(architecture: str) -> str | None:
    """The chat template for a GGUF `general.architecture` whose files carry none (Gemma 3's GGUFs
    have no `tokenizer.chat_template`); None for every other architecture."""
    return _BUILTIN_CHAT_TEMPLATES.get(architecture)
