"""The target's half of a training batch: its hidden features and its own next-token labels.

`target_batch` runs the target over a batch (one jitted program for every batch of a shape);
`FeatureCache` / `cache_features` keep its output for every row on disk, computed once (a row
is found by its tokens, so one cache serves every Dataset holding it), so each training step
costs only the head. `target_source` is what the training loop reads
batches through: from the run's cache (the default), or a fresh target pass per batch (soft
labels need the target's whole distribution, which the cache does not keep).

A cache is only read for the target it was built by (recorded in its meta.json), and it never
holds a non-finite value: a float16 overflow raises UnsupportedModelError.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import compilation, models
from jaxspec.api import Model
from jaxspec.errors import InvalidRequestError, UnsupportedModelError
from jaxspec.models import quant
from jaxspec.train.config import StepSpec
from jaxspec.train.data import Dataset, bucket_widths
from jaxspec.train.heads import Frozen


# Jitted: one program for training and validation batches alike (the head's steps compile apart).
# The target's features at full float32 precision, as generation computes them (jaxspec.compilation).
@functools.partial(jax.jit, static_argnames=("target_cfg", "hidden_layers"))
@compilation.full_precision_products
def target_batch(target_params: Any, target_cfg, hidden_layers: tuple[int, ...], batch: dict[str, jax.Array],
                 draft_ids: jax.Array | None = None) -> dict[str, Any]:
    """The target's half of a training batch (right-padded; padding follows each row's tokens and
    attention is causal, so it changes nothing before it):

        tokens      int32[B, T]   the batch's tokens
        features    tuple of [B, T, D], the target's `hidden_layers` (EAGLE-3: its three aux
                    layers; MTP: (L,), the final-normed stream)
        labels      int32[B, T]   the target's own next-token argmax at each position
        loss_mask   bool[B, T]    position t's prediction is an assistant token (Dataset.batch, loss_mask)
        label_probs [B, T, Vd]    with `draft_ids`: the target's distribution restricted to them
    """
    tokens = batch["tokens"]  # int32[B, T]
    rows, seq_len = tokens.shape
    cache = models.create_cache(target_cfg, rows, seq_len)
    logits, features, _ = models.forward(target_params, target_cfg, tokens, cache, hidden_layers=hidden_layers)
    out = {"tokens": tokens, "features": features, "labels": jnp.argmax(logits, axis=-1).astype(jnp.int32),
           "loss_mask": batch["loss_mask"]}
    if draft_ids is not None:
        out["label_probs"] = jax.nn.softmax(jnp.take(logits, draft_ids, axis=-1), axis=-1)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class FeatureCache:
    """The target's half of every row it has seen, computed once and kept on disk in shards,
    found by each row's content: the tokens of the row (`row_keys`).

    Recomputing the target per step costs a full forward over B x T tokens (for SmolLM2-135M at
    8 x 256, ~0.55 TFLOP: more than the head's forward and backward); cached, each epoch after the
    first costs only the head. Because a row is found by its tokens, not by its place in one
    Dataset, a cache serves any data whose rows it holds: a corpus growing a round at a time
    computes each round's rows once, and a run on the union of rounds reads them all (a round's
    pass is long on a CPU: bench/RESULTS.md, "Feature-pass forwards: rows per forward"). Rows
    missing from the cache are computed in shards of `chunk_rows`, in order of length, each shard
    only as wide as its longest row needs (`bucket_widths`), so short answers in a long window
    cost their tokens, not rows x window. Per shard n, three memory-mapped .npy files:

        features_{n}.npy   float16[r, F, W_n, D]   the target's hidden layers (F = len(layers))
        labels_{n}.npy     int32[r, W_n]           the target's next-token argmax per position
        rows_{n}.npy       uint8[r, 16]            each row's key (written last: the shard's commit)

    float16 halves the bytes of float32 (SmolLM2's residual stream stays far inside its range;
    a shard that overflows is refused). `meta.json` records the layers, the layout and the target
    (its config and weight format), so a cache built by another target is never read; one built
    with more layers serves any subset of them (an EAGLE-3 and an MTP head can share one cache).
    A file appears atomically (written aside, then renamed) and a shard counts only once its row
    keys are written, so an interrupted build resumes at the shard it was writing. One process
    builds a cache at a time.
    """

    directory: pathlib.Path
    layers: tuple[int, ...]  # the hidden layers stored, in order
    features: tuple[np.ndarray, ...]  # per shard float16[r, F, W_n, D] (memory-mapped)
    labels: tuple[np.ndarray, ...]  # per shard int32[r, W_n]
    place: np.ndarray  # int64[N, 2]: data row -> (its shard's index in `features`, row within it)
    seq_len: int  # the data's window

    def rows(self, indices: np.ndarray, layers: tuple[int, ...] | None = None,
             width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(float32[B, F', W, D], int32[B, W]) for data rows `indices` and `layers` (default: all
        stored), `width` positions wide (default the window); -1 gives a zero row. Positions past
        a row's shard width (past its end: padding) are zero."""
        select = [self.layers.index(layer) for layer in (layers or self.layers)]
        width = self.seq_len if width is None else width
        indices = np.asarray(indices)
        feats = np.zeros((len(indices), len(select), width, self.features[0].shape[-1]), np.float32)
        labels = np.zeros((len(indices), width), np.int32)
        for out, index in enumerate(indices):
            if index < 0:
                continue
            shard, offset = (int(x) for x in self.place[index])
            stored = min(width, self.labels[shard].shape[1])
            feats[out, :, :stored] = self.features[shard][offset, select, :stored]
            labels[out, :stored] = self.labels[shard][offset, :stored]
        return feats, labels


