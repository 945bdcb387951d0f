"""A training run: the loop, its directory, resuming it, and the whole pipeline (`train-head`).

`train` takes a packed Dataset and a TrainConfig and trains a head, checkpointing into a run
directory laid out as

    train_run.json         the settings, the data's fingerprint and the target (checked on resume)
    train_data.npz         the Dataset itself (so `saved_run` can resume the run as it was)
    train_checkpoints/     orbax checkpoints: params, optimizer state, step, seed
    features/              the FeatureCache (unless another directory is given)
    config.json + model.safetensors, or mtp_head/   the finished head (jaxspec.load reads both)

Checkpoints are written every `save_every` steps; the last two are kept, and with `keep_every`
also every multiple of it.

Resuming: the data order is a pure function of (seed, step), the dataset and the run's settings
are saved beside the orbax checkpoints (params, optimizer state, step), so a resumed run takes
the same batches in the same order as an uninterrupted one and ends with the same params. A
directory that already holds a run is never overwritten; a resume with other settings or data is
refused. Ctrl-C or a SIGTERM while steps run (a session's end, a scheduler's preemption) is taken
between steps: the step under way finishes, a checkpoint is written, and `train` returns with
`interrupted` set, so nothing past the last whole step is lost (`StepInterruption`).

`export_head` writes the head of any kept checkpoint (a run not yet finished, or the heads along
one) to a directory of its own.

`train_head` is the CLI's `train-head`: load the target, build the data (a saved Dataset, given
prompts, or the built-in self-instruct set), train, write the head, measure tau on held-out
prompts. Its arguments are checked before the target loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import checkpoints, compilation
from jaxspec.api import Model, SpecStats, generate, lm_head_of
from jaxspec.errors import CheckpointError, InvalidRequestError, is_integer
from jaxspec.models import backends, eagle3, layers, quant
from jaxspec.models.backends import Products
from jaxspec.train.config import Method, StepSpec, TrainConfig, optimizer
from jaxspec.train.data import (
    EARLY_ANSWER_TOKENS,
    BatchOrder,
    Dataset,
    DraftVocab,
    bucket_widths,
    draft_vocab,
    draft_vocab_size_for,
    held_out_prompts,
    length_batches,
    pack,
    self_distill,
    self_instruct_examples,
    split_rows,
    tokenize_prompts,
)
from jaxspec.train.features import target_identity, target_source
from jaxspec.train.heads import (
    HeadParams,
    eagle3_config_for,
    init_head,
    mtp_config_for,
    start_from,
    start_vocab,
    trainable_params,
)
from jaxspec.train.objective import evaluate, summarise, train_step

DATA_FILE = "train_data.npz"
RUN_FILE = "train_run.json"
CHECKPOINT_DIR = "train_checkpoints"
FEATURE_DIR = "features"
MTP_HEAD_DIR = "mtp_head"
EXPORT_FILE = "exported_from.json"  # beside an exported head: its run and step


# ----------------------------------------------------------------------------------------------
# Checkpoints (orbax) and head files
# ----------------------------------------------------------------------------------------------

def _checkpoint_manager(out_dir: pathlib.Path, keep_every: int | None = None):
    """The run's checkpoints: the last two, and with `keep_every` also every step that is a
    multiple of it (heads along the run, for `export_head`)."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, keep_period=keep_every, create=True,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager((out_dir / CHECKPOINT_DIR).absolute(), options=options)


