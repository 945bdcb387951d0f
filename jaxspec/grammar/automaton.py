"""The host half of constrained generation: a regex, a JSON schema or a list of choices compiled
into a token automaton over the model's vocabulary (`compile_grammar`, cached per tokenizer).
See the package docstring for what is kept and why; `jaxspec.grammar.table` puts a batch of
these on device.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxspec.errors import InvalidRequestError, check_text, is_integer

class GrammarError(InvalidRequestError):
    """A regex / JSON schema / choices request that cannot be compiled into a token automaton."""


def _one_line(error: BaseException) -> str:
    """An outlines-core error message as one line (its schema errors add advice on further lines)."""
    text = str(error).strip()
    return text.splitlines()[0].strip() if text else type(error).__name__


# --- vocabulary bytes ----------------------------------------------------------------------------

SPACE = "\u2581"  # sentencepiece's visible space, "▁"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _unicode_to_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable character -> the byte it spells."""
    from jaxspec.gguf_tokenizer import _bytes_to_unicode

    return {char: byte for byte, char in _bytes_to_unicode().items()}


def _byte_level(token: str) -> bytes:
    # As tokenizers' ByteLevel decoder: a token spelled wholly in the alphabet is those bytes; one
    # that is not (an added token kept literal, "<think>\n") is its own UTF-8.
    alphabet = _unicode_to_bytes()
    try:
        return bytes(alphabet[char] for char in token)
    except KeyError:
        return token.encode("utf-8")


def _decoder_steps(decoder: Mapping[str, Any] | None) -> list:
    """The per-token decoding steps of a tokenizer.json decoder, as functions str|bytes -> str|bytes.

    Steps that act on the whole text rather than a token (Fuse, and a Strip after it: the
    sentencepiece dummy-prefix space at the very start of a text) do not change a token's bytes in
    the middle of generated text and are skipped, as outlines-core does.
    """
    if decoder is None:
        raise GrammarError("constrained generation needs a tokenizer with a decoder; this one has none")
    kind = decoder.get("type")
    if kind == "ByteLevel":
        return [lambda piece: _byte_level(piece) if isinstance(piece, str) else piece]
    if kind == "Metaspace":
        replacement = decoder.get("replacement", SPACE)
        return [lambda piece: piece.replace(replacement, " ") if isinstance(piece, str) else piece]
    if kind == "Replace":
        pattern, content = decoder.get("pattern", {}), decoder.get("content")
        if not isinstance(pattern, Mapping) or "String" not in pattern or not isinstance(content, str):
            raise GrammarError(f"tokenizer decoder Replace with pattern {pattern!r:.60} is not supported "
                               "for constrained generation (only a plain string pattern)")
        old = pattern["String"]
        return [lambda piece: piece.replace(old, content) if isinstance(piece, str) else piece]
    if kind == "ByteFallback":
        def byte_fallback(piece):
            match = _BYTE_PIECE.fullmatch(piece) if isinstance(piece, str) else None
            return bytes([int(match.group(1), 16)]) if match else piece
        return [byte_fallback]
    if kind == "Sequence":
        steps, fused = [], False
        for part in decoder.get("decoders", []):
            part_kind = part.get("type") if isinstance(part, Mapping) else None
            if part_kind == "Fuse":  # joins the tokens into one text: no change to any token's bytes
                fused = True
            elif part_kind == "Strip":
                if not fused:  # a Strip before Fuse would cut every token; no tokenizer we know does it
                    raise GrammarError("tokenizer decoder Strip before Fuse is not supported for constrained "
                                       "generation")
            else:
                steps += _decoder_steps(part)
        return steps
    raise GrammarError(f"tokenizer decoder {kind!r} is not supported for constrained generation "
                       "(supported: ByteLevel, Metaspace, and sentencepiece-style Replace/ByteFallback/Fuse/Strip)")