FEATURE_META = "meta.json"
FEATURE_LAYOUT = "by_row/2"  # shards found by row content, each as wide as its rows need
ROW_KEY_BYTES = 16
# Rows per target forward: as many as fill this many tokens (a power of two, at least one). The
# labels take the argmax of every position's full-vocabulary logits, float32 [B, W, 49152]: 1.6 GB
# at 8 x 1,024, where 2 x 1,024 runs faster per token (bench/RESULTS.md, "Feature-pass forwards:
# rows per forward").
TOKENS_PER_FORWARD = 2048


def row_keys(data: Dataset) -> np.ndarray:
    """uint8[N, 16]: each row's key, a hash of its tokens (the target's features and labels at a
    row's positions depend on them alone: attention is causal, padding follows)."""
    keys = np.empty((len(data), ROW_KEY_BYTES), np.uint8)
    for row, (tokens, length) in enumerate(zip(data.tokens, data.lengths)):
        digest = hashlib.blake2b(np.ascontiguousarray(tokens[:length], np.int32).tobytes(), digest_size=ROW_KEY_BYTES)
        keys[row] = np.frombuffer(digest.digest(), np.uint8)
    return keys


def target_identity(target: Model) -> dict[str, str]:
    """What a target's features depend on beyond the data: its config and its weights' format (an
    int8 trunk's hidden states are not its float32 trunk's, and a head serves one of them)."""
    return {"target_config": repr(target.config), "target_weights": quant.format_of(target.params).value}


def _save_atomically(path: pathlib.Path, array: np.ndarray) -> None:
    aside = path.with_suffix(".partial.npy")
    np.save(aside, array)
    os.replace(aside, path)


