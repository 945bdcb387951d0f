"""The training corpus of a draft head: diverse prompts, the target's own answers, second turns,
packed with a loss mask over every assistant token. No network, no dataset download, nothing
from Spec-Bench (the evaluation set), and every stage resumable.

Prompt sources, all filtered the same way (`build_corpus`, stage 1):

    magpie                 `synthesize_user_prompts`: the target writes user messages itself
                           (Magpie): its chat template up to the user's message, then sampling,
                           which stops at the template's end-of-turn token
    self_instruct_topic    `jaxspec.self_instruct.topic_prompts` (templates x topics)
    self_instruct_passage  `jaxspec.self_instruct.passage_prompts` over the target's own articles
    math                   `math_prompts`: DeepMind's mathematics_dataset (Apache-2.0, generated
                           on the fly) wrapped in natural requests
    user                   a `--prompts FILE.jsonl` (`jaxspec.train.data.read_prompts_jsonl`)

Filters: `normalize` + character-shingle similarity. `deduplicate` drops near duplicates
(Jaccard, MinHash/LSH candidates, exact check) within the free-text sources (magpie, user);
the templated sources (self_instruct, math) are distinct by construction and lose only exact
repeats. `drop_near` removes everything near any turn of any Spec-Bench question (Jaccard, or
one mostly contained in the other), from every source, second turns included.

On disk (`build_corpus(target, out_dir, plan)`; rerun it to resume, `corpus_status` says where it is):

    plan.json                    the CorpusPlan, the target and input fingerprints; a different plan is refused
    pool/magpie.json             stage 1a: the synthesised user prompts and their drop counts
    pool/passages.json           stage 1b: the target's articles the passage prompts wrap
    prompts.jsonl.gz             stage 1: {"id", "source", "text", ["template" | "module"]} per prompt
    prompts_report.json          stage 1: per source, requested / kept / drops by reason
    answers/shard_NNNNN.jsonl.gz stage 2: the target's greedy answers, `shard_size` prompts a shard
    turn2/drops_NNNNN.json       stage 3: a shard's follow-up drafts dropped, by reason
    turn2/selection.json         stage 3: which conversations get a second turn (a seeded choice)
    turn2/shard_NNNNN.jsonl.gz   stage 3: a synthesised follow-up and the target's answer to it
    dataset.npz                  stage 4: `PackedCorpus` (a superset of `Dataset`'s file)
    manifest.json                counts per source, drops by reason, tokens, seconds per stage
    timings.json                 seconds spent per stage, summed over resumed runs

The .jsonl.gz files are JSON Lines compressed with gzip (the standard library's; `gzip -dc`
reads them), written deterministically (no time stamp, no file name: the same records give the
same bytes). A corpus built before they were compressed holds plain .jsonl files of the same
names; every reader takes either, so it resumes as it is (its finished files stay plain, the
files it still makes are compressed).

A plan of several `rounds` keeps plan.json at the top and lays each round out as above in
round_000/, round_001/, ... (every file but plan.json); the top's dataset.npz and manifest.json
cover the rounds done so far ("rounds_done"), rewritten as each round finishes, so a corpus too
large for one sitting is usable, and can be committed and resumed, round by round.

Several processes may run the same build at once: each claims a file before it makes it
(`.NAME.claim` beside it: host and pid), leaves files another live worker holds, and moves on
to the next round's work while a round waits on another worker's shards (`_claim`).

Every file is written whole (a temporary file, then a rename), so a killed run leaves only
finished files behind and the next run starts at the first missing one; a finished file is
never rewritten, and greedy answers and seeded samples make the resumed corpus identical to an
uninterrupted one.

A conversation record (answers/ and turn2/ shards):

    {"id", "source", "messages": [{"role", "content"}, ...], "prompt_ids", "answer_ids",
     "finish_reason", "assistant_spans": [[start, end], ...]}

Its tokens are prompt_ids + answer_ids; `assistant_spans` are the half-open ranges of those
tokens the target wrote (both turns of a two-turn record), which `pack_conversations` turns into
the Dataset's per-token `assistant` mask (dataset.npz), so the trainer's loss covers every
turn. An assistant turn's tokens are the target's own ids, never a re-encoding of its decoded
text, so the data is what the target produced.

The package, stage by stage: `near_duplicates` (similarity, deduplication, Spec-Bench), `chat`
(rendering with the target's own ids), `generation` (batched generation, Magpie),
`mathematics` (the math problems), `packing` (the held-out split, dataset.npz), `files` (names,
atomic writes, claims), `plan` (CorpusPlan, RoundShare, plan.json) and `build` (the stages,
`build_corpus`, `corpus_status`).
"""

