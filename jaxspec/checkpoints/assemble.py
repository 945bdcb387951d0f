"""What every reader returns, and how a family's params are assembled from named tensors.

Every source ends in the same `Checkpoint`: a family's config and its params pytree of float32
jax arrays in jaxspec's layout (HF's: weights `[out, in]`, rotate-half RoPE rows), typed as the
family's params dataclass (the structure of its `param_shapes`), so the models never know where
their weights came from. A reader only supplies `read(name) -> float32 numpy`; `assemble_params`
walks the family's tensor tree, applies each leaf's transform and checks every shape against
the config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import re
from collections.abc import Callable, Container, Iterable
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxspec.errors import CheckpointError, JaxspecError, UnsupportedModelError
from jaxspec.hostmem import aligned, release_freed_memory
from jaxspec.models.family import TensorSource
from jaxspec.models.params import is_shape


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Checkpoint:
    """A loaded model: everything `generate` needs, whatever the source format."""

    config: Any  # the family's config (ModelConfig, Qwen35Config, ...)
    params: Any  # the family's params dataclass (e.g. LlamaParams) of float32 jax arrays
    # HF or converted-from-HF directory holding the tokenizer files; or, for GGUF, the
    # `tokenizer.*` metadata keys verbatim ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", ...).
    tokenizer_source: pathlib.Path | dict[str, Any]
    source: pathlib.Path
    tokenizer: Any = None  # the Tokenizer, where the loader built it already (a GGUF's, from its header)


def assemble_params(
    shapes: Any,
    tensors: Any,
    read: Callable[[str], np.ndarray],
    *,
    available: Container[str],
    source: str,
    path: pathlib.Path,
    progress: bool,
) -> Any:
    """The params tree as float32 numpy: each leaf read by name, transformed, shape-checked.

    shapes: the family's param_shapes(cfg); tensors: its TensorSource tree of the same
    structure; `read(name)` returns a stored tensor as float32, for any name in `available`.
    Errors read "{source} {path} lacks tensor ..." (source: "GGUF file", "HF checkpoint"),
    with the TensorSource's note saying why the config expects it.
    """
    bar = tqdm(total=len(jax.tree.leaves(shapes, is_leaf=is_shape)), desc=f"loading {path.name}", unit="tensor",
               disable=not progress)

    def read_leaf(shape: tuple[int, ...], tensor: TensorSource) -> np.ndarray:
        if tensor.name not in available:
            raise CheckpointError(f"{source} {path} lacks tensor {tensor.name!r}{tensor.note}")
        stored = read(tensor.name)
        try:
            array = tensor.apply(stored)
        except ValueError:  # a transform's reshape by the config's head counts (GGUF's Q/K row order)
            raise CheckpointError(
                f"tensor {tensor.name!r} in {path} has shape {tuple(stored.shape)}, expected {shape} from the "
                "config") from None
        if tuple(array.shape) != shape:
            raise CheckpointError(
                f"tensor {tensor.name!r} in {path} has shape {tuple(array.shape)}, expected {shape} from the config")
        bar.update()
        return aligned(np.asarray(array, dtype=np.float32))  # so that to_jax adopts it, not copies it

    with bar:
        # Leaves come in the params types' field order (embed, layer by layer, final norm, head),
        # so the first tensor that fails is the first a reader meets.
        return jax.tree.map(read_leaf, shapes, tensors, is_leaf=is_shape)


def to_jax(params: Any) -> Any:
    """Host params -> jax arrays on the default device.

    The numpy leaves are freshly made and owned by nobody else, so the CPU backend may alias
    them instead of copying where they start on its alignment (`aligned`: a GGUF's dequantized
    tensors do), skipping a copy of every weight.
    """
    return jax.device_put(params, may_alias=True)


def to_jax_consuming(leaves: list) -> list:
    """`leaves` (a flattened tree's host arrays, the list their only holder) on the device, each
    host array dropped from the list as soon as its device copy exists: moving a tree whose
    arrays jax cannot adopt then peaks near one copy of it, not two (`to_jax` on the whole tree)."""
    for index, leaf in enumerate(leaves):
        leaves[index] = None
        # Waited for: a copy still in flight keeps its host array alive, and unwaited the copies
        # of a whole tree pile up behind the loop (a 2.4 GB tree peaked at twice its size).
        leaves[index], leaf = jax.block_until_ready(jax.device_put(leaf, may_alias=True)), None
        release_freed_memory()
    return leaves


@contextlib.contextmanager
def config_values_checked(source: Any):
    """Turn what a config parse raises on a value of the wrong type or range (int("abc"), a
    division by a zero head count, a list where a dict belongs, the parse's own CheckpointError
    for "32" where an integer belongs: `config.count`) into a CheckpointError naming `source`; a
    config jaxspec refuses (UnsupportedModelError: a zero size, a NaN theta, an unknown RoPE type)
    is re-raised with `source` named; other jaxspec errors pass through."""
    try:
        yield
    except UnsupportedModelError as err:
        message = str(err)
        raise UnsupportedModelError(message if message.startswith(f"{source}:") else f"{source}: {message}") from None
    except CheckpointError as err:
        message = str(err)
        if str(source) in message:  # a refusal that names its file already
            raise
        raise CheckpointError(f"{source}: a config value has the wrong type or range ({message})") from None
    except JaxspecError:
        raise
    except (TypeError, ValueError, ArithmeticError, KeyError, IndexError, AttributeError) as err:
        raise CheckpointError(f"{source}: a config value has the wrong type or range ({type(err).__name__}: "
                              f"{err})") from None


def check_layer_count(declared: Any, names: Iterable[str], layer_name: re.Pattern[str], *, field: str,
                      source: Any) -> None:
    """A config's layer count against the layers the file holds tensors for, before anything is
    sized by it: a count of 0xFFFFFFFF would otherwise build a params tree of four billion layers,
    and 7 on a 30-layer file would silently load a 7-layer model.

    `layer_name` matches a layer tensor's name with the layer index as its group (GGUF:
    `blk.{i}.`; HF: `{prefix}layers.{i}.`). The layers present must be exactly 0 .. declared - 1.
    """
    if isinstance(declared, bool) or not isinstance(declared, int) or declared < 1:
        raise CheckpointError(f"{source}: {field} is {declared!r}; expected a positive integer")
    present = {int(match.group(1)) for match in map(layer_name.match, names) if match}
    if len(present) == declared and present and min(present) == 0 and max(present) == declared - 1:
        return  # exactly 0 .. declared - 1 (never built as a set: declared may be 2**32)
    if not present:
        raise CheckpointError(f"{source}: {field} is {declared} but the file holds no layer tensors")
    held = (f"layers 0..{max(present)}" if len(present) == max(present) + 1
            else f"layers {sorted(present)[:8]}{'...' if len(present) > 8 else ''}")
    raise CheckpointError(f"{source}: {field} is {declared} but the file holds tensors for {held} "
                          f"({len(present)} layers)")
