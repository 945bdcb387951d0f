"""Model families: what a loader needs to know about a trunk, in one frozen descriptor.

A `Family` says how one trunk kind (Llama and its relatives; Qwen3.5's hybrid) is stored and
named: which HF `model_type`s and GGUF architectures it claims, how its config is parsed from
either and written to and from a converted directory's JSON, the shape of every param leaf, and
the tensor in each checkpoint format that fills that leaf (with the transform from
stored values to jaxspec's layout, e.g. llama.cpp's Q/K row permutation undone). Each trunk module
builds its descriptor at its end and `jaxspec.models` registers it; `jaxspec.checkpoints` reads
every format through these descriptors and never names a family itself.

The contract between the trees a family gives for one config: `param_shapes(cfg)`,
`hf_tensors(cfg, prefix)` and `gguf_tensors(cfg, arch)` are instances of the family's params
type (jaxspec.models.params), leaf for leaf (shape tuples; `TensorSource`s), so their structure
is the params pytree's by construction; the logical axes are the type's own
(`logical_axes(param_shapes(cfg))`), not a table beside it.
This module imports nothing from the loaders: models never depend on how files are read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Where one param leaf lives in a checkpoint, and how its stored values become the leaf."""

    name: str  # the tensor's full name in the file
    # stored float32 values -> the param's values (None: taken as stored)
    transform: Callable[[np.ndarray], np.ndarray] | None = None
    note: str = ""  # why the config implies this tensor, appended to "lacks tensor" errors

    def apply(self, stored: np.ndarray) -> np.ndarray:
        return stored if self.transform is None else self.transform(stored)


def _any_tree(cfg: Any, depth: int, whose: str) -> None:
    """Attention-only trunks verify a tree of any depth under its ancestor mask."""


def _rolls_back_by_length(cfg: Any, steps: int, recorded: int) -> Any:
    """Attention caches roll back any distance by setting a length: the config serves as it is."""
    return cfg


def _first_layers(cfg: Any, num_layers: int) -> Any:
    return dataclasses.replace(cfg, num_layers=num_layers)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Family:
    """One trunk kind: its config, forward and cache, and its checkpoint layouts."""

    name: str  # the family's name, written into converted directories
    config_class: type
    params_class: type  # the params dataclass (jaxspec.models.params) its forward takes
    forward: Callable[..., Any]  # the trunk contract of jaxspec.models
    create_cache: Callable[..., Any]  # (cfg, batch, capacity, **options) -> cache
    # HF: the config.json `model_type`s claimed, their parse, and the trunk's tensor-name prefixes
    # tried in order (ForConditionalGeneration, ForCausalLM, bare trunk), found by `embed`'s name.
    hf_model_types: tuple[str, ...]
    config_from_hf: Callable[[Mapping[str, Any]], Any]
    hf_prefixes: tuple[str, ...]
    hf_embed: str  # the embedding's name after the prefix
    hf_tensors: Callable[[Any, str], Any]  # (cfg, prefix) -> params tree of TensorSources
    # The config's name for info(): e.g. "llama", "qwen3", "qwen3_5".
    architecture: Callable[[Any], str]
    param_shapes: Callable[[Any], Any]  # cfg -> params tree of shape tuples
    config_to_dict: Callable[[Any], dict[str, Any]]  # JSON-able; config_from_dict inverts it
    config_from_dict: Callable[[Mapping[str, Any]], Any]
    # GGUF, for families llama.cpp writes: `general.architecture` values claimed; the config
    # from (metadata, tensor name -> shape, source for messages); the tensor tree for (cfg, arch).
    gguf_architectures: tuple[str, ...] = ()
    config_from_gguf: Callable[[Mapping[str, Any], Mapping[str, tuple[int, ...]], str], Any] | None = None
    gguf_tensors: Callable[[Any, str], Any] | None = None
    # What speculation may ask of the trunk (the defaults: an attention-only trunk).
    # check_tree(cfg, depth, whose): raise, naming `whose` ("target", "draft"), where the trunk
    # cannot verify a draft tree of `depth` (a recurrent layer, a sliding window shorter than it).
    check_tree: Callable[[Any, int, str], None] = _any_tree
    # with_rollback(cfg, steps, recorded): the config whose cache can roll back `steps` positions
    # and records `recorded` positions' states per forward (a recurrent trunk's state ring).
    with_rollback: Callable[[Any, int, int], Any] = _rolls_back_by_length
    # Whether a forward may carry filler tokens past the real ones (a backend's token lanes): a
    # recurrent layer would fold them into its state.
    takes_filler_tokens: bool = True
    truncated: Callable[[Any, int], Any] = _first_layers  # (cfg, n) -> the config of its first n layers

    def hf_prefix(self, names: Mapping[str, Any] | frozenset[str]) -> str | None:
        """The prefix under which `names` (a directory's tensors) hold this trunk, or None."""
        return next((p for p in self.hf_prefixes if f"{p}{self.hf_embed}" in names), None)
