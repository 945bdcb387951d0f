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
from jaxspec.spec.methods import DRAFT_SAMPLING, MAX_DRAFT_TOKENS, DraftOptions, Method
from jaxspec.spec.tree import DraftTree

MAX_NGRAM = 16


def _is_sequence(value) -> bool:
    """A list, tuple or 1-D array of items; not a str or bytes (each a sequence of its own parts)."""
    if isinstance(value, np.ndarray):
        return value.ndim == 1
    return isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """A generation request's settings (all but the model, draft and prompt).

    Speculation: `method` (None: "plain", or inferred from the draft), `num_draft_tokens` (k),
    prompt lookup's n-gram range, the layer-skip draft's `exit_layer` (default half the layers),
    `draft_sampling` ("sample" or "argmax" drafts at temperature > 0), `tree` (a `DraftTree`, a
    (depth, top_k, num_nodes) triple or "D,K,N": draft an EAGLE-2 tree instead of a chain of k).
    Sampling: temperature 0 is greedy; top_k 0, top_p 1, min_p 0 and repetition_penalty 1 are off.
    Each may also be a per-row sequence. Stops: EOS (unless `ignore_eos`), `stop_token_ids`, `stop`
    strings, `max_new_tokens`. KV cache: `kv_format` ("f32", "bf16", "q8_0", "q5_1" or a (K, V)
    pair) and `attention` ("auto", "reference", "pallas", "interpret").
    """

    method: Method | str | None = None
    num_draft_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 1
    exit_layer: int | None = None
    draft_sampling: str | None = None
    tree: DraftTree | str | tuple[int, int, int] | None = None
    max_new_tokens: int = 128
    temperature: float | Sequence[float] = 0.0
    top_k: int | Sequence[int] = 0
    top_p: float | Sequence[float] = 1.0
    min_p: float | Sequence[float] = 0.0
    repetition_penalty: float | Sequence[float] = 1.0
    seed: int = 0
    chat: bool = False
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    kv_format: KVFormat | str | tuple[str, str] | None = None
    attention: Attention | str = "auto"

    def __post_init__(self):
        # Normalised in place (the dataclass is frozen): names become enums, sequences tuples.
        def normalise(name, value):
            object.__setattr__(self, name, value)

        if self.method is not None:
            normalise("method", Method.parse(self.method))
        k = self.num_draft_tokens
        if not is_integer(k) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise InvalidRequestError(f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}]; got {k!r}")
        if not (is_integer(self.ngram_min) and is_integer(self.ngram_max)
                and 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM):
            raise InvalidRequestError(
                f"need 1 <= ngram_min <= ngram_max <= {MAX_NGRAM}; got {self.ngram_min}, {self.ngram_max}")
        if self.exit_layer is not None and (not is_integer(self.exit_layer) or self.exit_layer < 1):
            raise InvalidRequestError(f"exit_layer must be an integer >= 1; got {self.exit_layer!r}")
        normalise("tree", DraftTree.parse(self.tree))
        if self.draft_sampling not in (None, *DRAFT_SAMPLING):
            raise InvalidRequestError(f"draft_sampling must be one of {DRAFT_SAMPLING}; got {self.draft_sampling!r}")
        if not is_integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 1; got {self.max_new_tokens!r}")
        self._check_sampling()
        if not is_integer(self.seed) or not 0 <= self.seed < 2**32:
            # jax.random.PRNGKey keeps 32 bits: a larger or negative seed would silently be another one
            raise InvalidRequestError(f"seed must be an integer in [0, 2**32); got {self.seed!r}")
        for name in ("num_draft_tokens", "ngram_min", "ngram_max", "max_new_tokens", "seed"):
            normalise(name, int(getattr(self, name)))  # numpy integers become the ints they are
        if self.exit_layer is not None:
            normalise("exit_layer", int(self.exit_layer))
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
        for name in ("chat", "ignore_eos"):
            if not isinstance(getattr(self, name), bool | np.bool_):
                raise InvalidRequestError(f"{name} must be True or False; got {getattr(self, name)!r:.40}")
            normalise(name, bool(getattr(self, name)))
        normalise("stop_token_ids", tuple(int(t) for t in stop_ids))
        if self.kv_format is not None:
            normalise("kv_format", KVFormat.parse(self.kv_format))
        attention = Attention.parse(self.attention)
        if attention is not Attention.AUTO:
            resolve_attention(attention)  # "pallas" off a GPU: a named error now, not at trace time
        normalise("attention", attention)

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
                    raise InvalidRequestError(f"{message}; got {float(value)!r}")

    @property
    def sampler(self) -> SamplerSpec:
        """Which sampling stages the compiled program needs for these values."""
        return spec_for(**self.sampling_values)

    @property
    def sampling_values(self) -> dict:
        """The per-row sampling values, as `SamplingParams.create` takes them."""
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty)

    @property
    def draft_options(self) -> DraftOptions:
        return DraftOptions(num_draft_tokens=int(self.num_draft_tokens), ngram_max=int(self.ngram_max),
                            ngram_min=int(self.ngram_min), exit_layer=self.exit_layer,
                            draft_sampling=self.draft_sampling, tree=self.tree)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "GenerateOptions":
        """Options from keyword arguments; an unknown name is an InvalidRequestError naming it."""
        unknown = sorted(set(kwargs) - {field.name for field in dataclasses.fields(cls)})
        if unknown:
            raise InvalidRequestError(f"unknown generate option(s) {', '.join(unknown)}; the options are the "
                                      f"fields of jaxspec.GenerateOptions")
        return cls(**kwargs)

