"""`GenerateOptions`: every generate setting and its default, written once, checked on creation.

`generate`, `stream` and the CLI all take their defaults from this dataclass. Creating one
validates everything that does not depend on the model (ranges, types, names) and raises
`InvalidRequestError` naming the field; what depends on the model (token ids against its
vocabulary, lengths against its context, the draft against the target) is checked by
`jaxspec.api.prepare`, still before anything is traced.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxspec.cache import KVFormat
from jaxspec.errors import InvalidRequestError, check_text, is_integer
from jaxspec.pallas.flash_decode import Attention, resolve_attention
from jaxspec.sampling import SamplerSpec, spec_for
from jaxspec.spec.methods import DRAFT_SAMPLING, MAX_DRAFT_TOKENS, DraftOptions, Method, check_lookup_first
from jaxspec.spec.tree import DraftTree

DEFAULT_DRAFT_TOKENS = 4  # a chain's k when num_draft_tokens is not given
MAX_NGRAM = 16
MAX_LOGPROBS = 20  # alternatives per token (vLLM's default max_logprobs)
GRAMMAR_KINDS = ("regex", "json_schema", "choices")


def _is_sequence(value) -> bool:
    """A list, tuple or 1-D array of items; not a str or bytes (each a sequence of its own parts)."""
    if isinstance(value, np.ndarray):
        return value.ndim == 1
    return isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """A generation request's settings (all but the model, draft and prompt).

    Speculation: `method` (None: "plain", or inferred from the draft), `num_draft_tokens` (k, the
    chain's length; None: 4), prompt lookup's n-gram range, the layer-skip draft's `exit_layer`
    (default half the layers), `draft_sampling` ("sample" or "argmax" drafts at temperature > 0),
    `tree` (a `DraftTree`, a (depth, top_k, num_nodes) triple or "D,K,N": draft an EAGLE-2 tree
    instead of a chain; it drafts to its depth, so it is refused beside a num_draft_tokens),
    `lookup_first` n (with eagle3, mtp or assistant: rows whose last n tokens occurred earlier in
    their context draft prompt lookup's continuation instead of the model's; None: off).
    Sampling: temperature 0 is greedy; top_k 0, top_p 1, min_p 0 and repetition_penalty 1 are off.
    Each may also be a per-row sequence. `chat`: text prompts through the model's chat template
    (None, the default: when its tokenizer has one, as in the CLI; True refuses a model without
    one). Stops: EOS (unless `ignore_eos`), `stop_token_ids`, `stop`
    strings, `max_new_tokens`. KV cache: `kv_format` ("f32", "bf16", "q8_0", "q5_1" or a (K, V)
    pair) and `attention` ("auto", "reference", "pallas", "interpret").
    Log-probs: `logprobs` N reports each generated token's log-prob and its N best alternatives
    (0: the token's own only; None: off). Constrained decoding (jaxspec.grammar): `regex`,
    `json_schema` (a JSON string or a dict) or `choices` (a sequence of strings) for every row;
    or, for rows with different grammars, a per-row sequence of them with None for a free row.
    """

    method: Method | str | None = None
    num_draft_tokens: int | None = None
    ngram_max: int = 3
    ngram_min: int = 1
    exit_layer: int | None = None
    draft_sampling: str | None = None
    tree: DraftTree | str | tuple[int, int, int] | None = None
    lookup_first: int | None = None
    max_new_tokens: int = 128
    temperature: float | Sequence[float] = 0.0
    top_k: int | Sequence[int] = 0
    top_p: float | Sequence[float] = 1.0
    min_p: float | Sequence[float] = 0.0
    repetition_penalty: float | Sequence[float] = 1.0
    seed: int = 0
    chat: bool | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    kv_format: KVFormat | str | tuple[str, str] | None = None
    attention: Attention | str = "auto"
    logprobs: int | None = None
    regex: str | Sequence[str | None] | None = None
    json_schema: str | dict | Sequence[str | dict | None] | None = None
    choices: Sequence[str] | Sequence[Sequence[str] | None] | None = None

    def __post_init__(self):
        # Normalised in place (the dataclass is frozen): names become enums, sequences tuples.
        def normalise(name, value):
            object.__setattr__(self, name, value)

        if self.method is not None:
            normalise("method", Method.parse(self.method))
        k = self.num_draft_tokens
        if k is not None and (not is_integer(k) or not 1 <= k <= MAX_DRAFT_TOKENS):
            raise InvalidRequestError(f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}] or None; "
                                      f"got {k!r}")
        if not (is_integer(self.ngram_min) and is_integer(self.ngram_max)
                and 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM):
            raise InvalidRequestError(
                f"need 1 <= ngram_min <= ngram_max <= {MAX_NGRAM}; got {self.ngram_min}, {self.ngram_max}")
        if self.exit_layer is not None and (not is_integer(self.exit_layer) or self.exit_layer < 1):
            raise InvalidRequestError(f"exit_layer must be an integer >= 1; got {self.exit_layer!r}")
        normalise("tree", DraftTree.parse(self.tree))
        if self.tree is not None and k is not None:
            # A tree drafts to its depth: a k beside it would be ignored, and the stats would report
            # the depth as num_draft_tokens.
            raise InvalidRequestError(
                f"num_draft_tokens ({int(k)}) and a tree ({self.tree}) were both given: a tree drafts to its depth "
                f"({self.tree.depth}), num_draft_tokens sets a chain's length; give one of them")
        if self.lookup_first is not None:
            if not is_integer(self.lookup_first) or not 1 <= self.lookup_first <= MAX_NGRAM:
                raise InvalidRequestError(f"lookup_first must be an n-gram order in [1, {MAX_NGRAM}] or None; "
                                          f"got {self.lookup_first!r:.40}")
            normalise("lookup_first", int(self.lookup_first))
            if self.method is not None:  # an inferred method is checked when the draft is known
                check_lookup_first(self.method)
        if self.draft_sampling not in (None, *DRAFT_SAMPLING):
            raise InvalidRequestError(f"draft_sampling must be one of {DRAFT_SAMPLING}; got {self.draft_sampling!r}")
        if not is_integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 1; got {self.max_new_tokens!r}")
        self._check_sampling()
        if not is_integer(self.seed) or not 0 <= self.seed < 2**32:
            # jax.random.PRNGKey keeps 32 bits: a larger or negative seed would silently be another one
            raise InvalidRequestError(f"seed must be an integer in [0, 2**32); got {self.seed!r}")
        for name in ("ngram_min", "ngram_max", "max_new_tokens", "seed"):
            normalise(name, int(getattr(self, name)))  # numpy integers become the ints they are
        for name in ("num_draft_tokens", "exit_layer"):
            if getattr(self, name) is not None:
                normalise(name, int(getattr(self, name)))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if not (_is_sequence(stop) and all(isinstance(text, str) and text for text in stop)):
            raise InvalidRequestError(f"stop must be a non-empty string or a sequence of them; got {stop!r:.80}")
        for index, text in enumerate(stop):
            check_text(text, f"stop string {index}")
        normalise("stop", tuple(stop))
        stop_ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not (_is_sequence(stop_ids) and all(is_integer(t) and 0 <= t < 2**31 for t in stop_ids)):
            raise InvalidRequestError(f"stop_token_ids must be a sequence of token ids (integers >= 0); "
                                      f"got {stop_ids!r:.80}")
        if self.chat is not None:
            if not isinstance(self.chat, bool | np.bool_):
                raise InvalidRequestError(f"chat must be True, False or None (on when the model's tokenizer has a "
                                          f"chat template); got {self.chat!r:.40}")
            normalise("chat", bool(self.chat))
        if not isinstance(self.ignore_eos, bool | np.bool_):
            raise InvalidRequestError(f"ignore_eos must be True or False; got {self.ignore_eos!r:.40}")
        normalise("ignore_eos", bool(self.ignore_eos))
        normalise("stop_token_ids", tuple(int(t) for t in stop_ids))
        if self.kv_format is not None:
            normalise("kv_format", KVFormat.parse(self.kv_format))
        attention = Attention.parse(self.attention)
        if attention is not Attention.AUTO:
            resolve_attention(attention)  # "pallas" off a GPU: a named error now, not at trace time
        normalise("attention", attention)
        if self.logprobs is not None and not (is_integer(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None; got {self.logprobs!r:.40}")
        if self.logprobs is not None:
            normalise("logprobs", int(self.logprobs))
        normalise("regex", _per_row_or_all("regex", self.regex, _is_regex))
        normalise("json_schema", _per_row_or_all("json_schema", self.json_schema, _is_schema, _schema_text))
        normalise("choices", _per_row_or_all("choices", self.choices, _is_choices, tuple))

    def grammars(self, rows: int) -> list[tuple[str, str | tuple[str, ...]] | None]:
        """Each row's grammar as (kind, source): kind one of GRAMMAR_KINDS; None for a free row.
        InvalidRequestError when a per-row sequence does not have `rows` entries, or a row has two."""
        per_row: list[tuple[str, object] | None] = [None] * rows
        for kind in GRAMMAR_KINDS:
            value = getattr(self, kind)
            if value is None:
                continue
            if isinstance(value, _PerRow):
                if len(value) != rows:
                    raise InvalidRequestError(f"{kind} has {len(value)} per-row entries for {rows} prompt(s)")
                values = list(value)
            else:
                values = [value] * rows
            for row, source in enumerate(values):
                if source is None:
                    continue
                if per_row[row] is not None:
                    raise InvalidRequestError(f"prompt {row} has two grammars ({per_row[row][0]} and {kind}); "
                                              f"give each row one of {', '.join(GRAMMAR_KINDS)}")
                per_row[row] = (kind, source)
        return per_row

    def _check_sampling(self) -> None:
        checks = [
            ("temperature", lambda v: v >= 0 and math.isfinite(v), "temperature must be >= 0"),
            ("top_p", lambda v: 0 < v <= 1, "top_p must be in (0, 1]"),
            ("top_k", lambda v: 0 <= v < 2**31 and float(v).is_integer(),
             "top_k must be an integer in [0, 2**31) (0 disables)"),
            ("min_p", lambda v: 0 <= v <= 1, "min_p must be in [0, 1]"),
            ("repetition_penalty", lambda v: v > 0 and math.isfinite(v), "repetition_penalty must be > 0"),
        ]
        for name, ok, message in checks:
            if isinstance(getattr(self, name), str | bytes):  # numpy would parse "0.5"
                raise InvalidRequestError(f"{name} must be a number or a sequence of numbers; "
                                          f"got {getattr(self, name)!r}")
            try:
                values = np.atleast_1d(np.asarray(getattr(self, name), dtype=np.float64))
            except (TypeError, ValueError):
                raise InvalidRequestError(f"{name} must be a number or a sequence of numbers; "
                                          f"got {getattr(self, name)!r}") from None
            for value in values.ravel():
                if not ok(float(value)):
                    # A whole number reads as given (-3, not the -3.0 of the float64 it was checked as).
                    shown = int(value) if math.isfinite(value) and float(value).is_integer() else float(value)
                    raise InvalidRequestError(f"{message}; got {shown!r}")

    @property
    def sampler(self) -> SamplerSpec:
        """Which sampling stages the compiled program needs for these values."""
        return spec_for(**self.sampling_values)

    @property
    def sampling_values(self) -> dict:
        """The per-row sampling values, as `SamplingParams.create` takes them."""
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty)

    def sampling_rows(self, rows: int, batch: int) -> dict:
        """`sampling_values` for a batch of `batch` rows, the first `rows` of them prompts (a mesh
        pads the rest): each value one number for every row, or a sequence of one per prompt,
        refused by name when its length is another; padding rows repeat the last prompt's."""
        values = {}
        for name, value in self.sampling_values.items():
            array = np.asarray(value)
            if array.ndim > 1:
                raise InvalidRequestError(f"{name} must be one number, or a flat sequence of one per prompt; "
                                          f"got a sequence {array.ndim} deep")
            if array.ndim == 1 and array.shape[0] != rows:
                raise InvalidRequestError(
                    f"{name} has {array.size} per-row values for {rows} prompt(s); give one number, or one per prompt")
            if array.ndim == 1 and batch > rows:
                array = np.concatenate([array, np.repeat(array[-1:], batch - rows)])
            values[name] = array
        return values

    @property
    def draft_options(self) -> DraftOptions:
        k = DEFAULT_DRAFT_TOKENS if self.num_draft_tokens is None else self.num_draft_tokens
        return DraftOptions(num_draft_tokens=k, ngram_max=int(self.ngram_max),
                            ngram_min=int(self.ngram_min), exit_layer=self.exit_layer,
                            draft_sampling=self.draft_sampling, tree=self.tree,
                            lookup_first=self.lookup_first)

    @property
    def constrained(self) -> bool:
        return any(getattr(self, kind) is not None for kind in GRAMMAR_KINDS)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "GenerateOptions":
        """Options from keyword arguments; an unknown name is an InvalidRequestError naming it."""
        unknown = sorted(set(kwargs) - {field.name for field in dataclasses.fields(cls)})
        if unknown:
            raise InvalidRequestError(f"unknown generate option(s) {', '.join(unknown)}; the options are the "
                                      f"fields of jaxspec.GenerateOptions")
        return cls(**kwargs)



class _PerRow(tuple):
    """A grammar option given per row (a tuple, told apart from one value that is itself a tuple:
    a set of choices)."""


def _is_regex(value) -> bool:
    return isinstance(value, str) and bool(value)


def _is_schema(value) -> bool:
    return isinstance(value, str | dict) and bool(value)


def _is_choices(value) -> bool:
    return _is_sequence(value) and len(value) > 0 and all(isinstance(choice, str) and choice for choice in value)


def _schema_text(value) -> str:
    """A JSON schema as its JSON text (a dict is dumped, so the options stay comparable and a
    compiled grammar is cached by its text). Keys keep their order: it orders the properties."""
    import json

    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as err:
        raise InvalidRequestError(f"json_schema is a dict that is not JSON: {err}") from None


def _per_row_or_all(name: str, value, is_one, normal=lambda v: v):
    """A grammar option as one value for every row, or a `_PerRow` of values and Nones."""
    if value is None:
        return None
    if isinstance(value, _PerRow):
        return value
    if is_one(value):
        return normal(value)
    if _is_sequence(value) and len(value) > 0 and all(v is None or is_one(v) for v in value):
        return _PerRow(None if v is None else normal(v) for v in value)
    what = {"regex": "a non-empty string", "json_schema": "a JSON schema (a string or a dict)",
            "choices": "a non-empty sequence of non-empty strings"}[name]
    raise InvalidRequestError(f"{name} must be {what}, or a per-row sequence of them (None for a free row); "
                              f"got {value!r:.80}")