def _state_tree(params: HeadParams, opt_state: Any, step: int, seed: int) -> dict[str, Any]:
    """What a checkpoint holds: params, optimizer state, step, and the data-order seed (the order
    is a function of seed and step, see data.BatchOrder; training draws no other randomness). The
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
    interrupted: str | None = None  # the signal that stopped the run early ("SIGINT", "SIGTERM"), if one did


class StepInterruption:
    """While training steps run: SIGINT and SIGTERM only set `received` (the signal's name), so
    the loop can finish the step under way, checkpoint, and stop. The first signal restores the
    handlers it replaced, so a second one acts at once as it would have (Ctrl-C twice: a
    KeyboardInterrupt mid-step). Outside the main thread, where Python cannot set handlers,
    signals keep their usual effect."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: str | None = None
        self._replaced: dict[int, Any] = {}

    def __enter__(self) -> "StepInterruption":
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._replaced[signum] = signal.signal(signum, self._take)
        return self

    def __exit__(self, *exc_info) -> None:
        self._restore()

    def _take(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum).name
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._replaced.items():
            # None: a handler not set from Python; the default action is what it did.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._replaced = {}


def _head_setup(target: Model, train_data: Dataset, cfg: TrainConfig, val_data: Dataset | None = None,
                start: Model | None = None):
    """(head config, hidden layers read, draft vocabulary) for this target and data. A vocabulary
    sized by coverage is measured on the validation rows when they hold answers (text the
    ranking has not seen; on the training rows themselves coverage is overstated). `start`: the
    head `cfg.keep_init_vocab` keeps the vocabulary of (its tokens first)."""
    vocab_size = target.config.vocab_size
    if cfg.method is Method.EAGLE3:
        kept = start_vocab(start) if cfg.keep_init_vocab else None
        size = cfg.draft_vocab_size or vocab_size
        if cfg.draft_vocab_coverage is not None:
            held_out = val_data if val_data is not None and val_data.assistant_tokens().any() else None
            size = draft_vocab_size_for(train_data, vocab_size, cfg.draft_vocab_coverage, measured_on=held_out,
                                        first=kept)
        if kept is not None and size < len(kept):
            raise InvalidRequestError(f"keep_init_vocab: the draft vocabulary ({size} tokens) cannot hold the "
                                      f"{len(kept)} of {cfg.init_from}; give draft_vocab_size >= {len(kept)}")
        vocab = draft_vocab(train_data, vocab_size, size, first=kept)
        head_cfg = eagle3_config_for(target.config, len(vocab.target_ids), cfg.aux_layer_ids)
        return head_cfg, eagle3.target_hidden_layers(head_cfg.aux_layer_ids), vocab
    if cfg.draft_vocab_size not in (None, vocab_size) or cfg.draft_vocab_coverage is not None:
        raise InvalidRequestError("an MTP head drafts over the target's whole vocabulary: leave draft_vocab_size "
                                  "and draft_vocab_coverage unset")
    identity = np.arange(vocab_size, dtype=np.int64)
    vocab = DraftVocab(target_ids=identity, d2t=np.zeros(vocab_size, np.int64), t2d=np.ones(vocab_size, bool))
    return mtp_config_for(target.config), (target.config.num_layers,), vocab


_HEAD_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}


def _check_head_dtype(head_dtype: str) -> None:
    if head_dtype not in _HEAD_DTYPES:
        raise InvalidRequestError(f"head_dtype must be one of {sorted(_HEAD_DTYPES)}; got {head_dtype!r}")


