"""Constrained generation: a regex, a JSON schema or a list of choices as a token automaton on device.

Two halves, split at the host/device line:

  * `compile_grammar` (host, cached) turns the request into a regex (JSON schemas through
    outlines-core's `build_regex_from_schema`, choices as an escaped alternation), builds
    outlines-core's token-level `Index` over the model's vocabulary (token bytes recovered from the
    tokenizer's decoder: byte-level or sentencepiece), and keeps only what the loop needs: states
    renumbered 0..Q-1 (initial first, breadth-first), the non-EOS transitions as sorted (src, token,
    dst) triples, and which states are final. The regex is compiled with an end marker (see END:
    outlines-core 0.2.14 alone misses tokens wherever the regex could already end). States from
    which no final state can be reached are pruned with the tokens that lead into them, so a row
    never walks into a state that allows nothing; a grammar with no path at all is refused.
  * `build_table` (host -> device, once per batch) lays every row's automaton out in ONE table with
    disjoint state ranges after three reserved states, so a row's state is a single int32 and the
    jitted loop needs no per-row structure: `allowed`, `advance` and `ended` are gathers.

Reserved states (every token allowed in each, so a softmax over a masked row is never all -inf):

    FREE = 0  no grammar: every token -> FREE, never ended (the loop's own EOS handling applies)
    DEAD = 1  reached by a forbidden token (a bug or a sampler ignoring the mask): -> DEAD, never ended
    DONE = 2  reached by an EOS token from a final state: -> DONE, ended

EOS: every id in `tokenizer.eos_token_ids` is allowed exactly in final states and leads to DONE.
outlines-core's Vocabulary takes one EOS id (the first is passed); its own EOS transitions are
dropped and rebuilt here for all of them. Special/added tokens with special=True (`<|im_start|>`)
are never allowed; neither are ids the tokenizer does not have (model vocab_size > tokenizer's).

Layouts of the table (V = vocab size, Q = states including reserved ones):

  * dense: `next` int16 (int32 when Q >= 32768) [Q, V], -1 = forbidden. Two gathers per query; the
    table is Q * V * 2 bytes (96 KiB per state at V=49152).
  * classes: tokens that every state treats alike form a class (DFA alphabet compression), and the
    table is `next` [Q, C] over the classes plus `token_class` int32 [V]. A JSON schema's tens of
    thousands of tokens fall into ~100-300 classes (characters that may appear inside a string,
    digits, each structural piece, ...), so its table is under a MiB where dense would be 40-400
    MiB (bench/RESULTS.md): a `maxLength` string has a state per length, each sending tokens of
    each byte length elsewhere, which no per-state exception list compresses but classes do.
  * sparse: an allowed bitmask uint32 [Q, ceil(V/32)], a per-state `default_next` (the most common
    next state among its allowed tokens) and a CSR list of the exceptions only (tokens whose next
    state differs). A JSON string's inner state (~40k tokens looping to itself) costs one 6 KiB
    bitmask row and no exceptions. `advance` binary-searches the row's exceptions with a static
    number of steps. For automata whose tokens do not fall into few classes.
  * "auto": the smallest (dense when tied: one gather fewer).

The layouts give identical answers; `ended` is a precomputed bool[Q] lookup in all. To limit
recompiles of a loop that takes the table as an argument, Q, C and the exception count are padded
up to powers of two (pad rows behave as DEAD), so similar batches share a trace. A batch's table
is cached on its grammars (the same request again builds nothing).
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

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.errors import InvalidRequestError, check_text, is_integer

__all__ = [
    "DEAD", "DENSE_BUDGET_BYTES", "DONE", "FREE", "Grammar", "GrammarError", "GrammarTable",
    "build_table", "compile_grammar", "token_bytes",
]

FREE, DEAD, DONE = 0, 1, 2
NUM_RESERVED = 3
DENSE_BUDGET_BYTES = 8 << 20  # "auto" looks at the sparse layout only when the others exceed this
LAYOUTS = ("dense", "classes", "sparse", "auto")


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
                raise GrammarError(f"json_schema is not valid JSON: {e}") from None
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
    """The 256 single bytes as a vocabulary: an Index over it checks that a regex parses (~1-20 ms)."""
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


# --- the device table ----------------------------------------------------------------------------


@struct.dataclass
class GrammarTable:
    """A batch's automata in one table; states are int32 indices into it (see module docstring).

    Dense layout: `next` [Q, V] (-1 = forbidden). Classes layout: `token_class` int32 [V] and
    `next` [Q, C] over the token classes. Sparse layout: `mask` uint32 [Q, ceil(V/32)],
    `default_next` int32 [Q], `row_start` int32 [Q+1], `exc_token` / `exc_next` int32 [E]. The
    fields of the other layouts are None.
    """

    ended_table: jnp.ndarray  # bool [Q]
    next: jnp.ndarray | None = None  # int16|int32 [Q, V] (dense) or [Q, C] (classes)
    token_class: jnp.ndarray | None = None  # int32 [V] (classes): tokens of a class act alike in every state
    mask: jnp.ndarray | None = None  # uint32 [Q, W]
    default_next: jnp.ndarray | None = None  # int32 [Q]
    row_start: jnp.ndarray | None = None  # int32 [Q+1]
    exc_token: jnp.ndarray | None = None  # int32 [E], sorted within each row
    exc_next: jnp.ndarray | None = None  # int32 [E]
    layout: str = struct.field(pytree_node=False, default="dense")
    vocab_size: int = struct.field(pytree_node=False, default=0)
    search_steps: int = struct.field(pytree_node=False, default=0)  # ceil(log2(max exceptions per row + 1))

    @property
    def num_states(self) -> int:
        return int(self.ended_table.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(int(x.nbytes) for x in (self.ended_table, self.next, self.token_class, self.mask,
                                           self.default_next, self.row_start, self.exc_token, self.exc_next)
                   if x is not None)

    def allowed(self, states: jnp.ndarray) -> jnp.ndarray:
        """int32 [...] -> bool [..., V]: the tokens allowed in each state."""
        states = jnp.asarray(states, jnp.int32)
        if self.layout == "dense":
            return self.next[states] >= 0  # [..., V]
        if self.layout == "classes":
            return (self.next[states] >= 0)[..., self.token_class]  # [..., C] -> [..., V]
        words = self.mask[states]  # [..., W]
        bits = (words[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1  # [..., W, 32]; token = 32 w + b
        return bits.reshape(*states.shape, -1)[..., : self.vocab_size] != 0  # [..., V]

    def advance(self, states: jnp.ndarray, tokens: jnp.ndarray) -> jnp.ndarray:
        """int32 [...], int32 [...] -> int32 [...]: the next state; a forbidden token -> DEAD."""
        states, tokens = jnp.asarray(states, jnp.int32), jnp.asarray(tokens, jnp.int32)
        if self.layout in ("dense", "classes"):
            column = tokens if self.layout == "dense" else self.token_class[tokens]
            target = self.next[states, column].astype(jnp.int32)
            return jnp.where(target < 0, DEAD, target)
        word = self.mask[states, tokens >> 5]
        allowed = ((word >> (tokens & 31).astype(jnp.uint32)) & 1) != 0
        # lower_bound of `tokens` in the row's exceptions [start, end): a fixed number of halvings
        # (enough for the longest row) keeps it a static, vectorised loop.
        start, end = self.row_start[states], self.row_start[states + 1]
        last = self.exc_token.shape[0] - 1

        def halve(_, bounds):
            lo, hi = bounds
            mid = jnp.minimum((lo + hi) >> 1, last)
            go_right = (lo < hi) & (self.exc_token[mid] < tokens)
            return jnp.where(go_right, mid + 1, lo), jnp.where((lo < hi) & ~go_right, mid, hi)

        # A rolled loop: the loop calls advance a dozen times a round, and unrolled halvings
        # (~20 for a large table) made its compile twice as long.
        lo, _ = jax.lax.fori_loop(0, self.search_steps, halve, (start, end))
        at = jnp.minimum(lo, last)
        found = (lo < end) & (self.exc_token[at] == tokens)
        target = jnp.where(found, self.exc_next[at], self.default_next[states])
        return jnp.where(allowed, target, DEAD)

    def ended(self, states: jnp.ndarray) -> jnp.ndarray:
        """int32 [...] -> bool [...]: DONE, or a final state where nothing but EOS is allowed."""
        return self.ended_table[jnp.asarray(states, jnp.int32)]


def _bucket(n: int) -> int:
    """`n` rounded up to a power of two (>= 16). The table is an argument of the compiled loop, so
    each distinct shape is a compile: powers of two keep a session's grammars to a few programs,
    at up to 2x the padding (a padded sparse state costs one bitmask row, V / 8 bytes)."""
    return max(16, 1 << (int(n) - 1).bit_length())


def _token_classes(src: np.ndarray, tok: np.ndarray, dst: np.ndarray, num_states: int,
                   vocab_size: int) -> tuple[np.ndarray, int]:
    """Tokens that every state treats alike (allowed in the same states, leading to the same next
    states) share a class: int32 [V] class ids and the count. JSON grammars have a few hundred
    classes over tens of thousands of tokens, so a [Q, C] table replaces [Q, V]. (DFA alphabet
    compression; the reserved rows allow every token alike, so they need no column of their own.)

    Each token's column is fingerprinted by exact per-token sums of two 64-bit mixes of its (src,
    dst) pairs, taken 16 bits at a time (bincount sums of 16-bit chunks stay exact in float64 up
    to 2^37 transitions), plus its transition count; `_class_table` then checks the classes
    against every transition, so a fingerprint collision could not go unnoticed."""
    def mix(x: np.ndarray) -> np.ndarray:  # splitmix64's finaliser, on uint64 with wrap-around
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))

    with np.errstate(over="ignore"):
        pair = src.astype(np.uint64) * np.uint64(num_states) + dst.astype(np.uint64)
        mixes = (mix(pair), mix(pair ^ np.uint64(0x5851F42D4C957F2D)))
    columns = [np.bincount(tok, minlength=vocab_size).astype(np.float64)]  # [V] each
    for mixed in mixes:
        for shift in (0, 16, 32, 48):
            chunk = ((mixed >> np.uint64(shift)) & np.uint64(0xFFFF)).astype(np.float64)
            columns.append(np.bincount(tok, weights=chunk, minlength=vocab_size))
    _, token_class = np.unique(np.stack(columns, axis=1), axis=0, return_inverse=True)  # [V, 9] rows
    token_class = token_class.reshape(-1).astype(np.int32)
    return token_class, int(token_class.max()) + 1


def _class_table(src, tok, dst, token_class, num_classes: int, num_states: int, dtype) -> np.ndarray | None:
    """next [Q, C] with -1 where forbidden (transitions only; the caller fills the reserved rows),
    or None when the classes do not hold: a cell two transitions write with different next
    states, or a token with fewer transitions than its class's column has cells."""
    table = np.full((num_states, _bucket(num_classes)), -1, dtype)  # padded classes: never used
    column = token_class[tok]
    table[src, column] = dst
    consistent = np.array_equal(table[src, column], dst)
    cells_per_class = np.count_nonzero(table >= 0, axis=0)[:num_classes]
    transitions_per_token = np.bincount(tok, minlength=token_class.shape[0])
    if not (consistent and np.array_equal(transitions_per_token, cells_per_class[token_class])):
        return None
    return table


