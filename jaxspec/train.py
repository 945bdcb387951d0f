"""Training a draft head (EAGLE-3 or MTP) on a target model's own hidden states.

The pipeline, each stage a plain function:

    prompts   read_prompts_jsonl / tokenize_prompts      JSONL -> token ids
    answers   self_distill                               the target answers them greedily (batched
                                                         `jaxspec.generate`), so the head learns the
                                                         distribution it will be verified against
    batches   pack                                       right-padded int32[N, T] + lengths
    vocab     draft_vocab                                the Vd most frequent response tokens -> d2t, t2d
    features  cache_features / target_batch              the target's aux hiddens and its own next-token
                                                         argmax: computed once per row into a chunked
                                                         on-disk FeatureCache (default), or recomputed
                                                         per batch (soft labels)
    training  train                                      AdamW + warmup/cosine + clipping, the EAGLE-3
                                                         training-time test, orbax checkpoints, resumable
    output    save_eagle3 / save_mtp_head (checkpoints; jaxspec.load reads both)

Alignment (the inference convention of models/eagle3.py and models/mtp.py): head slot p reads
(target feature p, token p + 1) and drafts token p + 2; the label is what the *target* predicts at
position p + 1, its argmax (or its distribution over the draft vocabulary). Only positions whose
prediction lands in the response count (the loss mask); prompts are context, not targets.

The training-time test (EAGLE-3, "TTT"): the head is unrolled `ttt_steps` times over the whole
sequence at once. Step 0 reads the encoded target features; step j > 0 reads the head's own
g_next from step j - 1 shifted right by one position, so slot p at step j carries a feature the
head derived from the target feature at p - j through j of its own steps, exactly the chain a
depth-j draft runs at inference. Tokens stay the ground truth (a deeper draft only matters when
the shallower ones were accepted). Each step attends causally over its own sequence (a fresh KV
cache of T slots): at inference the earlier slots hold target features rather than the head's own,
a simplification of the paper's tree mask that keeps every step a plain head forward. Step j's
loss is weighted `step_decay ** j`. MTP trains through the same code with its own forward, the
target's final-normed hidden as the feature and the target's vocabulary.

Resuming: the data order is a pure function of (seed, step), the dataset and the run's settings
are saved beside the orbax checkpoints (params, optimizer state, step), so a resumed run takes
the same batches in the same order as an uninterrupted one and ends with the same params.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec import checkpoints, models
from jaxspec.api import Model, SpecStats, generate, lm_head_of, prompt_ids
from jaxspec.config import ModelConfig
from jaxspec.errors import CheckpointError, InvalidRequestError, UnsupportedModelError
from jaxspec.models import eagle3, mtp

HeadParams = eagle3.Eagle3Params | mtp.MtpParams  # the trained head's own params
Frozen = dict[str, jax.Array]  # the target's arrays a head step reads beside them (embed, lm_head, vocab maps)

DATA_FILE = "train_data.npz"
RUN_FILE = "train_run.json"
CHECKPOINT_DIR = "train_checkpoints"
FEATURE_DIR = "features"
MTP_HEAD_DIR = "mtp_head"


class Method(enum.Enum):
    EAGLE3 = "eagle3"
    MTP = "mtp"


# ----------------------------------------------------------------------------------------------
# Prompts and self-distillation
# ----------------------------------------------------------------------------------------------

def read_prompts_jsonl(path: str | os.PathLike[str]) -> list[str | list[int]]:
    """One JSON object per line with a "prompt" or "text" field: a string, or a list of token ids
    (for models without a tokenizer). Blank lines are skipped; anything else names its line."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise InvalidRequestError(f"prompt file not found: {path}")
    prompts: list[str | list[int]] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InvalidRequestError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise InvalidRequestError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            prompt = record.get("prompt", record.get("text"))
            if prompt is None:
                raise InvalidRequestError(f"{path}:{number}: the object has no \"prompt\" or \"text\" field")
            is_ids = isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            if not (isinstance(prompt, str) and prompt.strip()) and not is_ids:
                raise InvalidRequestError(
                    f"{path}:{number}: \"prompt\"/\"text\" must be a non-empty string or list of token ids; "
                    f"got {prompt!r:.60}")
            prompts.append(prompt)
    if not prompts:
        raise InvalidRequestError(f"{path} holds no prompts")
    return prompts


def tokenize_prompts(model: Model, prompts: Sequence[str | Sequence[int]], *, chat: bool = True) -> list[list[int]]:
    """Token ids per prompt (text through the chat template when `chat`), checked as `generate`
    checks its prompts."""
    return prompt_ids(list(prompts), model, chat)


@dataclasses.dataclass(frozen=True)
class Example:
    tokens: tuple[int, ...]  # prompt then the target's answer
    prompt_length: int