def token_bytes(tokenizer) -> tuple[list[bytes | None], frozenset[int]]:
    """The raw bytes each id of `tokenizer` (a jaxspec Tokenizer) stands for, and its special ids.

    Entry i is None for an id the tokenizer has no token for. Special added tokens (special=True)
    are listed in the second value; their bytes are not meaningful text.
    """
    hf = tokenizer.hf_tokenizer
    steps = _decoder_steps(json.loads(hf.to_str()).get("decoder"))
    special = frozenset(i for i, added in hf.get_added_tokens_decoder().items() if added.special)
    pieces: list[bytes | None] = []
    for token_id in range(tokenizer.vocab_size):
        piece = hf.id_to_token(token_id)
        if piece is not None:
            for step in steps:
                piece = step(piece)
            piece = piece.encode("utf-8") if isinstance(piece, str) else piece
        pieces.append(piece)
    return pieces, special


# outlines-core 0.2.14's Index drops every token that ends exactly one byte after a point where the
# whole regex could have matched, unless the text is complete there (regex-automata reports matches
# one byte late, and Index::new takes that delayed "match state" for "no longer intermediate";
# fixed upstream after the release, in 2ba0b24 "avoid generating incomplete automata"). With "0(xx)?"
# the token "x" after "0" is missing, and choices ["yes", "yesterday"] cannot spell "yesterday" one
# letter at a time. So the regex is compiled with an end marker, `(?:R)` + END, which no real token
# spells: the whole pattern then matches only after END, and no real token ends one byte past it.
# A state is final for R when the END token leads from it to a complete match.
# Every single byte is a fake token as well: outlines-core refuses a whole regex when any state it
# reaches has no token out (a real token spelling a prefix of END; a branch needing a character the
# vocabulary lacks), so with them it never does, and the pruning here decides instead: fake tokens
# are dropped, then every state that cannot reach a final state with real tokens.
END = "\U0010FFFD"  # a private-use code point: F4 8F BF BD
END_REGEX = "\\x{10FFFD}"


class _Vocabulary:
    """One tokenizer's vocabulary for one model vocab_size: outlines-core's Vocabulary, built once,
    with END and the single bytes as fake tokens at ids past every real one."""

    def __init__(self, tokenizer, vocab_size: int):
        import outlines_core

        limit = min(tokenizer.vocab_size, vocab_size)  # ids the model cannot emit or the tokenizer lacks
        self.eos_token_ids = tuple(i for i in tokenizer.eos_token_ids if 0 <= i < limit)
        if not self.eos_token_ids:
            raise GrammarError("constrained generation needs an EOS token to end the grammar; the tokenizer "
                               f"names none below vocab_size={vocab_size}")
        pieces, special = token_bytes(tokenizer)
        by_bytes: dict[bytes, list[int]] = collections.defaultdict(list)
        for token_id in range(limit):
            piece = pieces[token_id]
            # EOS ids are rebuilt by build_table; an empty token would be a step without progress.
            if piece and token_id not in special and token_id not in self.eos_token_ids:
                by_bytes[piece].append(token_id)
        if not by_bytes:
            raise GrammarError("the tokenizer has no ordinary tokens to build a grammar from")
        self.first_fake_id = max(tokenizer.vocab_size, vocab_size)  # ids >= it are not real tokens
        self.end_id = self.first_fake_id  # END, then the 256 single bytes
        by_bytes[END.encode("utf-8")].append(self.end_id)
        for byte in range(256):
            by_bytes[bytes([byte])].append(self.end_id + 1 + byte)
        self.outlines = outlines_core.Vocabulary(self.eos_token_ids[0], dict(by_bytes))


# --- compile -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, arrays inside
class Grammar:
    """A compiled token automaton (host numpy arrays); build_table puts a batch of them on device.

    States are 0..num_states-1, initial 0. `src`, `token`, `dst` (int32 [N], sorted by (src,
    token)) are every allowed non-EOS transition; EOS ids (`eos_token_ids`) are allowed in exactly
    the `final` (bool [Q]) states and lead to DONE. Special tokens and ids past the tokenizer's
    vocabulary never appear.
    """

    kind: str  # "regex" | "json_schema" | "choices"
    source: str  # the request: the regex, the schema's JSON text, or the choices as a JSON list
    regex: str  # the regex compiled
    vocab_size: int
    num_states: int
    src: np.ndarray  # int32 [N]
    token: np.ndarray  # int32 [N]
    dst: np.ndarray  # int32 [N]
    final: np.ndarray  # bool [Q]
    eos_token_ids: tuple[int, ...]
    outlines_state: np.ndarray  # int64 [Q]: our state -> the state id in outlines-core's Index (debugging)

    @property
    def initial_state(self) -> int:
        return 0

    @property
    def num_transitions(self) -> int:
        return int(self.src.shape[0])

    def __repr__(self) -> str:
        return (f"Grammar(kind={self.kind!r}, regex={self.regex!r:.80}, num_states={self.num_states}, "
                f"num_transitions={self.num_transitions})")