def _default_next(src: np.ndarray, dst: np.ndarray, num_states: int) -> np.ndarray:
    """int32 [Q]: per state, the next state most of its tokens lead to (ties: the smallest state);
    DEAD for states without transitions, and each reserved state itself."""
    default_next = np.full(num_states, DEAD, np.int32)
    default_next[:NUM_RESERVED] = np.arange(NUM_RESERVED)
    if src.size:
        pairs, counts = np.unique(src * num_states + dst, return_counts=True)
        pair_src, pair_dst = pairs // num_states, pairs % num_states
        best = np.lexsort((pair_dst, -counts, pair_src))
        pair_src, pair_dst = pair_src[best], pair_dst[best]
        first = np.ones(pair_src.shape, bool)
        first[1:] = pair_src[1:] != pair_src[:-1]
        default_next[pair_src[first]] = pair_dst[first]
    return default_next


def _sparse_bytes(src, tok, dst, num_states: int, vocab_size: int) -> int:
    """What the sparse layout of these transitions would take (its exceptions counted as built)."""
    exceptions = int(np.sum(dst != _default_next(src, dst, num_states)[src]))
    return num_states * (-(-vocab_size // 32) * 4 + 9) + _bucket(exceptions) * 8


def build_table(grammars: Sequence[Grammar | None], vocab_size: int,
                layout: str = "auto") -> tuple[GrammarTable, np.ndarray]:
    """One device table for a batch: `grammars[b]` is row b's Grammar, or None (unconstrained).

    Returns (table, initial_states int32 [B]); a None row starts (and stays) in FREE. A Grammar
    object given for several rows is stored once. `layout`: "dense", "classes", "sparse" or "auto".
    Cached on the grammars (by identity) and the layout: the same batch again builds nothing.
    """
    if layout not in LAYOUTS:
        raise GrammarError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r:.40}")
    for row, grammar in enumerate(grammars):
        if grammar is not None and not isinstance(grammar, Grammar):
            raise GrammarError(f"grammars[{row}] is a {type(grammar).__name__}, not a Grammar or None")
    table, initial = _cached_table(tuple(grammars), int(vocab_size), layout)
    return table, initial.copy()


@functools.lru_cache(maxsize=16)
def _cached_table(grammars: tuple[Grammar | None, ...], vocab_size: int,
                  layout: str) -> tuple[GrammarTable, np.ndarray]:
    """build_table's work, for a checked request (the initial states it returns are shared: copied out)."""
    unique: dict[int, tuple[Grammar, int]] = {}  # id -> (grammar, first global state)
    offset = NUM_RESERVED
    initial = np.full(len(grammars), FREE, np.int32)
    for row, grammar in enumerate(grammars):
        if grammar is None:
            continue
        if not isinstance(grammar, Grammar):
            raise GrammarError(f"grammars[{row}] is a {type(grammar).__name__}, not a Grammar or None")
        if grammar.vocab_size != vocab_size:
            raise GrammarError(f"grammars[{row}] was compiled for vocab_size={grammar.vocab_size}, "
                               f"not {vocab_size}")
        if id(grammar) not in unique:
            unique[id(grammar)] = (grammar, offset)
            offset += grammar.num_states
        initial[row] = unique[id(grammar)][1]
    used = offset
    num_states = _bucket(used)  # pad rows [used, Q) behave as DEAD

    # All transitions in global numbering, EOS -> DONE from final states added: [N]
    src_parts, tok_parts, dst_parts = [], [], []
    ended = np.zeros(num_states, bool)
    ended[DONE] = True
    for grammar, first in unique.values():
        src_parts.append(grammar.src + first)
        tok_parts.append(grammar.token)
        dst_parts.append(grammar.dst + first)
        finals = np.flatnonzero(grammar.final).astype(np.int32) + first
        for eos in grammar.eos_token_ids:
            src_parts.append(finals)
            tok_parts.append(np.full_like(finals, eos))
            dst_parts.append(np.full_like(finals, DONE))
        # ended: final, and no transition but EOS out of it
        has_edge = np.zeros(grammar.num_states, bool)
        has_edge[grammar.src] = True
        ended[first: first + grammar.num_states] = grammar.final & ~has_edge
    empty = np.zeros(0, np.int32)
    src = np.concatenate([empty, *src_parts]).astype(np.int64)
    tok = np.concatenate([empty, *tok_parts]).astype(np.int64)
    dst = np.concatenate([empty, *dst_parts]).astype(np.int32)
    dense_dtype = np.int16 if num_states < 32768 else np.int32
    itemsize = np.dtype(dense_dtype).itemsize
    dense_bytes = num_states * vocab_size * itemsize
    class_table = token_class = None
    if layout in ("classes", "auto"):
        token_class, num_classes = _token_classes(src, tok, dst, num_states, vocab_size)
        class_table = _class_table(src, tok, dst, token_class, num_classes, num_states, dense_dtype)
        if class_table is None:  # a fingerprint collision: every token its own class (exact)
            token_class = np.arange(vocab_size, dtype=np.int32)
            class_table = _class_table(src, tok, dst, token_class, vocab_size, num_states, dense_dtype)
    if layout == "auto":  # the smallest; the sparse estimate costs a pass, so only when classes are big
        classes_bytes = class_table.nbytes + vocab_size * 4
        layout = "dense" if dense_bytes <= classes_bytes else "classes"
        if min(dense_bytes, classes_bytes) > DENSE_BUDGET_BYTES and \
                _sparse_bytes(src, tok, dst, num_states, vocab_size) < min(dense_bytes, classes_bytes):
            layout = "sparse"

    ended_table = jnp.asarray(ended)
    if layout in ("dense", "classes"):
        if layout == "dense":
            table = np.full((num_states, vocab_size), -1, dense_dtype)  # [Q, V]
            table[src, tok] = dst
        else:
            table = class_table  # [Q, C]
        table[FREE], table[DEAD], table[DONE] = FREE, DEAD, DONE
        table[used:] = DEAD
        return GrammarTable(ended_table=ended_table, next=jnp.asarray(table), layout=layout, vocab_size=vocab_size,
                            token_class=None if layout == "dense" else jnp.asarray(token_class)), initial

    order = np.lexsort((tok, src))  # by (src, token): the exceptions' CSR needs each row's tokens sorted
    src, tok, dst = src[order], tok[order], dst[order]

    words = -(-vocab_size // 32)
    mask = np.zeros(num_states * words, np.uint32)  # [Q * W]
    # Bits of one state's tokens are distinct, so adding them is or-ing them.
    np.add.at(mask, src * words + (tok >> 5), (np.uint32(1) << (tok & 31).astype(np.uint32)))
    mask = mask.reshape(num_states, words)  # [Q, W]
    for state in (FREE, DEAD, DONE, *range(used, num_states)):
        mask[state] = np.uint32(0xFFFFFFFF)
    default_next = _default_next(src, dst, num_states)
    exception = dst != default_next[src]
    exc_src, exc_token, exc_next = src[exception], tok[exception].astype(np.int32), dst[exception]
    per_row = np.bincount(exc_src, minlength=num_states)
    row_start = np.zeros(num_states + 1, np.int32)
    row_start[1:] = np.cumsum(per_row)
    # Pad E to a bucket (>= 16, so gathers always have an element); pad entries lie past
    # every row's segment and are never found.
    size = _bucket(exc_token.size)
    exc_token = np.concatenate([exc_token, np.full(size - exc_token.size, -1, np.int32)])
    exc_next = np.concatenate([exc_next, np.full(size - exc_next.size, DEAD, np.int32)])
    # Enough halvings for any row of this bucket's size (not the longest row here), so tables of
    # one bucket share a program; a few more gathers over [B, T] states cost next to nothing.
    steps = max(int(per_row.max(initial=0)).bit_length(), size.bit_length())
    return GrammarTable(
        ended_table=ended_table, mask=jnp.asarray(mask), default_next=jnp.asarray(default_next),
        row_start=jnp.asarray(row_start), exc_token=jnp.asarray(exc_token), exc_next=jnp.asarray(exc_next),
        layout="sparse", vocab_size=vocab_size, search_steps=steps), initial