def self_distill(target: Model, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int, *,
                 ignore_eos: bool = False, progress: bool = False) -> list[Example]:
    """The target answers each prompt greedily; returns prompt + answer per prompt, in order.

    Prompts are batched by length (similar lengths share a padded bucket, hence a compile)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidRequestError(f"batch_size must be an integer >= 1; got {batch_size!r}")
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise InvalidRequestError("self_distill needs at least one prompt")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: dict[int, list[int]] = {}
    chunks = [order[start: start + batch_size] for start in range(0, len(order), batch_size)]
    from tqdm.auto import tqdm

    for chunk in tqdm(chunks, desc="self-distill", unit="batch", disable=not progress):
        result = generate(target, None, [prompts[i] for i in chunk], max_new_tokens=max_new_tokens,
                          ignore_eos=ignore_eos)
        answers.update(zip(chunk, result.tokens))
    return [Example(tokens=tuple(prompts[i] + answers[i]), prompt_length=len(prompts[i])) for i in range(len(prompts))]


# ----------------------------------------------------------------------------------------------
# Packed data
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """Right-padded training sequences (host numpy; batches go to the device one at a time)."""

    tokens: np.ndarray  # int32[N, T]
    lengths: np.ndarray  # int32[N]: valid tokens per row
    prompt_lengths: np.ndarray  # int32[N]: the first prompt_lengths[n] tokens are the prompt

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def batch(self, indices: Sequence[int]) -> dict[str, jax.Array]:
        """Rows `indices`; an index of -1 is an empty row (length 0: no loss, no accuracy)."""
        indices = np.asarray(indices)
        empty = indices < 0
        safe = np.where(empty, 0, indices)
        return {
            "tokens": jnp.asarray(np.where(empty[:, None], 0, self.tokens[safe])),
            "lengths": jnp.asarray(np.where(empty, 0, self.lengths[safe])),
            "prompt_lengths": jnp.asarray(np.where(empty, 0, self.prompt_lengths[safe])),
        }

    def subset(self, indices: Sequence[int]) -> "Dataset":
        indices = np.asarray(indices, np.int64)
        return Dataset(self.tokens[indices], self.lengths[indices], self.prompt_lengths[indices])

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for array in (self.tokens, self.lengths, self.prompt_lengths):
            digest.update(np.ascontiguousarray(array, np.int32).tobytes())
            digest.update(str(array.shape).encode())
        return digest.hexdigest()[:16]

    def save(self, path: pathlib.Path) -> None:
        np.savez(path, tokens=self.tokens, lengths=self.lengths, prompt_lengths=self.prompt_lengths)

    @classmethod
    def load(cls, path: pathlib.Path) -> "Dataset":
        try:
            with np.load(path) as data:
                return cls(data["tokens"].astype(np.int32), data["lengths"].astype(np.int32),
                           data["prompt_lengths"].astype(np.int32))
        except (OSError, KeyError, ValueError) as error:
            raise CheckpointError(f"{path} is not a readable training data file: {error}") from None


def pack(examples: Sequence[Example], seq_len: int) -> Dataset:
    """Truncate to `seq_len` and right-pad. Rows with no response token inside the window (the
    prompt fills it, or the answer is empty) teach nothing and are dropped."""
    if not isinstance(seq_len, int) or seq_len < 4:
        raise InvalidRequestError(f"seq_len must be an integer >= 4; got {seq_len!r}")
    kept = [e for e in examples if min(len(e.tokens), seq_len) > e.prompt_length]
    if not kept:
        raise InvalidRequestError(
            f"no example has a response token within seq_len={seq_len}: prompts too long or answers empty")
    tokens = np.zeros((len(kept), seq_len), np.int32)
    lengths = np.zeros(len(kept), np.int32)
    for row, example in enumerate(kept):
        window = example.tokens[:seq_len]
        tokens[row, : len(window)] = window
        lengths[row] = len(window)
    prompt_lengths = np.asarray([e.prompt_length for e in kept], np.int32)
    return Dataset(tokens, lengths, prompt_lengths)


def response_mask(lengths: jax.Array, prompt_lengths: jax.Array, seq_len: int) -> jax.Array:
    """bool[B, T]: position t's next-token prediction is a response token of the data
    (prompt_length - 1 <= t < length - 1). The loss mask, before the head's alignment shift."""
    positions = jnp.arange(seq_len)[None, :]
    return (positions >= prompt_lengths[:, None] - 1) & (positions < lengths[:, None] - 1)