def _by_depth(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _check_keep_every(keep_every: int | None) -> None:
    if keep_every is not None and (not is_integer(keep_every) or keep_every < 1):
        raise InvalidRequestError(f"keep_every must be an integer >= 1; got {keep_every!r}")


def load_start_head(name: str) -> Model:
    """The head `TrainConfig.init_from` names (a shipped head's name or a head directory), or
    InvalidRequestError: a run starts from a draft head, never from a target model."""
    from jaxspec import api

    try:
        path = checkpoints.resolve_model(name)
        head = api._load_head_dir(path)
    except CheckpointError as err:
        raise InvalidRequestError(f"init_from {name}: {err}") from None
    if head is None:
        raise InvalidRequestError(f"init_from {name}: {path} is not a draft head directory (an EAGLE-3 head's "
                                  "config.json + model.safetensors, or a trained MTP head)")
    return head


def _run_record(cfg: TrainConfig, data: Dataset, target: Model) -> dict[str, Any]:
    return {"train_config": cfg.to_dict(), "data": data.fingerprint(), **target_identity(target)}


@dataclasses.dataclass(frozen=True)
class _RunSetup:
    """What a run's settings, data and target fix before any step: its training and held-out rows,
    the head's config and draft vocabulary, the compiled step's static half, and the starting
    params and optimizer state (a restored checkpoint's template)."""

    train_rows: np.ndarray  # int[N]: row indices into the data
    val_rows: np.ndarray
    head_cfg: Any
    vocab: DraftVocab
    spec: StepSpec
    params: HeadParams
    opt_state: Any
    carried: int | None  # lm_head rows carried from cfg.init_from (None: a fresh or restored start)


def _set_up(target: Model, data: Dataset, cfg: TrainConfig, *, restoring: bool) -> _RunSetup:
    train_rows, val_rows = split_rows(data, cfg.val_fraction, cfg.seed)
    # A restore takes its params from its checkpoint; only a kept vocabulary reads the head again.
    needs_start = cfg.init_from is not None and (not restoring or cfg.keep_init_vocab)
    start_head = load_start_head(cfg.init_from) if needs_start else None
    head_cfg, hidden_layers, vocab = _head_setup(target, data.subset(train_rows), cfg, data.subset(val_rows),
                                                 start_head)
    # Only what shapes the program is in the compiled step's key: runs that differ in where the
    # params start or how often they checkpoint and validate share it.
    program = dataclasses.replace(cfg, init_from=None, keep_init_vocab=False, save_every=TrainConfig.save_every,
                                  eval_every=TrainConfig.eval_every)
    spec = StepSpec(train=program, target_cfg=target.config, head_cfg=head_cfg, hidden_layers=hidden_layers)
    initial = init_head(cfg.method, head_cfg, target, vocab, cfg.seed,
                        mtp_block_from_last_layer=cfg.mtp_block_from_last_layer)
    carried = None
    if cfg.init_from is not None and not restoring:
        initial, carried = start_from(cfg.method, head_cfg, initial, vocab, start_head)
    params = trainable_params(initial)
    return _RunSetup(train_rows=train_rows, val_rows=val_rows, head_cfg=head_cfg, vocab=vocab, spec=spec,
                     params=params, opt_state=jax.jit(optimizer(cfg).init)(params), carried=carried)


def _check_same_run(out_dir: pathlib.Path, record: dict[str, Any], action: str, identity: Sequence[str]) -> None:
    """Refuse to `action` the run in `out_dir` with settings, data or a target (`identity`: the
    record's keys that must match) other than its own."""
    saved = json.loads((out_dir / RUN_FILE).read_text(encoding="utf-8"))
    ours, theirs = record["train_config"], TrainConfig.from_dict(saved["train_config"]).to_dict()
    changed = sorted(name for name in ours if theirs.get(name) != ours[name])
    other_target = any(saved.get(key) != record[key] for key in identity)
    if changed or saved["data"] != record["data"] or other_target:
        what = f"settings {changed}" if changed else "data or target (its config or weight format)"
        raise InvalidRequestError(f"cannot {action} {out_dir}: its run used different {what}")


def _head_of(cfg: TrainConfig, setup: _RunSetup, params: HeadParams, source: str) -> tuple[HeadParams, Model]:
    """The head the trainable `params` make: its params as written (an EAGLE-3 head with its
    draft-to-target map), and as `jaxspec.load` gives it (q/k/v and gate/up fused)."""
    head_params = params
    if cfg.method is Method.EAGLE3:
        head_params = dataclasses.replace(params, d2t=jnp.asarray(setup.vocab.d2t, jnp.int32))
    return head_params, Model(config=setup.head_cfg, params=layers.fuse_projections(head_params), source=source)


def _write_head(method: Method, out_dir: pathlib.Path, head_cfg: Any, head_params: HeadParams,
                head_dtype: str) -> pathlib.Path:
    """Write a head where `jaxspec.load` finds it: EAGLE-3 into `out_dir`, MTP into its mtp_head/."""
    if method is Method.EAGLE3:
        checkpoints.save_eagle3(out_dir, head_cfg, head_params, dtype=_HEAD_DTYPES[head_dtype])
        return out_dir
    checkpoints.save_mtp_head(out_dir / MTP_HEAD_DIR, head_cfg, head_params)
    return out_dir / MTP_HEAD_DIR


def train(target: Model, data: Dataset, out_dir: str | os.PathLike[str], cfg: TrainConfig, *,
          resume: bool = False, stop_after: int | None = None, feature_dir: str | os.PathLike[str] | None = None,
          head_dtype: str = "float32", keep_every: int | None = None, progress: bool = True) -> TrainResult:
    """Train a head for `target` on `data`, checkpointing into `out_dir`.

    resume: continue the run whose checkpoints `out_dir` holds (same data and settings, checked);
        without it, a directory that already holds a run is refused rather than overwritten.
    stop_after: stop (and checkpoint) after this many total steps, as an interruption would.
        A SIGINT or SIGTERM while steps run stops the run the same way after the step under way
        (`StepInterruption`); the result names the signal in `interrupted`.
    feature_dir: where the FeatureCache lives (default `out_dir/features`); runs on the same data
        and target may share one.
    head_dtype: the written head's float type, "float32" or "bfloat16" (half the bytes; it loads
        back as float32, so drafting is unchanged but for the rounding of the weights).
    keep_every: besides the last two checkpoints, keep every one at a multiple of this many steps
        (a checkpoint is written every `cfg.save_every`), so `export_head` can write the heads
        along the run: acceptance against the data seen.
    When the run completes, the head is written: EAGLE-3 into `out_dir` itself (config.json +
    model.safetensors), MTP into `out_dir/mtp_head` (mtp_head.json + model.safetensors); both
    load with `jaxspec.load(path)`.
    """
    from tqdm.auto import tqdm

    _check_head_dtype(head_dtype)
    _check_keep_every(keep_every)
    # The target's embedding and LM head sit inside the differentiated step (the loss reads the
    # draft's logits through them), and the native CPU kernels have no gradient: XLA's products.
    target = dataclasses.replace(target, params=backends.standard(target.params))
    # A step compiles once per batch width (a long compile for the default model at TTT 7, and a
    # corpus of mixed lengths has up to 2048 / bucket_width widths), the feature pass once per
    # forward shape: on disk, a resumed run or the next run on the same shapes loads them instead.
    compilation.enable_persistent_cache()
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    setup = _set_up(target, data, cfg, restoring=resume)
    train_rows, val_rows = setup.train_rows, setup.val_rows
    if setup.carried is not None and progress:
        print(f"jaxspec: starting from {cfg.init_from} ({setup.carried} of {len(setup.vocab.target_ids)} "
              "lm_head rows carried)")
    spec, params, opt_state = setup.spec, setup.params, setup.opt_state
    frozen = {"embed": target.params.embed,
              "draft_ids": jnp.asarray(setup.vocab.target_ids, jnp.int32),
              "target_to_draft": jnp.asarray(setup.vocab.target_to_draft)}
    if cfg.method is Method.MTP:
        frozen["lm_head"] = lm_head_of(target)

    record = _run_record(cfg, data, target)
    manager = _checkpoint_manager(out_dir, keep_every)
    try:
        start = manager.latest_step() or 0
        if start and not resume:
            raise InvalidRequestError(
                f"{out_dir} already holds a training run (checkpoint at step {start}); resume it "
                "(resume=True, --resume) or choose another directory")
        if resume and not start:
            raise InvalidRequestError(f"nothing to resume: {out_dir} holds no training checkpoint")
        if start:
            _check_same_run(out_dir, record, "resume", list(target_identity(target)))
            params, opt_state = _restore_checkpoint(manager, start, params, opt_state, cfg.seed)
        else:
            (out_dir / RUN_FILE).write_text(json.dumps(record, indent=2), encoding="utf-8")
            data.save(out_dir / DATA_FILE)

        targets_for = target_source(target, data, frozen, spec, pathlib.Path(feature_dir or out_dir / FEATURE_DIR),
                                    progress)
        widths = bucket_widths(data.lengths, cfg.bucket_width, data.seq_len)
        order = BatchOrder(train_rows, widths[train_rows], cfg.batch_size, cfg.seed)
        val_batches = length_batches(val_rows, widths[val_rows], cfg.batch_size)

        def val_targets_for(rows, width):
            """Validation also scores apart the new text (what a prompt lookup over the row does not
            propose) and the first EARLY_ANSWER_TOKENS of each answer (what Spec-Bench measures)."""
            subsets = {"new": ~data.next_is_lookup_predicted(rows, width),
                       "early": data.next_answer_positions(rows, width) < EARLY_ANSWER_TOKENS}
            return {**targets_for(rows, width), "subsets": {name: jnp.asarray(m) for name, m in subsets.items()}}

        stop = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        history: list[dict[str, float]] = []
        validation = None
        done = start
        with StepInterruption() as interruption, tqdm(total=cfg.steps, initial=start, desc=f"train {cfg.method.value}",
                                                      unit="step", disable=not progress) as bar:
            for step in range(start, stop):
                targets = targets_for(*order.step(step))
                params, opt_state, metrics = train_step(params, opt_state, frozen, targets, spec=spec)
                summary = summarise(jax.device_get(metrics), cfg.step_decay)
                done = step + 1
                history.append({"step": done, "loss": summary["loss"], "top1": summary["top1"]})
                bar.set_postfix(loss=f"{summary['loss']:.3f}", top1=f"{summary['top1']:.2f}")
                bar.update()
                if len(val_rows) and (done % cfg.eval_every == 0 or done == cfg.steps):
                    validation = evaluate(params, frozen, val_batches, val_targets_for, spec)
                    bar.write(f"step {done}: validation loss {validation['loss']:.4f}, "
                              f"top-1 {validation['top1']:.3f} (by depth {_by_depth(validation['top1_by_step'])}); "
                              f"on new text ({validation['new_share']:.0%} of the positions, the rest a "
                              f"lookup's) {validation['top1_new']:.3f} ({_by_depth(validation['top1_new_by_step'])}); "
                              f"on the first {EARLY_ANSWER_TOKENS} answer tokens ({validation['early_share']:.0%}) "
                              f"{validation['top1_early']:.3f} ({_by_depth(validation['top1_early_by_step'])})")
                if done % cfg.save_every == 0 or done == stop or interruption.received:
                    _save_checkpoint(manager, done, params, opt_state, cfg.seed)
                if interruption.received:
                    bar.write(f"{interruption.received}: stopped after step {done} of {cfg.steps}, checkpointed there")
                    break
    finally:
        manager.close()

    head_params, head = _head_of(cfg, setup, params, str(out_dir))
    head_path = _write_head(cfg.method, out_dir, setup.head_cfg, head_params, head_dtype) if done == cfg.steps else None
    return TrainResult(head=head, config=cfg, step=done, history=history, validation=validation, head_path=head_path,
                       interrupted=interruption.received)


def export_head(target: Model, run_dir: str | os.PathLike[str], dest: str | os.PathLike[str], *,
                step: int | None = None, head_dtype: str = "float32") -> pathlib.Path:
    """Write the head of one checkpoint of the run in `run_dir` (its latest, or `step`) to `dest`,
    without training: to measure a run that has not finished, or the heads a run passed through
    (`train(keep_every=...)`), which make the curve of acceptance against data seen.

    `target` must have the run's config (its weight format only shapes features, so any will do).
    The head goes where `jaxspec.load` finds it (EAGLE-3 into `dest`, MTP into `dest/mtp_head`),
    with EXPORT_FILE beside it naming the run and the step. Returns the head's path."""
    _check_head_dtype(head_dtype)
    run_dir, dest = pathlib.Path(run_dir), pathlib.Path(dest)
    cfg, data = saved_run(run_dir)
    if dest.exists() and dest.resolve() == run_dir.resolve():
        raise InvalidRequestError(f"export the head to another directory than its run's ({run_dir}): a run writes "
                                  "its own head when it completes")
    for existing in (dest / "config.json", dest / MTP_HEAD_DIR, dest / RUN_FILE):
        if existing.exists():
            raise InvalidRequestError(f"{dest} already holds a head or a run ({existing.name}); "
                                      "choose another directory")
    _check_same_run(run_dir, _run_record(cfg, data, target), "export a head of", ["target_config"])
    setup = _set_up(target, data, cfg, restoring=True)
    manager = _checkpoint_manager(run_dir)
    try:
        kept = sorted(manager.all_steps())
        if not kept:
            raise InvalidRequestError(f"{run_dir} holds no training checkpoint to export")
        step = kept[-1] if step is None else step
        if step not in kept:
            raise InvalidRequestError(f"{run_dir} holds no checkpoint at step {step}; it holds steps {kept}")
        params, _ = _restore_checkpoint(manager, step, setup.params, setup.opt_state, cfg.seed)
    finally:
        manager.close()
    dest.mkdir(parents=True, exist_ok=True)
    head_params, _ = _head_of(cfg, setup, params, str(dest))
    path = _write_head(cfg.method, dest, setup.head_cfg, head_params, head_dtype)
    (dest / EXPORT_FILE).write_text(json.dumps({"run": str(run_dir.absolute()), "step": step, "steps": cfg.steps},
                                               indent=2), encoding="utf-8")
    return path


def saved_run(out_dir: str | os.PathLike[str]) -> tuple[TrainConfig, Dataset]:
    """The settings and data a run in `out_dir` was started with (to resume it as it was)."""
    out_dir = pathlib.Path(out_dir)
    if not (out_dir / RUN_FILE).is_file() or not (out_dir / DATA_FILE).is_file():
        raise InvalidRequestError(f"nothing to resume or export: {out_dir} holds no training run "
                                  f"({RUN_FILE}, {DATA_FILE})")
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

def train_head(model: str | Model, out_dir: str | os.PathLike[str], cfg: TrainConfig | None = None, *,
               prompts: Sequence[str | Sequence[int]] | None = None, data: Dataset | None = None,
               seq_len: int = 256, max_new_tokens: int = 128, num_prompts: int = 640,
               num_passage_prompts: int = 192, distill_batch_size: int = 32, chat: bool | None = None,
               resume: bool = False, tau_prompts: int = 8, num_draft_tokens: int = 3,
               feature_dir: str | os.PathLike[str] | None = None, head_dtype: str = "float32",
               keep_every: int | None = None, weight_format: str | quant.WeightFormat = "auto",
               progress: bool = True) -> tuple[TrainResult, SpecStats | None]:
    """Load the target (a name or path, or a loaded Model), build the training data, train, write
    the head, and measure tau on up to `tau_prompts` held-out prompts (a seeded draw).

    The data, by precedence: `data` (a Dataset already distilled, e.g. another run's
    train_data.npz: an EAGLE-3 and an MTP head can share one), else `prompts` answered by the
    target (`chat` None = through the chat template when the tokenizer has one), else the
    built-in self-instruct set (`self_instruct_examples`: `num_prompts` topic prompts and
    `num_passage_prompts` over the target's own articles). `feature_dir`, `head_dtype` and
    `keep_every` go to `train`. `weight_format` is the format a name or path loads in (an int8
    target trains the head on its int8 trunk's features, for serving under int8). With `resume`,
    the run in `out_dir` continues with its own saved settings and data (`cfg`, `prompts` and
    `data` are ignored). Arguments are checked before the target loads."""
    for name, value, least in (("seq_len", seq_len, 4), ("max_new_tokens", max_new_tokens, 1),
                               ("num_prompts", num_prompts, 1), ("num_passage_prompts", num_passage_prompts, 0),
                               ("distill_batch_size", distill_batch_size, 1), ("tau_prompts", tau_prompts, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise InvalidRequestError(f"{name} must be an integer >= {least}; got {value!r}")
    _check_head_dtype(head_dtype)
    _check_keep_every(keep_every)
    quant.WeightFormat.parse(weight_format)  # a bad name is refused here, before the target loads
    if resume:
        cfg, data = saved_run(out_dir)
    cfg = cfg or TrainConfig()
    if cfg.init_from is not None and not resume:
        load_start_head(cfg.init_from)  # a bad head is named before the target loads
    target = model if isinstance(model, Model) else _load_target(model, weight_format, progress)
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
                   keep_every=keep_every, progress=progress)
    stats = None
    held_out = held_out_prompts(data, cfg.val_fraction, cfg.seed, tau_prompts)
    if held_out and result.head_path is not None:
        stats = measure_tau(target, result.head, held_out, num_draft_tokens=num_draft_tokens,
                            max_new_tokens=min(64, max_new_tokens))
    return result, stats


def _load_target(name: str, weight_format: str | quant.WeightFormat, progress: bool) -> Model:
    from jaxspec import api

    return api.load(name, weight_format=weight_format, products=Products.XLA, progress=progress)
