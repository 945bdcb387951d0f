"""What shapes a training run and its compiled steps.

`TrainConfig` holds a run's settings: checked on construction (bad values raise
InvalidRequestError before anything is traced), hashable so it is static under jit, and saved
beside the run's checkpoints so a resume can refuse different settings. `optimizer` is the one
optax transformation those settings define. `StepSpec` is the static argument of every jitted
train/eval step: the settings plus the target's and head's configs and the hidden layers read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import optax

from jaxspec.errors import InvalidRequestError
from jaxspec.spec.methods import Method


COMPUTE_DTYPES = ("float32", "bfloat16")
LABEL_SOURCES = ("target", "text")  # TrainConfig.labels


# The drafters whose heads jaxspec.train trains.
TRAINABLE_METHODS = (Method.EAGLE3, Method.MTP)


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
    # Each position's hard label: "target", the target's own argmax there (computed by the feature
    # pass); or "text", the row's next token. "text" suits a corpus the target wrote greedily in the
    # weight format the head is trained for (jaxspec's corpus: int8): that text is what the target's
    # decode and verify steps produce, while the feature pass runs a row as one long forward that
    # rounds differently under int8 (its argmax leaves some of the corpus's own int8 answer tokens,
    # which the decode path reproduces: bench/RESULTS.md, "int8 labels"). On other text it trains
    # toward the text, as EAGLE-1 trained on ShareGPT's. Not read by the compiled step.
    labels: str = "target"
    cache_features: bool = True  # the target runs once per row into a FeatureCache, not once per step
    draft_vocab_size: int | None = None  # EAGLE-3; None = the target's vocabulary (or by coverage)
    # EAGLE-3: the smallest draft vocabulary (a multiple of 256) whose tokens make up at least this
    # fraction of the validation answers' tokens (the training answers' without validation rows;
    # data.draft_vocab_size_for); instead of a size.
    draft_vocab_coverage: float | None = None
    aux_layer_ids: tuple[int, ...] | None = None  # EAGLE-3; None = eagle3_config_for's default
    mtp_block_from_last_layer: bool = True  # MTP: the block starts as the target's last layer (else random)
    # Batches of rows of like length, cut to their length rounded up to a multiple of this
    # (data.BatchOrder): a short conversation in a long window costs its own length, not the
    # window's. 0: every batch the full window. Each width compiles its own step.
    bucket_width: int = 256
    # A head to start from instead of random weights (a name or directory `jaxspec.load` reads:
    # a finished run's head, the shipped one): continued training on more data, or a new schedule
    # over the same. Its config must match the run's but for an EAGLE-3 draft vocabulary, whose
    # lm_head rows carry over by target token (heads.start_from). Not part of the compiled step.
    init_from: str | None = None
    # EAGLE-3 with init_from: the draft vocabulary holds every token of the start head's, then the
    # data's most frequent others up to draft_vocab_size / draft_vocab_coverage (data.draft_vocab,
    # `first`), so every lm_head row of the start head carries over; without it the data's ranking
    # alone picks the vocabulary and rows carry only where the two share a token. Not part of the
    # compiled step. A resume reads the start head's vocabulary again.
    keep_init_vocab: bool = False
    # The head's products (objective.in_compute_dtype): "float32", or "bfloat16" (weights and
    # activations cast at each product, float32 accumulation, master params and optimizer state
    # float32; the backward products bfloat16 as well). Faster on a CPU with bf16 matrix units
    # (AMX), where only the products gain (attention, softmax and the copies around them stay
    # float32); slower on an AVX2-only CPU (bench/RESULTS.md, "Training step cost").
    compute_dtype: str = "float32"
    val_fraction: float = 0.05
    eval_every: int = 100
    save_every: int = 200
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.method, str) and self.method in TRAINABLE_METHODS):
            raise InvalidRequestError(
                f"method must be one of {[m.value for m in TRAINABLE_METHODS]}; got {self.method!r}")
        object.__setattr__(self, "method", Method.parse(self.method))
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        positive = ("steps", "batch_size", "ttt_steps", "eval_every", "save_every")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"{name} must be an integer >= 1; got {value!r}")
        if not isinstance(self.bucket_width, int) or isinstance(self.bucket_width, bool) or self.bucket_width < 0:
            raise InvalidRequestError(f"bucket_width must be an integer >= 0; got {self.bucket_width!r}")
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
        if self.labels not in LABEL_SOURCES:
            raise InvalidRequestError(f"labels must be one of {list(LABEL_SOURCES)}; got {self.labels!r}")
        if self.soft_labels and self.labels != "target":
            raise InvalidRequestError("soft_labels learn the target's distribution; labels='text' replaces the "
                                      "target's argmax with the text's next token: choose one")
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            raise InvalidRequestError(f"init_from must be a head's name or directory; got {self.init_from!r}")
        if self.keep_init_vocab and (self.init_from is None or self.method is not Method.EAGLE3):
            raise InvalidRequestError("keep_init_vocab keeps the draft vocabulary of the EAGLE-3 head a run starts "
                                      "from: it needs method eagle3 and init_from")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise InvalidRequestError(f"compute_dtype must be one of {list(COMPUTE_DTYPES)}; got {self.compute_dtype!r}")
        vocab = self.draft_vocab_size
        if vocab is not None and (not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1):
            raise InvalidRequestError(f"draft_vocab_size must be an integer >= 1; got {self.draft_vocab_size!r}")
        coverage = self.draft_vocab_coverage
        if coverage is not None:
            if vocab is not None:
                raise InvalidRequestError("give draft_vocab_size or draft_vocab_coverage, not both")
            if isinstance(coverage, bool) or not isinstance(coverage, (int, float)) or not 0 < coverage <= 1:
                raise InvalidRequestError(f"draft_vocab_coverage must be in (0, 1]; got {coverage!r}")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["method"] = self.method.value
        out["aux_layer_ids"] = None if self.aux_layer_ids is None else list(self.aux_layer_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        """The settings a dict records; a setting it lacks (a run saved before the setting
        existed) takes its default, which is what that run used."""
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
class StepSpec:
    """The static half of a train/eval step: what shapes the program."""

    train: TrainConfig
    target_cfg: Any
    head_cfg: Any
    hidden_layers: tuple[int, ...]  # the target's hidden layers the head reads
