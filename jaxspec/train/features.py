"""The target's half of a training batch: its hidden features and its own next-token labels.

`target_batch` runs the target over a batch (one jitted program for every batch of a shape);
`FeatureCache` / `cache_features` keep its output for every row of a Dataset on disk, computed
once, so each training step costs only the head. `target_source` is what the training loop reads
batches through: from the run's cache (the default), or a fresh target pass per batch (soft
labels need the target's whole distribution, which the cache does not keep).

A cache is only read for the data and target it was built from (recorded in its meta.json), and
it never holds a non-finite value: a float16 overflow raises UnsupportedModelError.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
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
    """The target's half of every row of a Dataset, computed once and kept on disk in chunks.

    Recomputing the target per step costs a full forward over B x T tokens (for SmolLM2-135M at
    8 x 256, ~0.55 TFLOP: more than the head's forward and backward); cached, each epoch after the
    first costs only the head. Rows are stored in order of length, `chunk_rows` to a chunk, each
    chunk only as wide as its longest row needs (`bucket_widths`), so a corpus of short answers in
    a long window costs its tokens, not rows x window. Per chunk, two memory-mapped .npy files:

        features_{c}.npy   float16[n, F, W_c, D]   the target's hidden layers (F = len(hidden_layers))
        labels_{c}.npy     int32[n, W_c]           the target's next-token argmax per position

    float16 halves the bytes of float32 (SmolLM2's residual stream stays far inside its range;
    a chunk that overflows is refused). `meta.json` records the data fingerprint, the layers, the
    layout and the target, so a cache built for other data or another target is never read; one
    built with more layers serves any subset of them (an EAGLE-3 and an MTP head can share one
    cache). A chunk appears atomically (written aside, then renamed), so an interrupted build
    resumes at the next chunk.
    """

    directory: pathlib.Path
    chunk_rows: int
    layers: tuple[int, ...]  # the hidden layers stored, in order
    features: tuple[np.ndarray, ...]  # per chunk float16[n, F, W_c, D] (memory-mapped)
    labels: tuple[np.ndarray, ...]  # per chunk int32[n, W_c]
    slot: np.ndarray  # int64[N]: data row -> its place in length order (chunk = slot // chunk_rows)
    seq_len: int  # the data's window

    def rows(self, indices: np.ndarray, layers: tuple[int, ...] | None = None,
             width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(float32[B, F', W, D], int32[B, W]) for data rows `indices` and `layers` (default: all
        stored), `width` positions wide (default the window); -1 gives a zero row. Positions past
        a row's chunk width (past its end: padding) are zero."""
        select = [self.layers.index(layer) for layer in (layers or self.layers)]
        width = self.seq_len if width is None else width
        indices = np.asarray(indices)
        feats = np.zeros((len(indices), len(select), width, self.features[0].shape[-1]), np.float32)
        labels = np.zeros((len(indices), width), np.int32)
        for out, index in enumerate(indices):
            if index < 0:
                continue
            chunk, offset = divmod(int(self.slot[index]), self.chunk_rows)
            stored = min(width, self.labels[chunk].shape[1])
            feats[out, :, :stored] = self.features[chunk][offset, select, :stored]
            labels[out, :stored] = self.labels[chunk][offset, :stored]
        return feats, labels


FEATURE_META = "meta.json"
FEATURE_LAYOUT = "by_length/1"  # rows in length order, chunks as wide as their rows need


def target_identity(target: Model) -> dict[str, str]:
    """What a target's features depend on beyond the data: its config and its weights' format (an
    int8 trunk's hidden states are not its float32 trunk's, and a head serves one of them)."""
    return {"target_config": repr(target.config), "target_weights": quant.format_of(target.params).value}


def cache_features(target: Model, data: Dataset, hidden_layers: tuple[int, ...], directory: str | os.PathLike[str],
                   *, batch_size: int = 8, chunk_rows: int = 64, bucket_width: int = 256,
                   progress: bool = False) -> FeatureCache:
    """Run the target over every row of `data` once (batches of `batch_size`, one compile per
    width) and keep its `hidden_layers` and next-token argmax in `directory` (see FeatureCache;
    chunk widths are multiples of `bucket_width`, 0: the whole window). Chunks already there for
    the same data, layout and target, holding these layers or more, are reused."""
    from tqdm.auto import tqdm

    if chunk_rows % batch_size:
        raise InvalidRequestError(f"chunk_rows ({chunk_rows}) must be a multiple of batch_size ({batch_size})")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"data": data.fingerprint(), **target_identity(target), "dtype": "float16", "layout": FEATURE_LAYOUT, "bucket_width": bucket_width, "hidden_layers": list(hidden_layers),
            "chunk_rows": chunk_rows}
    meta_path = directory / FEATURE_META
    if meta_path.is_file():
        saved = json.loads(meta_path.read_text(encoding="utf-8"))
        same_source = all(saved.get(key) == meta[key]
                          for key in ("data", "target_config", "target_weights", "dtype", "layout"))
        if same_source and set(hidden_layers) <= set(saved.get("hidden_layers", ())):
            meta = saved  # this data's cache, with our layers among its own: read ours out of it
        else:
            for stale in directory.glob("*.npy"):  # built for other data, layers, target or weights
                stale.unlink()
    meta_path.write_text(json.dumps(meta, indent=2), encoding="utf-8")
    stored, chunk_rows = tuple(meta["hidden_layers"]), int(meta["chunk_rows"])
    if chunk_rows % batch_size:  # a reused cache's chunks: fill them in whole batches still
        batch_size = math.gcd(batch_size, chunk_rows)
    order = np.argsort(data.lengths, kind="stable")  # slot -> data row
    slot = np.empty(len(data), np.int64)
    slot[order] = np.arange(len(data))
    widths = bucket_widths(data.lengths, int(meta["bucket_width"]), data.seq_len)
    num_chunks = -(-len(data) // chunk_rows)
    names = [(directory / f"features_{c:05d}.npy", directory / f"labels_{c:05d}.npy") for c in range(num_chunks)]
    todo = [c for c, (feat, lab) in enumerate(names) if not (feat.is_file() and lab.is_file())]
    with tqdm(total=len(data), initial=len(data) - sum(min(chunk_rows, len(data) - c * chunk_rows) for c in todo),
              desc="target features", unit="row", disable=not progress) as bar:
        for chunk in todo:
            rows = order[chunk * chunk_rows: (chunk + 1) * chunk_rows].tolist()
            width = int(widths[rows].max())  # the longest row's (the rows are in length order)
            feats, labels = [], []
            for first in range(0, len(rows), batch_size):
                indices = rows[first: first + batch_size]
                padded = indices + [-1] * (batch_size - len(indices))
                out = target_batch(target.params, target.config, stored, data.batch(padded, width))
                stacked = np.stack([np.asarray(f) for f in out["features"]], axis=1)  # [B, F, W, D]
                feats.append(stacked[: len(indices)].astype(np.float16))
                labels.append(np.asarray(out["labels"])[: len(indices)])
                bar.update(len(indices))
            feats, labels = np.concatenate(feats), np.concatenate(labels)
            if not np.isfinite(feats).all():
                raise UnsupportedModelError(
                    f"the target's hidden states overflow float16 in chunk {chunk}; "
                    "train without the feature cache (cache_features=False)")
            for path, array in zip(names[chunk], (feats, labels)):
                aside = path.with_suffix(".partial.npy")
                np.save(aside, array)
                os.replace(aside, path)
    return FeatureCache(directory=directory, chunk_rows=chunk_rows, layers=stored,
                        features=tuple(np.load(feat, mmap_mode="r") for feat, _ in names),
                        labels=tuple(np.load(lab, mmap_mode="r") for _, lab in names), slot=slot,
                        seq_len=data.seq_len)


def _targets(target_params: Any, frozen: Frozen, batch: dict[str, jax.Array], spec: StepSpec) -> dict[str, Any]:
    draft_ids = frozen["draft_ids"] if spec.train.soft_labels else None
    return target_batch(target_params, spec.target_cfg, spec.hidden_layers, batch, draft_ids)


def target_source(target: Model, data: Dataset, frozen: Frozen, spec: StepSpec, feature_dir: pathlib.Path,
                  progress: bool):
    """`targets_for(rows, width)`: the target's half of the batch of data rows `rows` (-1: an
    empty row), `width` positions wide, read from the run's FeatureCache (built on first use) or
    recomputed by a target forward."""
    cfg = spec.train
    if not cfg.cache_features:
        return lambda rows, width: _targets(target.params, frozen, data.batch(rows, width), spec)
    # The cache also keeps the final-normed stream (layer L, an MTP head's input), which the
    # forward computes anyway: an EAGLE-3 run's cache then serves an MTP run on the same data.
    layers = tuple(dict.fromkeys(spec.hidden_layers + (target.config.num_layers,)))
    cache = cache_features(target, data, layers, feature_dir, batch_size=cfg.batch_size,
                           chunk_rows=cfg.batch_size * max(1, 64 // cfg.batch_size), bucket_width=cfg.bucket_width,
                           progress=progress)

    def targets_for(rows, width):
        batch = data.batch(rows, width)
        features, labels = cache.rows(rows, spec.hidden_layers, width)  # [B, F, W, D], [B, W]
        return {"tokens": batch["tokens"], "features": tuple(jnp.asarray(features[:, i]) for i in range(features.shape[1])),
                "labels": jnp.asarray(labels),
                "loss_mask": batch["loss_mask"]}

    return targets_for