# The Rust regex syntax's metacharacters (regex-syntax `is_meta_character`): escaped with a backslash.
_RUST_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _escape(text: str) -> str:
    """`text` as a Rust regex matching exactly it: metacharacters backslashed, whitespace and other
    non-printing characters as \\x{...} (literal is fine for the rest, unicode included)."""
    out = []
    for char in text:
        if char in _RUST_META:
            out.append("\\" + char)
        elif char == " " or char.isprintable():
            out.append(char)
        else:
            out.append(f"\\x{{{ord(char):X}}}")
    return "".join(out)


def _request(regex, json_schema, choices) -> tuple[str, str, str]:
    """(kind, source, regex) of a request, validated; GrammarError naming what is wrong."""
    given = [name for name, value in (("regex", regex), ("json_schema", json_schema), ("choices", choices))
             if value is not None]
    if len(given) != 1:
        raise GrammarError("give exactly one of regex, json_schema, choices"
                           + (f"; got {', '.join(given)}" if given else "; got none"))
    if regex is not None:
        if not isinstance(regex, str):
            raise GrammarError(f"regex must be a str, got {type(regex).__name__}")
        check_text(regex, "regex")
        if not regex:
            raise GrammarError("regex is empty: it matches only the empty string")
        return "regex", regex, regex
    if json_schema is not None:
        if isinstance(json_schema, str):
            check_text(json_schema, "json_schema")
            try:
                schema = json.loads(json_schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"json_schema is not valid JSON ({e}): in Python it is a dict or JSON text; to "
                                   f"use a schema file, pass json.load(open(path)) (the CLI's --json-schema takes "
                                   f"a file)") from None
            except RecursionError:
                raise GrammarError("json_schema is nested too deeply") from None
        elif isinstance(json_schema, Mapping):
            schema = json_schema
        else:
            raise GrammarError(f"json_schema must be JSON text or a dict, got {type(json_schema).__name__}")
        if not isinstance(schema, Mapping):
            raise GrammarError(f"json_schema must be a JSON object, got a JSON {type(schema).__name__}")
        try:
            source = json.dumps(schema, ensure_ascii=False)  # key order kept: it orders the properties
        except (TypeError, ValueError) as e:
            raise GrammarError(f"json_schema is not JSON-serialisable: {e}") from None
        from outlines_core.json_schema import build_regex_from_schema

        try:
            pattern = build_regex_from_schema(source)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 (a pyo3 PanicException is not an Exception)
            raise GrammarError(f"json_schema cannot be compiled: {_one_line(e)}") from None
        return "json_schema", source, pattern
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
        raise GrammarError(f"choices must be a list of strings, got {type(choices).__name__}")
    if not choices:
        raise GrammarError("choices is empty: give at least one choice")
    for i, choice in enumerate(choices):
        if not isinstance(choice, str):
            raise GrammarError(f"choices[{i}] is a {type(choice).__name__}, not a str")
        if not choice:
            raise GrammarError(f"choices[{i}] is an empty string")
        check_text(choice, f"choices[{i}]")
    unique = list(dict.fromkeys(choices))
    return "choices", json.dumps(unique, ensure_ascii=False), "(?:" + "|".join(map(_escape, unique)) + ")"