from __future__ import annotations

from jaxspec.train.corpus.build import (
    build_corpus,
    corpus_status,
)
from jaxspec.train.corpus.chat import (
    ENDINGS,
    USER_SENTINEL,
    chat_tokens,
    magpie_prefix,
)
from jaxspec.train.corpus.files import (
    ANSWERS_DIR,
    DATASET_FILE,
    MAGPIE_FILE,
    MANIFEST_FILE,
    PASSAGES_FILE,
    PLAN_FILE,
    PROMPTS_FILE,
    PROMPTS_REPORT_FILE,
    ROUND_DIR,
    SELECTION_FILE,
    TIMINGS_FILE,
    TURN2_DIR,
)
from jaxspec.train.corpus.generation import (
    ANSWER_SPANS,
    BATCH_PROMPT_TOKENS,
    Synthesis,
    synthesize_follow_ups,
    synthesize_user_prompts,
)
from jaxspec.train.corpus.mathematics import (
    BROKEN_MATH_MODULES,
    MATH_REQUESTS,
    math_modules,
    math_problems,
    math_prompts,
)
from jaxspec.train.corpus.near_duplicates import (
    CONTAINED_REFERENCE_MIN_SHINGLES,
    CONTAINED_TEXT_MIN_SHINGLES,
    SHINGLE_CHARS,
    deduplicate,
    default_spec_bench_path,
    drop_near,
    duplicate_flags,
    hold_out_score,
    near_flags,
    normalize,
    shingles,
    similarity,
    spec_bench_questions,
    spec_bench_turns,
)
from jaxspec.train.corpus.packing import (
    PackedCorpus,
    conversation_mask,
    held_out_split,
    pack_conversations,
    self_instruct_template,
    split_group,
)
from jaxspec.train.corpus.plan import (
    SOURCES,
    TEMPLATED_SOURCES,
    CorpusPlan,
    RoundShare,
)

__all__ = [
    "build_corpus",
    "corpus_status",
    "ENDINGS",
    "USER_SENTINEL",
    "chat_tokens",
    "magpie_prefix",
    "ANSWERS_DIR",
    "DATASET_FILE",
    "MAGPIE_FILE",
    "MANIFEST_FILE",
    "PASSAGES_FILE",
    "PLAN_FILE",
    "PROMPTS_FILE",
    "PROMPTS_REPORT_FILE",
    "ROUND_DIR",
    "SELECTION_FILE",
    "TIMINGS_FILE",
    "TURN2_DIR",
    "ANSWER_SPANS",
    "BATCH_PROMPT_TOKENS",
    "Synthesis",
    "synthesize_follow_ups",
    "synthesize_user_prompts",
    "BROKEN_MATH_MODULES",
    "MATH_REQUESTS",
    "math_modules",
    "math_problems",
    "math_prompts",
    "CONTAINED_REFERENCE_MIN_SHINGLES",
    "CONTAINED_TEXT_MIN_SHINGLES",
    "SHINGLE_CHARS",
    "deduplicate",
    "default_spec_bench_path",
    "drop_near",
    "duplicate_flags",
    "hold_out_score",
    "near_flags",
    "normalize",
    "shingles",
    "similarity",
    "spec_bench_questions",
    "spec_bench_turns",
    "PackedCorpus",
    "conversation_mask",
    "held_out_split",
    "pack_conversations",
    "self_instruct_template",
    "split_group",
    "SOURCES",
    "TEMPLATED_SOURCES",
    "CorpusPlan",
    "RoundShare",
]
