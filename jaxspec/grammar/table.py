"""The device half of constrained generation: a batch's automata laid out in one table
(`build_table`), so a row's state is one int32 and `allowed`, `advance` and `ended` are gathers
in the jitted loop. The layouts (dense, token classes, sparse) and the reserved states are
described in the package docstring.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.grammar.automaton import Grammar, GrammarError

FREE, DEAD, DONE = 0, 1, 2
NUM_RESERVED = 3
DENSE_BUDGET_BYTES = 8 << 20  # "auto" looks at the sparse layout only when the others exceed this
LAYOUTS = ("dense", "classes", "sparse", "auto")


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
        # (~20 for a large table) lengthen its compile markedly.
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