def _live_order(pairs_src: np.ndarray, pairs_dst: np.ndarray, initial: int, final: np.ndarray) -> list[int]:
    """The states on some path from `initial` to a final state, initial first then breadth-first.

    The graph is given by its distinct (src, dst) edges (a few thousand even when the transitions
    number millions) over states 0..len(final)-1.
    """
    reverse: dict[int, list[int]] = collections.defaultdict(list)
    forward: dict[int, list[int]] = collections.defaultdict(list)
    for source, target in zip(pairs_src.tolist(), pairs_dst.tolist()):
        reverse[target].append(source)
        forward[source].append(target)
    coreachable = set(np.flatnonzero(final).tolist())  # states that can reach a final state
    frontier = list(coreachable)
    while frontier:
        for parent in reverse.get(frontier.pop(), ()):
            if parent not in coreachable:
                coreachable.add(parent)
                frontier.append(parent)
    if initial not in coreachable:
        return []
    order, seen = [initial], {initial}
    for state in order:  # grows while iterating: breadth-first
        for target in forward.get(state, ()):
            if target in coreachable and target not in seen:
                seen.add(target)
                order.append(target)
    return order


def _without_anchors(pattern: str) -> str:
    """`pattern` less a leading `^` / `\\A` and a final unescaped `$` / `\\z`: a match is the whole
    output anyway, and outlines-core refuses anchors (its DFA then has no universal start state)."""
    for anchor in ("^", "\\A"):
        if pattern.startswith(anchor):
            pattern = pattern[len(anchor):]
            break
    for anchor in ("$", "\\z"):
        head = pattern[: -len(anchor)]
        if pattern.endswith(anchor) and (len(head) - len(head.rstrip("\\"))) % 2 == 0:
            return head
    return pattern


@functools.cache
def _byte_vocabulary():
    """The 256 single bytes as a vocabulary: an Index over it checks that a regex parses (cheaply:
    256 tokens, not the model's vocabulary)."""
    import outlines_core

    return outlines_core.Vocabulary(256, {bytes([byte]): [byte] for byte in range(256)})


def _python_diagnosis(pattern: str) -> str:
    """Where Python's own regex parser finds the error, when it does: outlines-core's message
    ("error building NFA") does not say. Python's syntax is close to Rust's for this purpose."""
    try:
        re.compile(pattern)
    except re.error as error:
        return f" ({error})"
    except (RecursionError, OverflowError):
        pass
    return ""


def _build(vocabulary: _Vocabulary, vocab_size: int, kind: str, source: str, pattern: str) -> Grammar:
    import outlines_core

    if kind == "regex":
        pattern = _without_anchors(pattern)
    marked = f"(?:{pattern}){END_REGEX}"
    try:
        if kind == "regex":  # alone first: "a)(b" is invalid, but "(?:a)(b)" + END would parse
            outlines_core.Index(pattern, _byte_vocabulary())
        index = outlines_core.Index(marked, vocabulary.outlines)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001
        message = _one_line(e).replace(repr(marked), repr(pattern)).replace(marked, pattern)
        if "incompatible with the regex" in message or "no transitions" in message.lower():
            raise GrammarError(f"{kind} has no path through the vocabulary: {message}") from None
        if "universal start state" in message:
            message += " (anchors such as ^, $ and \\b inside a pattern are not supported)"
        what = f"regex {pattern!r:.80}" if kind == "regex" else f"{kind} (as the regex {pattern!r:.80})"
        raise GrammarError(f"invalid {what}: {message}{_python_diagnosis(pattern)}") from None
    # {state: {token: next state}}; flattened with C-speed fromiter (a free-text state has ~40k
    # entries, a grammar can have millions).
    transitions = index.get_transitions()
    states = list(transitions)
    counts = [len(edges) for edges in transitions.values()]
    src = np.repeat(np.asarray(states, np.int64), counts)  # [N] (outlines' state ids)
    tok = np.concatenate([np.zeros(0, np.int64)] + [np.fromiter(edges.keys(), np.int64, len(edges))
                                                    for edges in transitions.values()])
    dst = np.concatenate([np.zeros(0, np.int64)] + [np.fromiter(edges.values(), np.int64, len(edges))
                                                    for edges in transitions.values()])
    complete = np.asarray(list(index.get_final_states()), np.int64)  # END read: the marked pattern matched
    finals = set(src[(tok == vocabulary.end_id) & np.isin(dst, complete)].tolist())  # final for R
    # EOS is rebuilt by build_table for every EOS id; END's tokens are not real.
    keep = (tok != vocabulary.eos_token_ids[0]) & (tok < vocabulary.first_fake_id)
    src, tok, dst = src[keep], tok[keep], dst[keep]
    ids = np.unique(np.concatenate([src, dst, np.asarray([index.get_initial_state(), *finals], np.int64)]))
    src_i, dst_i = np.searchsorted(ids, src), np.searchsorted(ids, dst)  # compact 0..S-1
    final = np.isin(ids, np.asarray(list(finals), np.int64))
    pairs = np.unique(src_i * len(ids) + dst_i)
    order = _live_order(pairs // len(ids), pairs % len(ids), int(np.searchsorted(ids, index.get_initial_state())),
                        final)
    if not order:
        raise GrammarError(f"{kind} has no path through the vocabulary: no complete match can be spelled "
                           "with its tokens")
    local = np.full(len(ids), -1, np.int64)
    local[np.asarray(order)] = np.arange(len(order))
    src_l, dst_l = local[src_i], local[dst_i]
    keep = (src_l >= 0) & (dst_l >= 0)  # edges into pruned states go with them
    src_l, tok, dst_l = src_l[keep], tok[keep], dst_l[keep]
    by = np.lexsort((tok, src_l))  # sorted by (src, token)
    if not np.any(src_l == 0):
        raise GrammarError(f"{kind} matches only the empty string: its initial state allows no token but EOS")
    return Grammar(
        kind=kind, source=source, regex=pattern, vocab_size=vocab_size, num_states=len(order),
        src=src_l[by].astype(np.int32), token=tok[by].astype(np.int32), dst=dst_l[by].astype(np.int32),
        final=final[np.asarray(order)], eos_token_ids=vocabulary.eos_token_ids,
        outlines_state=ids[np.asarray(order)])


