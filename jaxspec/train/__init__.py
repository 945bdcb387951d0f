"""Training a draft head (EAGLE-3 or MTP) on a target model's own hidden states.

The pipeline, each stage a plain function:

    corpus    build_corpus (CorpusPlan)                  a resumable corpus: Magpie prompts, self-instruct,
                                                         math, a prompts file; the target's answers and
                                                         second turns; Spec-Bench held out; dataset.npz
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
    output    save_eagle3 / save_mtp_head (checkpoints; jaxspec.load reads both); export_head writes
              any kept checkpoint's head

The modules, one concept each (every public name is re-exported here):

    corpus      the resumable training corpus (sources, filters, Spec-Bench hold-out, second turns, split)
    data        prompts, self-distillation, the packed Dataset, masks, splits, batch order, draft vocabulary
    config      TrainConfig, the optimizer it defines, StepSpec (the static half of a jitted step)
    heads       the head for a target: its config, initial params, the trainable part
    features    the target's half of a batch: target_batch, the on-disk FeatureCache, target_source
    objective   the unrolled (training-time test) loss, train_step, evaluate
    run         the loop, its run directory and resume, export_head, saved_run, measure_tau, train_head
"""

from jaxspec.train.config import Method, StepSpec, TrainConfig, optimizer
from jaxspec.train.data import (
    BatchOrder,
    Dataset,
    DraftVocab,
    Example,
    answer_positions,
    answer_token_coverage,
    batch_indices,
    bucket_widths,
    concatenate_datasets,
    draft_token_ranking,
    draft_vocab,
    draft_vocab_size_for,
    held_out_prompts,
    length_batches,
    load_datasets,
    lookup_predicted,
    loss_mask,
    pack,
    read_prompts_jsonl,
    response_mask,
    self_distill,
    self_instruct_examples,
    split,
    split_rows,
    tokenize_prompts,
)
from jaxspec.train.corpus import (
    CorpusPlan,
    PackedCorpus,
    Synthesis,
    build_corpus,
    corpus_status,
    deduplicate,
    drop_near,
    held_out_split,
    math_prompts,
    spec_bench_questions,
    synthesize_follow_ups,
    synthesize_user_prompts,
)
from jaxspec.train.features import FEATURE_META, FeatureCache, cache_features, target_batch, target_source
from jaxspec.train.heads import (
    Frozen,
    HeadParams,
    eagle3_config_for,
    init_head,
    mtp_config_for,
    start_from,
    start_vocab,
    trainable_params,
)
from jaxspec.train.objective import agrees_with_target, evaluate, summarise, train_step
from jaxspec.train.run import (
    CHECKPOINT_DIR,
    DATA_FILE,
    EXPORT_FILE,
    FEATURE_DIR,
    MTP_HEAD_DIR,
    RUN_FILE,
    TrainResult,
    export_head,
    load_start_head,
    measure_tau,
    saved_run,
    train,
    train_head,
)

__all__ = [
    "CorpusPlan", "PackedCorpus", "Synthesis", "build_corpus", "corpus_status", "deduplicate", "drop_near",
    "held_out_split", "math_prompts", "spec_bench_questions", "synthesize_follow_ups", "synthesize_user_prompts",
    "CHECKPOINT_DIR", "DATA_FILE", "EXPORT_FILE", "FEATURE_DIR", "FEATURE_META", "MTP_HEAD_DIR", "RUN_FILE",
    "BatchOrder", "Dataset", "DraftVocab", "Example", "FeatureCache", "Frozen", "HeadParams", "Method", "StepSpec",
    "TrainConfig", "TrainResult", "batch_indices", "bucket_widths", "cache_features", "concatenate_datasets", "load_datasets", "answer_positions", "answer_token_coverage", "draft_token_ranking", "draft_vocab", "draft_vocab_size_for", "eagle3_config_for", "held_out_prompts", "length_batches",
    "agrees_with_target", "evaluate", "export_head", "init_head", "load_start_head", "lookup_predicted", "loss_mask", "measure_tau", "mtp_config_for", "optimizer", "pack",
    "read_prompts_jsonl", "response_mask", "saved_run", "self_distill", "self_instruct_examples", "start_from", "start_vocab",
    "split", "split_rows", "summarise", "target_batch", "target_source", "tokenize_prompts", "train", "train_head",
    "train_step", "trainable_params",
]