def split(num_examples: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, validation indices): a seeded shuffle, the validation rows held out."""
    order = np.random.default_rng([seed, 0xDA7A]).permutation(num_examples)
    num_val = 0 if num_examples < 2 or val_fraction <= 0 else max(1, round(num_examples * val_fraction))
    num_val = min(num_val, num_examples - 1)
    return np.sort(order[num_val:]), np.sort(order[:num_val])


@functools.lru_cache(maxsize=8)
def _epoch_order(seed: int, epoch: int, num_train: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_train)


def batch_indices(seed: int, step: int, batch_size: int, num_train: int) -> np.ndarray:
    """Rows of training step `step`: epochs are seeded permutations laid end to end, so the order
    is a function of (seed, step) alone and a resumed run takes the same batches."""
    flat = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs, offsets = np.divmod(flat, num_train)
    return np.asarray([_epoch_order(seed, int(e), num_train)[o] for e, o in zip(epochs, offsets)])


# ----------------------------------------------------------------------------------------------
# Draft vocabulary
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class DraftVocab:
    target_ids: np.ndarray  # int64[Vd]: the target id of each draft id, ascending
    d2t: np.ndarray  # int64[Vd]: target_ids - arange(Vd), what eagle3.to_target_ids adds
    t2d: np.ndarray  # bool[V]: whether a target id is in the draft vocabulary

    @property
    def target_to_draft(self) -> np.ndarray:
        """int32[V]: the draft id of each target id, -1 where it has none."""
        lookup = np.full(self.t2d.shape, -1, np.int32)
        lookup[self.target_ids] = np.arange(len(self.target_ids), dtype=np.int32)
        return lookup


def draft_vocab(data: Dataset, vocab_size: int, draft_vocab_size: int) -> DraftVocab:
    """The `draft_vocab_size` target tokens the head may draft: the most frequent response tokens
    (what it will be asked to predict), then prompt tokens, then the lowest unused ids, ties broken
    by the lower id. Draft ids follow target ids in ascending order (d2t >= 0), as in EAGLE-3."""
    if not isinstance(draft_vocab_size, int) or not 1 <= draft_vocab_size <= vocab_size:
        raise InvalidRequestError(f"draft_vocab_size must be an integer in [1, {vocab_size}]; got {draft_vocab_size!r}")
    positions = np.arange(data.seq_len)[None, :]
    in_response = (positions >= data.prompt_lengths[:, None]) & (positions < data.lengths[:, None])
    in_prompt = positions < np.minimum(data.prompt_lengths, data.lengths)[:, None]
    response_counts = np.bincount(data.tokens[in_response], minlength=vocab_size)[:vocab_size]
    prompt_counts = np.bincount(data.tokens[in_prompt], minlength=vocab_size)[:vocab_size]
    # lexsort sorts by the last key first: response count, then prompt count (both descending),
    # then the id (ascending).
    ranked = np.lexsort((np.arange(vocab_size), -prompt_counts, -response_counts))
    target_ids = np.sort(ranked[:draft_vocab_size]).astype(np.int64)
    t2d = np.zeros(vocab_size, bool)
    t2d[target_ids] = True
    return DraftVocab(target_ids=target_ids, d2t=target_ids - np.arange(draft_vocab_size), t2d=t2d)


# ----------------------------------------------------------------------------------------------
# Heads for a target
# ----------------------------------------------------------------------------------------------

def eagle3_config_for(target_cfg, draft_vocab_size: int, aux_layer_ids: tuple[int, ...] | None = None
                      ) -> eagle3.Eagle3Config:
    """An EAGLE-3 head shaped like one of the target's layers. Aux layers default to the EAGLE
    repo's (2, L // 2, L - 3), or (0, L // 2, L - 1) for targets too shallow for those."""
    layers = target_cfg.num_layers
    if aux_layer_ids is None:
        aux_layer_ids = eagle3.default_aux_layers(layers)
        if not all(0 <= i < layers for i in aux_layer_ids):
            aux_layer_ids = (0, layers // 2, layers - 1)
    aux_layer_ids = tuple(int(i) for i in aux_layer_ids)
    if len(aux_layer_ids) != 3 or not all(0 <= i < layers for i in aux_layer_ids):
        raise InvalidRequestError(f"aux_layer_ids must be three layer indices in [0, {layers}); got {aux_layer_ids}")
    return eagle3.Eagle3Config(
        dim=target_cfg.dim, num_heads=target_cfg.num_heads, num_kv_heads=target_cfg.num_kv_heads,
        head_dim=target_cfg.head_dim, ffn_dim=target_cfg.ffn_dim, draft_vocab_size=draft_vocab_size,
        vocab_size=target_cfg.vocab_size, rope_theta=target_cfg.rope_theta, rotary_dim=target_cfg.rotary_dim,
        norm_eps=target_cfg.norm_eps, max_position_embeddings=target_cfg.max_position_embeddings,
        aux_layer_ids=aux_layer_ids,
    )


def mtp_config_for(target_cfg) -> mtp.MtpConfig:
    """An MTP head whose block is one layer of the (Llama-family) target's kind."""
    if not isinstance(target_cfg, ModelConfig):
        raise UnsupportedModelError(
            f"MTP training needs a Llama-family target (its block is a trunk layer); got {type(target_cfg).__name__}")
    return mtp.MtpConfig(block=dataclasses.replace(target_cfg, num_layers=1))


def init_head(method: Method, head_cfg, target: Model, vocab: DraftVocab, seed: int, scale: float = 0.02) -> HeadParams:
    """Initial head params: weights N(0, scale^2) (the lm_head included, as EAGLE-3's trainers
    start it: copying the target's rows makes a fresh head confidently wrong), norms one, and an
    EAGLE-3 head's d2t from the draft vocabulary. The embedding (and MTP's lm_head) stay the
    target's, frozen, passed beside these params.

    Drawn with numpy on the host (shapes from the model module's own init, traced abstractly):
    jax.random here would cost a compile longer than a short training run.
    """
    rng = np.random.default_rng([seed, 0x4EAD])
    key = jax.random.PRNGKey(0)
    if method is Method.EAGLE3:
        shapes = eagle3.named_leaves(jax.eval_shape(lambda key: eagle3.init_params(head_cfg, key), key))
    else:
        shapes = mtp.named_leaves(jax.eval_shape(lambda key: mtp.init_params(head_cfg, key), key), head_cfg)

    def draw(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name.endswith("norm"):  # input_layernorm, hnorm, post_norm, block.q_norm, ...
            return np.ones(shape, np.float32)
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    # Drawn in sorted name order (d2t's draw included, then replaced), so a seed keeps its head.
    drawn = {name: draw(name, shapes[name].shape) for name in sorted(shapes)}
    if method is Method.EAGLE3:
        drawn["d2t"] = np.asarray(vocab.d2t, np.int32)
        params = eagle3.params_from(drawn.__getitem__)
    else:
        params = mtp.params_from(head_cfg, drawn.__getitem__)
    return jax.tree.map(jnp.asarray, params)


# ----------------------------------------------------------------------------------------------
# Training configuration and state
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that shapes a run (static under jit; saved with the run and checked on resume)."""

    method: Method = Method.EAGLE3
    steps: int = 1000
    batch_size: int = 8
    learning_rate: float = 3e-4  # peak; SpecForge uses 1e-4 for long runs on large targets
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # the cosine decays to learning_rate * min_lr_ratio
    weight_decay: float = 0.01
    grad_clip: float = 0.5  # global-norm clipping
    ttt_steps: int = 3  # unrolled head steps (the training-time test); 1 = plain teacher forcing
    step_decay: float = 0.8  # step j's loss weight is step_decay ** j
    soft_labels: bool = False  # cross-entropy against the target's distribution over the draft vocab
    cache_features: bool = True  # the target runs once per row into a FeatureCache, not once per step
    draft_vocab_size: int | None = None  # EAGLE-3; None = the target's vocabulary
    aux_layer_ids: tuple[int, ...] | None = None  # EAGLE-3; None = eagle3_config_for's default
    val_fraction: float = 0.05
    eval_every: int = 100
    save_every: int = 200
    seed: int = 0

    def __post_init__(self):
        try:
            object.__setattr__(self, "method", Method(self.method))
        except ValueError:
            raise InvalidRequestError(
                f"method must be one of {[m.value for m in Method]}; got {self.method!r}") from None
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        positive = ("steps", "batch_size", "ttt_steps", "eval_every", "save_every")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"{name} must be an integer >= 1; got {value!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise InvalidRequestError(f"warmup_steps must be an integer >= 0; got {self.warmup_steps!r}")
        checks = [
            ("learning_rate", lambda v: 0 < v < math.inf, "> 0"),
            ("min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("weight_decay", lambda v: 0 <= v < math.inf, ">= 0"),
            ("grad_clip", lambda v: 0 < v < math.inf, "> 0"),
            ("step_decay", lambda v: 0 < v <= 1, "in (0, 1]"),
            ("val_fraction", lambda v: 0 <= v < 1, "in [0, 1)"),
        ]
        for name, ok, rule in checks:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not ok(float(value)):
                raise InvalidRequestError(f"{name} must be {rule}; got {value!r}")
        if self.soft_labels and self.cache_features:
            raise InvalidRequestError(
                "soft_labels needs the target's whole distribution at every step, which the feature cache "
                "does not keep: set cache_features=False (--no-feature-cache) with soft labels")
        vocab = self.draft_vocab_size
        if vocab is not None and (not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1):
            raise InvalidRequestError(f"draft_vocab_size must be an integer >= 1; got {self.draft_vocab_size!r}")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["method"] = self.method.value
        out["aux_layer_ids"] = None if self.aux_layer_ids is None else list(self.aux_layer_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        return cls(**data)


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Clip, then AdamW on a linear-warmup cosine schedule; no weight decay on norms (1-D)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.learning_rate * cfg.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda leaf: leaf.ndim > 1, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=decay_mask))


@dataclasses.dataclass(frozen=True)
class _StepSpec:
    """The static half of a train/eval step: what shapes the program."""

    train: TrainConfig
    target_cfg: Any
    head_cfg: Any
    hidden_layers: tuple[int, ...]  # the target's hidden layers the head reads


def _trainable(params: HeadParams) -> HeadParams:
    """The optimised params: all but the EAGLE-3 d2t table (integer, fixed by the data), which
    is None in the trainable copy (the head's forward never reads it)."""
    return dataclasses.replace(params, d2t=None) if isinstance(params, eagle3.Eagle3Params) else params


# ----------------------------------------------------------------------------------------------
# The loss: target pass, then the unrolled head
# ----------------------------------------------------------------------------------------------

# Jitted: one program for training and validation batches alike (the head's steps compile apart).
@functools.partial(jax.jit, static_argnames=("target_cfg", "hidden_layers"))
def target_batch(target_params: Any, target_cfg, hidden_layers: tuple[int, ...], batch: dict[str, jax.Array],
                 draft_ids: jax.Array | None = None) -> dict[str, Any]:
    """The target's half of a training batch (right-padded; padding follows each row's tokens and
    attention is causal, so it changes nothing before it):

        tokens      int32[B, T]   the batch's tokens
        features    tuple of [B, T, D], the target's `hidden_layers` (EAGLE-3: its three aux
                    layers; MTP: (L,), the final-normed stream)
        labels      int32[B, T]   the target's own next-token argmax at each position
        loss_mask   bool[B, T]    position t's prediction is a response token (see response_mask)
        label_probs [B, T, Vd]    with `draft_ids`: the target's distribution restricted to them
    """
    tokens = batch["tokens"]  # int32[B, T]
    rows, seq_len = tokens.shape
    cache = models.create_cache(target_cfg, rows, seq_len)
    logits, features, _ = models.forward(target_params, target_cfg, tokens, cache, hidden_layers=hidden_layers)
    out = {"tokens": tokens, "features": features, "labels": jnp.argmax(logits, axis=-1).astype(jnp.int32),
           "loss_mask": response_mask(batch["lengths"], batch["prompt_lengths"], seq_len)}
    if draft_ids is not None:
        out["label_probs"] = jax.nn.softmax(jnp.take(logits, draft_ids, axis=-1), axis=-1)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class FeatureCache:
    """The target's half of every row of a Dataset, computed once and kept on disk in chunks.

    Recomputing the target per step costs a full forward over B x T tokens (for SmolLM2-135M at
    8 x 256, ~0.55 TFLOP: more than the head's forward and backward); cached, each epoch after the
    first costs only the head. Per chunk of `chunk_rows` rows, two memory-mapped .npy files:

        features_{c}.npy   float16[n, F, T, D]   the target's hidden layers (F = len(hidden_layers))
        labels_{c}.npy     int32[n, T]           the target's next-token argmax per position

    float16 halves the bytes of float32 (SmolLM2's residual stream stays far inside its range;
    a chunk that overflows is refused). `meta.json` records the data fingerprint, the layers and the
    target, so a cache built for other data or another target is never read; one built with more
    layers serves any subset of them (an EAGLE-3 and an MTP head can share one cache). A chunk
    appears atomically (written aside, then renamed), so an interrupted build resumes at the next
    chunk.
    """

    directory: pathlib.Path
    chunk_rows: int
    layers: tuple[int, ...]  # the hidden layers stored, in order
    features: tuple[np.ndarray, ...]  # per chunk float16[n, F, T, D] (memory-mapped)
    labels: tuple[np.ndarray, ...]  # per chunk int32[n, T]

    def rows(self, indices: np.ndarray, layers: tuple[int, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(float32[B, F', T, D], int32[B, T]) for data rows `indices` and `layers` (default: all
        stored); -1 gives a zero row."""
        select = [self.layers.index(layer) for layer in (layers or self.layers)]
        feats, labels = [], []
        for index in np.asarray(indices):
            chunk, offset = divmod(max(int(index), 0), self.chunk_rows)
            feats.append(self.features[chunk][offset, select])
            labels.append(self.labels[chunk][offset])
        feats, labels = np.stack(feats).astype(np.float32), np.stack(labels)
        empty = np.asarray(indices) < 0
        feats[empty], labels[empty] = 0.0, 0
        return feats, labels


FEATURE_META = "meta.json"


def cache_features(target: Model, data: Dataset, hidden_layers: tuple[int, ...], directory: str | os.PathLike[str],
                   *, batch_size: int = 8, chunk_rows: int = 64, progress: bool = False) -> FeatureCache:
    """Run the target over every row of `data` once (batches of `batch_size`, one compile) and keep
    its `hidden_layers` and next-token argmax in `directory` (see FeatureCache). Chunks already
    there for the same data and target, holding these layers or more, are reused."""
    from tqdm.auto import tqdm

    if chunk_rows % batch_size:
        raise InvalidRequestError(f"chunk_rows ({chunk_rows}) must be a multiple of batch_size ({batch_size})")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"data": data.fingerprint(), "target_config": repr(target.config), "dtype": "float16",
            "hidden_layers": list(hidden_layers), "chunk_rows": chunk_rows}
    meta_path = directory / FEATURE_META
    if meta_path.is_file():
        saved = json.loads(meta_path.read_text(encoding="utf-8"))
        same_source = all(saved.get(key) == meta[key] for key in ("data", "target_config", "dtype"))
        if same_source and set(hidden_layers) <= set(saved.get("hidden_layers", ())):
            meta = saved  # this data's cache, with our layers among its own: read ours out of it
        else:
            for stale in directory.glob("*.npy"):  # built for other data, layers or target
                stale.unlink()
    meta_path.write_text(json.dumps(meta, indent=2), encoding="utf-8")
    stored, chunk_rows = tuple(meta["hidden_layers"]), int(meta["chunk_rows"])
    if chunk_rows % batch_size:  # a reused cache's chunks: fill them in whole batches still
        batch_size = math.gcd(batch_size, chunk_rows)
    num_chunks = -(-len(data) // chunk_rows)
    names = [(directory / f"features_{c:05d}.npy", directory / f"labels_{c:05d}.npy") for c in range(num_chunks)]
    todo = [c for c, (feat, lab) in enumerate(names) if not (feat.is_file() and lab.is_file())]
    with tqdm(total=len(data), initial=(num_chunks - len(todo)) * chunk_rows if todo else len(data),
              desc="target features", unit="row", disable=not progress) as bar:
        for chunk in todo:
            start = chunk * chunk_rows
            rows = list(range(start, min(start + chunk_rows, len(data))))
            feats, labels = [], []
            for first in range(0, len(rows), batch_size):
                indices = rows[first: first + batch_size]
                padded = indices + [-1] * (batch_size - len(indices))
                out = target_batch(target.params, target.config, stored, data.batch(padded))
                stacked = np.stack([np.asarray(f) for f in out["features"]], axis=1)  # [B, F, T, D]
                feats.append(stacked[: len(indices)].astype(np.float16))
                labels.append(np.asarray(out["labels"])[: len(indices)])
                bar.update(len(indices))
            feats, labels = np.concatenate(feats), np.concatenate(labels)
            if not np.isfinite(feats).all():
                raise UnsupportedModelError(
                    f"the target's hidden states overflow float16 in rows {rows[0]}..{rows[-1]}; "
                    "train without the feature cache (cache_features=False)")
            for path, array in zip(names[chunk], (feats, labels)):
                aside = path.with_suffix(".partial.npy")
                np.save(aside, array)
                os.replace(aside, path)
    return FeatureCache(directory=directory, chunk_rows=chunk_rows, layers=stored,
                        features=tuple(np.load(feat, mmap_mode="r") for feat, _ in names),
                        labels=tuple(np.load(lab, mmap_mode="r") for _, lab in names))


def _shift_left(x: jax.Array) -> jax.Array:
    """x[:, p + 1] at p; the last position gets zeros (it is masked wherever it matters)."""
    return jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)


def _head_step(spec: _StepSpec, params: HeadParams, frozen: Frozen, tokens: jax.Array, g: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """One head forward over the whole sequence in a fresh cache: logits [B, T, Vd], g_next [B, T, D]."""
    batch, seq_len = tokens.shape
    if spec.train.method is Method.EAGLE3:
        cache = eagle3.create_cache(spec.head_cfg, batch, seq_len)
        logits, g_next, _ = eagle3.forward(params, spec.head_cfg, frozen["embed"], tokens, g, cache)
    else:
        cache = mtp.create_cache(spec.head_cfg, batch, seq_len)
        logits, g_next, _ = mtp.forward(params, spec.head_cfg, frozen["embed"], frozen["lm_head"], tokens, g, cache)
    return logits, g_next


def _loss_terms(params: HeadParams, frozen: Frozen, targets: dict[str, Any], spec: _StepSpec) -> dict[str, jax.Array]:
    """Per unrolled step j: summed cross-entropy and its position count, and top-1 agreement with
    the target (correct, out of all response positions the step can reach). All float32[J].
    `targets` is `target_batch`'s output."""
    tokens = targets["tokens"]  # int32[B, T]
    seq_len = tokens.shape[1]
    features = targets["features"]

    # Head slot p pairs (feature p, token p + 1) and drafts token p + 2: the target's prediction at p + 1.
    tokens_in = _shift_left(tokens)  # [B, T]
    label_target = _shift_left(targets["labels"])  # [B, T]
    responds = _shift_left(targets["loss_mask"])  # bool[B, T]
    draft_ids = frozen["draft_ids"]  # int32[Vd]: each draft id's target id
    if spec.train.soft_labels:
        label_probs = _shift_left(targets["label_probs"])  # [B, T, Vd]
        trainable = responds
    else:
        label_draft = jnp.take(frozen["target_to_draft"], label_target)  # [B, T]; -1: not draftable
        trainable = responds & (label_draft >= 0)

    if spec.train.method is Method.EAGLE3:
        g = eagle3.encode(params, features)  # [B, T, D]
    else:
        g = features[0]  # the target's final-normed hidden
    positions = jnp.arange(seq_len)[None, :]

    def depth_step(g, depth):
        """One unrolled head step at depth j (a scan: one compiled head forward for all depths)."""
        logits, g_next = _head_step(spec, params, frozen, tokens_in, g)
        # At depth j, slot p's feature descends from the target's at p - j: it must exist.
        reachable = positions >= depth
        mask = trainable & reachable
        if spec.train.soft_labels:
            ce = optax.softmax_cross_entropy(logits, label_probs)
        else:
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(label_draft, 0))
        drafted = jnp.take(draft_ids, jnp.argmax(logits, axis=-1))  # [B, T] target ids
        scored = responds & reachable
        terms = {"ce_sum": jnp.sum(jnp.where(mask, ce, 0.0)), "count": jnp.sum(mask).astype(jnp.float32),
                 "correct": jnp.sum((drafted == label_target) & scored).astype(jnp.float32),
                 "scored": jnp.sum(scored).astype(jnp.float32)}
        # The next depth reads the head's own output one position back (as drafting chains it).
        g = jnp.concatenate([jnp.zeros_like(g_next[:, :1]), g_next[:, :-1]], axis=1)
        return g, terms

    _, terms = jax.lax.scan(depth_step, g, jnp.arange(spec.train.ttt_steps))
    return terms  # each float32[J]


def _weighted_loss(terms: dict[str, jax.Array], step_decay: float) -> jax.Array:
    weights = step_decay ** jnp.arange(terms["ce_sum"].shape[0], dtype=jnp.float32)
    return jnp.sum(weights * terms["ce_sum"] / jnp.maximum(terms["count"], 1.0))



# ----------------------------------------------------------------------------------------------
# Steps (jitted once per static spec; the target's params are arguments, never closed over)
# ----------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("params", "opt_state"))
def _train_step(params: HeadParams, opt_state: Any, frozen: Frozen, targets: dict[str, Any], *, spec: _StepSpec):
    def loss_of(trainable):
        terms = _loss_terms(trainable, frozen, targets, spec)
        return _weighted_loss(terms, spec.train.step_decay), terms

    (loss, terms), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    updates, opt_state = optimizer(spec.train).update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **terms}


@functools.partial(jax.jit, static_argnames=("spec",))
def _eval_step(params: HeadParams, frozen: Frozen, targets: dict[str, Any], *, spec: _StepSpec):
    return _loss_terms(params, frozen, targets, spec)


def _targets(target_params: Any, frozen: Frozen, batch: dict[str, jax.Array], spec: _StepSpec) -> dict[str, Any]:
    draft_ids = frozen["draft_ids"] if spec.train.soft_labels else None
    return target_batch(target_params, spec.target_cfg, spec.hidden_layers, batch, draft_ids)


def _summarise(terms: dict[str, np.ndarray], step_decay: float) -> dict[str, Any]:
    """loss (the training objective), top1 (the first draft's agreement with the target) and
    top1_by_step (agreement at each unrolled depth)."""
    weights = step_decay ** np.arange(len(terms["ce_sum"]))
    loss = float(np.sum(weights * terms["ce_sum"] / np.maximum(terms["count"], 1.0)))
    top1 = terms["correct"] / np.maximum(terms["scored"], 1.0)
    return {"loss": loss, "top1": float(top1[0]), "top1_by_step": [float(t) for t in top1]}


def evaluate(params: HeadParams, frozen: Frozen, rows: Sequence[int], targets_for, spec: _StepSpec,
             batch_size: int) -> dict[str, Any]:
    """Loss and top-1 agreement over data rows `rows`, summed exactly across batches (the last
    batch is padded with empty rows, so every batch has one shape). `targets_for(indices)` gives
    the target's half of a batch (see `train`)."""
    totals: dict[str, np.ndarray] | None = None
    rows = list(rows)
    for start in range(0, len(rows), batch_size):
        indices = rows[start: start + batch_size]
        indices += [-1] * (batch_size - len(indices))
        targets = targets_for(np.asarray(indices))
        terms = jax.device_get(_eval_step(_trainable(params), frozen, targets, spec=spec))
        totals = terms if totals is None else {name: totals[name] + terms[name] for name in totals}
    return _summarise(totals, spec.train.step_decay)


# ----------------------------------------------------------------------------------------------
# Checkpoints (orbax) and head files
# ----------------------------------------------------------------------------------------------

def _checkpoint_manager(out_dir: pathlib.Path):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager((out_dir / CHECKPOINT_DIR).absolute(), options=options)


def _state_tree(params: HeadParams, opt_state: Any, step: int, seed: int) -> dict[str, Any]:
    """What a checkpoint holds: params, optimizer state, step, and the data-order seed (the order
    is a function of seed and step, see batch_indices; training draws no other randomness). The
    optimizer state goes as its list of leaves: its structure (optax's named tuples) is rebuilt
    from a fresh `optimizer.init`, which the settings fix."""
    return {"params": params, "opt_state": list(jax.tree.leaves(opt_state)), "step": np.int64(step),
            "seed": np.int64(seed)}


def _save_checkpoint(manager, step: int, params: HeadParams, opt_state: Any, seed: int) -> None:
    import orbax.checkpoint as ocp

    host = jax.device_get(_state_tree(params, opt_state, step, seed))  # a copy: the next step donates buffers
    manager.save(step, args=ocp.args.StandardSave(host))
    manager.wait_until_finished()


def _restore_checkpoint(manager, step: int, params: HeadParams, opt_state: Any, seed: int) -> tuple[HeadParams, Any]:
    import orbax.checkpoint as ocp

    template = jax.device_get(_state_tree(params, opt_state, step, seed))
    restored = manager.restore(step, args=ocp.args.StandardRestore(template))
    if int(restored["step"]) != step or int(restored["seed"]) != seed:
        raise CheckpointError(f"checkpoint {step} holds step {int(restored['step'])}, seed {int(restored['seed'])}; "
                              f"expected step {step}, seed {seed}")
    opt_state = jax.tree.unflatten(jax.tree.structure(opt_state), [jnp.asarray(x) for x in restored["opt_state"]])
    return jax.tree.map(jnp.asarray, restored["params"]), opt_state


# ----------------------------------------------------------------------------------------------
# The training loop
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrainResult:
    head: Model  # the trained head; a draft for jaxspec.generate
    config: TrainConfig
    step: int  # steps done (cfg.steps unless stopped early)
    history: list[dict[str, float]]  # per step of this process: step, loss, top1
    validation: dict[str, Any] | None  # the last validation: loss, top1, top1_by_step (None: no split)
    head_path: pathlib.Path | None  # where the head was written (None until the run is complete)


def _head_setup(target: Model, train_data: Dataset, cfg: TrainConfig):
    """(head config, hidden layers read, draft vocabulary) for this target and data."""
    vocab_size = target.config.vocab_size
    if cfg.method is Method.EAGLE3:
        vocab = draft_vocab(train_data, vocab_size, cfg.draft_vocab_size or vocab_size)
        head_cfg = eagle3_config_for(target.config, len(vocab.target_ids), cfg.aux_layer_ids)
        return head_cfg, eagle3.target_hidden_layers(head_cfg.aux_layer_ids), vocab
    if cfg.draft_vocab_size not in (None, vocab_size):
        raise InvalidRequestError("an MTP head drafts over the target's whole vocabulary: leave draft_vocab_size unset")
    identity = np.arange(vocab_size, dtype=np.int64)
    vocab = DraftVocab(target_ids=identity, d2t=np.zeros(vocab_size, np.int64), t2d=np.ones(vocab_size, bool))
    return mtp_config_for(target.config), (target.config.num_layers,), vocab


_HEAD_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}


def _check_head_dtype(head_dtype: str) -> None:
    if head_dtype not in _HEAD_DTYPES:
        raise InvalidRequestError(f"head_dtype must be one of {sorted(_HEAD_DTYPES)}; got {head_dtype!r}")


def _run_record(cfg: TrainConfig, data: Dataset, target: Model) -> dict[str, Any]:
    return {"train_config": cfg.to_dict(), "data": data.fingerprint(), "target_config": repr(target.config)}


def train(target: Model, data: Dataset, out_dir: str | os.PathLike[str], cfg: TrainConfig, *,
          resume: bool = False, stop_after: int | None = None, feature_dir: str | os.PathLike[str] | None = None,
          head_dtype: str = "float32", progress: bool = True) -> TrainResult:
    """Train a head for `target` on `data`, checkpointing into `out_dir`.

    resume: continue the run whose checkpoints `out_dir` holds (same data and settings, checked);
        without it, a directory that already holds a run is refused rather than overwritten.
    stop_after: stop (and checkpoint) after this many total steps, as an interruption would.
    feature_dir: where the FeatureCache lives (default `out_dir/features`); runs on the same data
        and target may share one.
    head_dtype: the written head's float type, "float32" or "bfloat16" (half the bytes; it loads
        back as float32, so drafting is unchanged but for the rounding of the weights).
    When the run completes, the head is written: EAGLE-3 into `out_dir` itself (config.json +
    model.safetensors), MTP into `out_dir/mtp_head` (mtp_head.json + model.safetensors); both
    load with `jaxspec.load(path)`.
    """
    from tqdm.auto import tqdm

    _check_head_dtype(head_dtype)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_rows, val_rows = split(len(data), cfg.val_fraction, cfg.seed)
    head_cfg, hidden_layers, vocab = _head_setup(target, data.subset(train_rows), cfg)
    spec = _StepSpec(train=cfg, target_cfg=target.config, head_cfg=head_cfg, hidden_layers=hidden_layers)
    frozen = {"embed": target.params.embed,
              "draft_ids": jnp.asarray(vocab.target_ids, jnp.int32),
              "target_to_draft": jnp.asarray(vocab.target_to_draft)}
    if cfg.method is Method.MTP:
        frozen["lm_head"] = lm_head_of(target)

    initial = init_head(cfg.method, head_cfg, target, vocab, cfg.seed)
    params = _trainable(initial)
    opt_state = jax.jit(optimizer(cfg).init)(params)
    record = _run_record(cfg, data, target)
    manager = _checkpoint_manager(out_dir)
    try:
        start = manager.latest_step() or 0
        if start and not resume:
            raise InvalidRequestError(
                f"{out_dir} already holds a training run (checkpoint at step {start}); resume it "
                "(resume=True, --resume) or choose another directory")
        if resume and not start:
            raise InvalidRequestError(f"nothing to resume: {out_dir} holds no training checkpoint")
        if start:
            saved = json.loads((out_dir / RUN_FILE).read_text(encoding="utf-8"))
            ours, theirs = record["train_config"], saved["train_config"]
            changed = sorted(name for name in ours if theirs.get(name) != ours[name])
            if changed or saved["data"] != record["data"] or saved["target_config"] != record["target_config"]:
                what = f"settings {changed}" if changed else "data or target"
                raise InvalidRequestError(f"cannot resume {out_dir}: its run used different {what}")
            params, opt_state = _restore_checkpoint(manager, start, params, opt_state, cfg.seed)
        else:
            (out_dir / RUN_FILE).write_text(json.dumps(record, indent=2), encoding="utf-8")
            data.save(out_dir / DATA_FILE)

        targets_for = _target_source(target, data, frozen, spec, pathlib.Path(feature_dir or out_dir / FEATURE_DIR),
                                     progress)
        stop = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        history: list[dict[str, float]] = []
        validation = None
        done = start
        with tqdm(total=cfg.steps, initial=start, desc=f"train {cfg.method.value}", unit="step",
                  disable=not progress) as bar:
            for step in range(start, stop):
                targets = targets_for(train_rows[batch_indices(cfg.seed, step, cfg.batch_size, len(train_rows))])
                params, opt_state, metrics = _train_step(params, opt_state, frozen, targets, spec=spec)
                summary = _summarise(jax.device_get(metrics), cfg.step_decay)
                done = step + 1
                history.append({"step": done, "loss": summary["loss"], "top1": summary["top1"]})
                bar.set_postfix(loss=f"{summary['loss']:.3f}", top1=f"{summary['top1']:.2f}")
                bar.update()
                if len(val_rows) and (done % cfg.eval_every == 0 or done == cfg.steps):
                    validation = evaluate(params, frozen, val_rows, targets_for, spec, cfg.batch_size)
                    bar.write(f"step {done}: validation loss {validation['loss']:.4f}, "
                              f"top-1 {validation['top1']:.3f} (by depth "
                              f"{', '.join(f'{t:.2f}' for t in validation['top1_by_step'])})")
                if done % cfg.save_every == 0 or done == stop:
                    _save_checkpoint(manager, done, params, opt_state, cfg.seed)
    finally:
        manager.close()

    head_params = params
    if cfg.method is Method.EAGLE3:
        head_params = dataclasses.replace(params, d2t=jnp.asarray(vocab.d2t, jnp.int32))
    head = Model(config=head_cfg, params=head_params, source=str(out_dir))
    head_path = None
    if done == cfg.steps:
        if cfg.method is Method.EAGLE3:
            checkpoints.save_eagle3(out_dir, head_cfg, head_params, dtype=_HEAD_DTYPES[head_dtype])
            head_path = out_dir
        else:
            head_path = out_dir / MTP_HEAD_DIR
            checkpoints.save_mtp_head(head_path, head_cfg, head_params)
    return TrainResult(head=head, config=cfg, step=done, history=history, validation=validation, head_path=head_path)


def _target_source(target: Model, data: Dataset, frozen: Frozen, spec: _StepSpec, feature_dir: pathlib.Path,
                   progress: bool):
    """`targets_for(rows)`: the target's half of the batch of data rows `rows` (-1: an empty row),
    read from the run's FeatureCache (built on first use) or recomputed by a target forward."""
    cfg = spec.train
    if not cfg.cache_features:
        return lambda rows: _targets(target.params, frozen, data.batch(rows), spec)
    # The cache also keeps the final-normed stream (layer L, an MTP head's input), which the
    # forward computes anyway: an EAGLE-3 run's cache then serves an MTP run on the same data.
    layers = tuple(dict.fromkeys(spec.hidden_layers + (target.config.num_layers,)))
    cache = cache_features(target, data, layers, feature_dir, batch_size=cfg.batch_size,
                           chunk_rows=cfg.batch_size * max(1, 64 // cfg.batch_size), progress=progress)

    def targets_for(rows):
        batch = data.batch(rows)
        features, labels = cache.rows(rows, spec.hidden_layers)  # [B, F, T, D], [B, T]
        return {"tokens": batch["tokens"], "features": tuple(jnp.asarray(features[:, i]) for i in range(features.shape[1])),
                "labels": jnp.asarray(labels),
                "loss_mask": response_mask(batch["lengths"], batch["prompt_lengths"], data.seq_len)}

    return targets_for


def saved_run(out_dir: str | os.PathLike[str]) -> tuple[TrainConfig, Dataset]:
    """The settings and data a run in `out_dir` was started with (to resume it as it was)."""
    out_dir = pathlib.Path(out_dir)
    if not (out_dir / RUN_FILE).is_file() or not (out_dir / DATA_FILE).is_file():
        raise InvalidRequestError(f"nothing to resume: {out_dir} holds no training run ({RUN_FILE}, {DATA_FILE})")
    record = json.loads((out_dir / RUN_FILE).read_text(encoding="utf-8"))
    return TrainConfig.from_dict(record["train_config"]), Dataset.load(out_dir / DATA_FILE)


def measure_tau(target: Model, head: Model, prompts: Sequence[Sequence[int]], *, num_draft_tokens: int = 3,
                max_new_tokens: int = 64, ignore_eos: bool = False) -> SpecStats:
    """Speculative decoding with the head over `prompts` (greedy): its stats carry tau and the
    acceptance rate. The output itself is the target's, whatever the head proposes."""
    return generate(target, head, [list(p) for p in prompts], num_draft_tokens=num_draft_tokens,
                    max_new_tokens=max_new_tokens, ignore_eos=ignore_eos).stats


# ----------------------------------------------------------------------------------------------
# The whole pipeline (the CLI's `train-head`)
# ----------------------------------------------------------------------------------------------

def self_instruct_examples(target: Model, num_prompts: int = 640, num_passage_prompts: int = 192, *,
                           max_new_tokens: int = 128, batch_size: int = 32, seed: int = 0,
                           progress: bool = False) -> list[Example]:
    """Training examples from jaxspec's own topic list (`jaxspec.self_instruct`), all answered by
    the target through its chat template: `num_prompts` topic prompts (stage 1), then
    `num_passage_prompts` prompts wrapping the target's own stage-1 articles (stage 2:
    summarisation, extraction, reading comprehension, translation)."""
    from jaxspec import self_instruct

    if target.tokenizer is None:
        raise InvalidRequestError("self-instruct prompts are text: the target needs a tokenizer (or pass --prompts)")
    texts = self_instruct.topic_prompts(num_prompts, seed)
    stage1 = self_distill(target, tokenize_prompts(target, texts), max_new_tokens, batch_size, progress=progress)
    if not num_passage_prompts:
        return stage1
    articles = [target.tokenizer.decode(example.tokens[example.prompt_length:])
                for text, example in zip(texts, stage1) if self_instruct.is_article_prompt(text)]
    stage2_texts = self_instruct.passage_prompts(articles, num_passage_prompts, seed)
    stage2 = self_distill(target, tokenize_prompts(target, stage2_texts), max_new_tokens, batch_size,
                          progress=progress)
    return stage1 + stage2


def train_head(model: str | Model, out_dir: str | os.PathLike[str], cfg: TrainConfig | None = None, *,
               prompts: Sequence[str | Sequence[int]] | None = None, data: Dataset | None = None,
               seq_len: int = 256, max_new_tokens: int = 128, num_prompts: int = 640,
               num_passage_prompts: int = 192, distill_batch_size: int = 32, chat: bool | None = None,
               resume: bool = False, tau_prompts: int = 8, num_draft_tokens: int = 3,
               feature_dir: str | os.PathLike[str] | None = None, head_dtype: str = "float32",
               progress: bool = True) -> tuple[TrainResult, SpecStats | None]:
    """Load the target (a name or path, or a loaded Model), build the training data, train, write
    the head, and measure tau on up to `tau_prompts` held-out prompts.

    The data, by precedence: `data` (a Dataset already distilled, e.g. another run's
    train_data.npz: an EAGLE-3 and an MTP head can share one), else `prompts` answered by the
    target (`chat` None = through the chat template when the tokenizer has one), else the
    built-in self-instruct set (`self_instruct_examples`: `num_prompts` topic prompts and
    `num_passage_prompts` over the target's own articles). `feature_dir` and `head_dtype` go to
    `train`. With `resume`, the run in `out_dir`
    continues with its own saved settings and data (`cfg`, `prompts` and `data` are ignored).
    Arguments are checked before the target loads."""
    for name, value, least in (("seq_len", seq_len, 4), ("max_new_tokens", max_new_tokens, 1),
                               ("num_prompts", num_prompts, 1), ("num_passage_prompts", num_passage_prompts, 0),
                               ("distill_batch_size", distill_batch_size, 1), ("tau_prompts", tau_prompts, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise InvalidRequestError(f"{name} must be an integer >= {least}; got {value!r}")
    _check_head_dtype(head_dtype)
    if resume:
        cfg, data = saved_run(out_dir)
    cfg = cfg or TrainConfig()
    target = model if isinstance(model, Model) else _load_target(model, progress)
    if data is not None:
        if int(data.tokens.max(initial=0)) >= target.config.vocab_size:
            raise InvalidRequestError(f"the data holds token ids outside the target's vocabulary ({target.config.vocab_size})")
    elif prompts is not None:
        if chat is None:
            chat = bool(target.tokenizer is not None and target.tokenizer.chat_template)
        rows = tokenize_prompts(target, list(prompts), chat=chat)
        too_long = [i for i, r in enumerate(rows) if len(r) >= seq_len]
        if too_long:
            raise InvalidRequestError(
                f"prompt {too_long[0]} has {len(rows[too_long[0]])} tokens, not under seq_len={seq_len}")
        # Answers past the training window would be cut off by `pack`: no need to generate them.
        answer_length = max(1, min(max_new_tokens, seq_len - min(map(len, rows)),
                                   target.config.max_position_embeddings - max(map(len, rows))))
        data = pack(self_distill(target, rows, answer_length, distill_batch_size, progress=progress), seq_len)
    else:
        examples = self_instruct_examples(target, num_prompts, num_passage_prompts, max_new_tokens=max_new_tokens,
                                          batch_size=distill_batch_size, seed=cfg.seed, progress=progress)
        data = pack(examples, seq_len)
    result = train(target, data, out_dir, cfg, resume=resume, feature_dir=feature_dir, head_dtype=head_dtype,
                   progress=progress)
    stats = None
    _, val_rows = split(len(data), cfg.val_fraction, cfg.seed)
    held_out = [data.tokens[i, : data.prompt_lengths[i]].tolist() for i in val_rows[:tau_prompts]]
    if held_out and result.head_path is not None:
        stats = measure_tau(target, result.head, held_out, num_draft_tokens=num_draft_tokens,
                            max_new_tokens=min(64, max_new_tokens))
    return result, stats


def _load_target(name: str, progress: bool) -> Model:
    from jaxspec import api

    return api.load(name, progress=progress)