class _TokenizerCache:
    """Per tokenizer (weakly held): its vocabulary per vocab_size and its last compiled grammars."""

    MAX_GRAMMARS = 64

    def __init__(self):
        self.vocabularies: dict[int, _Vocabulary] = {}
        self.grammars: collections.OrderedDict[tuple, Grammar] = collections.OrderedDict()


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def compile_grammar(tokenizer, vocab_size: int, regex: str | None = None,
                    json_schema: str | Mapping[str, Any] | None = None,
                    choices: Sequence[str] | None = None) -> Grammar:
    """The token automaton of exactly one of `regex`, `json_schema` (JSON text or a dict) or
    `choices` (non-empty strings) over `tokenizer`'s vocabulary, for a model with `vocab_size` ids.

    Host-side; cached per tokenizer (the same request returns the same Grammar object, which
    build_table stores once). Raises GrammarError (an InvalidRequestError) naming the problem.
    """
    if not is_integer(vocab_size) or vocab_size <= 0:
        raise GrammarError(f"vocab_size must be a positive integer, got {vocab_size!r:.40}")
    if not hasattr(tokenizer, "hf_tokenizer") or not hasattr(tokenizer, "eos_token_ids"):
        raise GrammarError(f"constrained generation needs a jaxspec Tokenizer, got {type(tokenizer).__name__}")
    vocab_size = int(vocab_size)
    kind, source, pattern = _request(regex, json_schema, choices)
    with _LOCK:
        cache = _CACHE.get(tokenizer)
        if cache is None:
            cache = _CACHE[tokenizer] = _TokenizerCache()
        key = (vocab_size, kind, source)
        if key in cache.grammars:
            cache.grammars.move_to_end(key)
            return cache.grammars[key]
        vocabulary = cache.vocabularies.get(vocab_size)
        if vocabulary is None:
            vocabulary = cache.vocabularies[vocab_size] = _Vocabulary(tokenizer, vocab_size)
        grammar = _build(vocabulary, vocab_size, kind, source, pattern)
        cache.grammars[key] = grammar
        while len(cache.grammars) > cache.MAX_GRAMMARS:
            cache.grammars.popitem(last=False)
        return grammar
