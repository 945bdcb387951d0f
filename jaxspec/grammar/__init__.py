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
    digits, each structural piece, ...), so its table is over a hundred times smaller than dense
    (bench/RESULTS.md, "Structured output": the table build): a `maxLength` string has a state per
    length, each sending tokens of each byte length elsewhere, which no per-state exception list
    compresses but classes do.
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

The modules: `automaton` (the host half: token bytes, compile_grammar, Grammar) and `table` (the
device half: the reserved states, GrammarTable, build_table).
"""

from jaxspec.grammar.automaton import Grammar, GrammarError, compile_grammar, token_bytes
from jaxspec.grammar.table import DEAD, DENSE_BUDGET_BYTES, DONE, FREE, GrammarTable, build_table

__all__ = [
    "DEAD", "DENSE_BUDGET_BYTES", "DONE", "FREE", "Grammar", "GrammarError", "GrammarTable",
    "build_table", "compile_grammar", "token_bytes",
]