def _forward_rows(width: int, tokens_per_forward: int) -> int:
    return 1 << max(0, (tokens_per_forward // width).bit_length() - 1)


def cache_features(target: Model, data: Dataset, hidden_layers: tuple[int, ...], directory: str | os.PathLike[str],
                   *, chunk_rows: int = 64, bucket_width: int = 256, tokens_per_forward: int = TOKENS_PER_FORWARD,
                   progress: bool = False) -> FeatureCache:
    """Run the target over every row of `data` that `directory` does not hold yet (see
    FeatureCache: new shards of `chunk_rows` rows, widths multiples of `bucket_width`, 0: the
    whole window; forwards of about `tokens_per_forward` tokens, one compile per shape) and keep
    its `hidden_layers` and next-token argmax there. A cache built by the same target and weights,
    holding these layers or more, is extended; any other is rebuilt."""
    from tqdm.auto import tqdm

    for name, value in (("chunk_rows", chunk_rows), ("tokens_per_forward", tokens_per_forward)):
        if not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"{name} must be an integer >= 1; got {value!r}")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    source = {**target_identity(target), "dtype": "float16", "layout": FEATURE_LAYOUT}  # what the features depend on
    meta = {**source, "hidden_layers": list(hidden_layers)}
    meta_path = directory / FEATURE_META
    if meta_path.is_file():
        saved = json.loads(meta_path.read_text(encoding="utf-8"))
        same_source = all(saved.get(key) == value for key, value in source.items())
        if same_source and set(hidden_layers) <= set(saved.get("hidden_layers", ())):
            meta = saved  # this target's cache, with our layers among its own: read ours out of it
        else:
            for stale in directory.glob("*.npy"):  # built by another target, weights, layout or layers
                stale.unlink()
    meta_path.write_text(json.dumps(meta, indent=2), encoding="utf-8")
    stored = tuple(meta["hidden_layers"])

    # The shards already there; one without its row keys was interrupted, and its rows are computed anew.
    shards = sorted(int(path.stem.split("_")[1]) for path in directory.glob("rows_*.npy")
                    if not path.stem.endswith(".partial"))
    for orphan in directory.glob("*.npy"):
        if orphan.stem.endswith(".partial") or int(orphan.stem.split("_")[1]) not in shards:
            orphan.unlink()
    index = {}  # row key -> (shard, row within it)
    for shard in shards:
        for offset, key in enumerate(np.load(directory / f"rows_{shard:05d}.npy")):
            index.setdefault(key.tobytes(), (shard, offset))
    keys = row_keys(data)
    missing = {}  # row key -> the first data row with it, for rows the cache lacks
    for row, key in enumerate(keys):
        if key.tobytes() not in index:
            missing.setdefault(key.tobytes(), row)
    todo = np.asarray(sorted(missing.values(), key=lambda row: (int(data.lengths[row]), row)), np.int64)
    widths = bucket_widths(data.lengths, bucket_width, data.seq_len)
    next_shard = shards[-1] + 1 if shards else 0
    with tqdm(total=len(todo), desc="target features", unit="row", disable=not progress or not len(todo)) as bar:
        for first in range(0, len(todo), chunk_rows):
            rows = todo[first: first + chunk_rows].tolist()
            width = int(widths[rows].max())  # the longest row's (the rows are in length order)
            per_forward = _forward_rows(width, tokens_per_forward)
            feats, labels = [], []
            for start in range(0, len(rows), per_forward):
                indices = rows[start: start + per_forward]
                padded = indices + [-1] * (per_forward - len(indices))
                out = target_batch(target.params, target.config, stored, data.batch(padded, width))
                stacked = np.stack([np.asarray(f) for f in out["features"]], axis=1)  # [B, F, W, D]
                feats.append(stacked[: len(indices)].astype(np.float16))
                labels.append(np.asarray(out["labels"])[: len(indices)])
                bar.update(len(indices))
            feats, labels = np.concatenate(feats), np.concatenate(labels)
            if not np.isfinite(feats).all():
                raise UnsupportedModelError(
                    "the target's hidden states overflow float16 in this data; "
                    "train without the feature cache (cache_features=False)")
            shard = next_shard
            next_shard += 1
            _save_atomically(directory / f"features_{shard:05d}.npy", feats)
            _save_atomically(directory / f"labels_{shard:05d}.npy", labels)
            _save_atomically(directory / f"rows_{shard:05d}.npy", keys[rows])  # the shard now counts
            shards.append(shard)
            for offset, row in enumerate(rows):
                index[keys[row].tobytes()] = (shard, offset)
    slot_of = {shard: i for i, shard in enumerate(shards)}
    place = np.asarray([(slot_of[index[key.tobytes()][0]], index[key.tobytes()][1]) for key in keys],
                       np.int64).reshape(len(data), 2)
    return FeatureCache(directory=directory, layers=stored,
                        features=tuple(np.load(directory / f"features_{s:05d}.npy", mmap_mode="r") for s in shards),
                        labels=tuple(np.load(directory / f"labels_{s:05d}.npy", mmap_mode="r") for s in shards),
                        place=place, seq_len=data.seq_len)


def _targets(target_params: Any, frozen: Frozen, batch: dict[str, jax.Array], spec: StepSpec) -> dict[str, Any]:
    draft_ids = frozen["draft_ids"] if spec.train.soft_labels else None
    return target_batch(target_params, spec.target_cfg, spec.hidden_layers, batch, draft_ids)


def _labelled(targets: dict[str, Any], spec: StepSpec) -> dict[str, Any]:
    """`targets` with the labels `TrainConfig.labels` asks for: the target's argmax as computed,
    or each position's next token in the row (the last position's next is beyond the batch; the
    loss mask never holds it)."""
    if spec.train.labels == "text":
        return {**targets, "labels": jnp.pad(targets["tokens"][:, 1:], ((0, 0), (0, 1)))}  # [B, W]
    return targets


def target_source(target: Model, data: Dataset, frozen: Frozen, spec: StepSpec, feature_dir: pathlib.Path,
                  progress: bool):
    """`targets_for(rows, width)`: the target's half of the batch of data rows `rows` (-1: an
    empty row), `width` positions wide, read from the run's FeatureCache (built on first use) or
    recomputed by a target forward."""
    cfg = spec.train
    if not cfg.cache_features:
        return lambda rows, width: _labelled(_targets(target.params, frozen, data.batch(rows, width), spec), spec)
    # The cache also keeps the final-normed stream (layer L, an MTP head's input), which the
    # forward computes anyway: an EAGLE-3 run's cache then serves an MTP run on the same data.
    layers = tuple(dict.fromkeys(spec.hidden_layers + (target.config.num_layers,)))
    cache = cache_features(target, data, layers, feature_dir, bucket_width=cfg.bucket_width, progress=progress)

    def targets_for(rows, width):
        batch = data.batch(rows, width)
        features, labels = cache.rows(rows, spec.hidden_layers, width)  # [B, F, W, D], [B, W]
        return _labelled({"tokens": batch["tokens"],
                          "features": tuple(jnp.asarray(features[:, i]) for i in range(features.shape[1])),
                          "labels": jnp.asarray(labels), "loss_mask": batch["loss_mask"]}, spec)

    return targets_for
