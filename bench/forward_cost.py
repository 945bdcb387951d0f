"""Shared by the bench scripts: the cost of one trunk forward at T new tokens, and the median
time of one jitted call (`median_seconds`) and the GPU-or-`--tiny` guard of the kernel timings.

Contract: `forward_costs` times a trunk's forward (`jaxspec.models.forward`) the way the generation loop runs it (jitted, the
cache carried through a `fori_loop` and updated in place, a batch of rows, a cache of a given capacity
holding a given number of tokens) and returns the median seconds per forward of each variant.
Variants are timed round-robin, so drift on a shared machine hits them alike. The params are an
argument of the jitted loop, never closed over, so any weight format (float32, bfloat16, int8)
is timed as the loop would read it.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_seconds(fn, *args, repeats: int) -> float:
    """Median wall seconds of `fn(*args)` over `repeats` calls, after one untimed (compiling) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def require_gpu_or_tiny(tiny: bool) -> bool:
    """A kernel timing runs natively on a GPU, or in the interpreter with --tiny (plumbing only);
    exits with that advice otherwise. Returns whether the kernel must run interpreted."""
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not tiny:
        sys.exit(f"timing needs a GPU (JAX backend is {jax.default_backend()!r}); pass --tiny to check "
                 "the plumbing on CPU")
    return not on_gpu


def timed(fn, *args):
    """(fn(*args) once ready, wall seconds it took)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def heap_tree(nodes: int, top_k: int = 4) -> np.ndarray:
    """A draft tree's parents (verify indices) int32[nodes]: node v's parent is (v - 1) // top_k,
    a complete top_k-ary tree in breadth-first order. What a verify costs depends on its token
    count, not on the tree's shape: any tree of that many nodes times the same."""
    return (np.arange(nodes, dtype=np.int32)) // top_k


def forward_costs(variants: dict, capacity: int, length: int, calls: int, iters: int = 4, *, batch: int = 1,
                  compile_under: dict | None = None) -> dict:
    """Median seconds of one trunk forward (`jaxspec.models.forward`, any family) per variant {name: (params, cfg, T)}, or
    {name: (params, cfg, T, parents)} for a tree verify: T = 1 + N tokens under the ancestor mask
    of the tree whose node parents are `parents` int32[N] (`heap_tree`), at the nodes' depths.

    Each timed call runs `iters` forwards in a jitted `fori_loop` with the cache in the carry (as
    the generation loop carries it, updated in place), and the time is divided by `iters`. The
    cache has `batch` rows of `capacity` slots, `length` of them in use. Every variant compiles
    once (untimed, ahead of time: its own program even where another has the same shapes), under
    `compile_under[name]()` when given (a context manager: a setting read while tracing); then
    `calls` timed calls go round-robin over the variants.
    """
    import contextlib

    from jaxspec import models

    runners = {}
    for name, (params, cfg, steps, *tree) in variants.items():
        cache = models.create_cache(cfg, batch, capacity).set_length(jnp.full((batch,), length, jnp.int32))
        tokens = jnp.asarray(np.tile(np.arange(100, 100 + steps, dtype=np.int32), (batch, 1)))  # [B, T]
        parents = jnp.asarray(np.tile(tree[0], (batch, 1))) if tree else None  # [B, N]
        depth = int(np.log2(max(steps, 2))) + 1 if tree else 0  # enough passes for any heap_tree
        if compile_under:
            jax.clear_caches()  # jit reuses a trace of the same signature, made under another setting
        with (compile_under or {}).get(name, contextlib.nullcontext)():
            loop = forward_loop.lower(params, tokens, cache, parents, cfg=cfg, iters=iters, depth=depth).compile()
        timed(loop, params, tokens, cache, parents)  # warm
        runners[name] = (loop, params, tokens, cache, parents)
    samples = {name: [] for name in variants}
    for _ in range(calls):
        for name, (loop, params, tokens, cache, parents) in runners.items():
            samples[name].append(timed(loop, params, tokens, cache, parents)[1] / iters)
    return {name: statistics.median(s) for name, s in samples.items()}


@functools.partial(jax.jit, static_argnames=("cfg", "iters", "depth"))
def forward_loop(params, tokens, cache, parents=None, *, cfg, iters, depth=0):
    """`iters` forwards of `tokens` [B, T] at the cache's length (under a tree's ancestor mask
    when `parents` is given, as the loop's tree verify runs); a checksum of their logits."""
    from jaxspec import models
    from jaxspec.spec import tree as tree_lib

    options = {}
    if parents is not None:
        depths = tree_lib.node_depths(parents, depth)  # [B, T]
        options = dict(positions=cache.length[:, None] + depths,
                       tree_mask=tree_lib.verify_mask(parents, depth, cache.length, tokens.shape[1]))

    def body(_, carry):
        cache, checksum = carry
        logits, _, cache = models.forward(params, cfg, tokens, cache, **options)
        # Every row's last logits reduced, as a greedy step's argmax reads them (one element could
        # let XLA slice the vocabulary product down to a column).
        return cache, checksum + logits[:, -1].max()

    return jax.lax.fori_loop(0, iters, body, (cache, jnp.zeros((), jnp.float32)))[1]
