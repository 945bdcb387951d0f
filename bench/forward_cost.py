"""Shared by the bench scripts: the cost of one trunk forward at T new tokens, and the median
time of one jitted call (`median_seconds`) and the GPU-or-`--tiny` guard of the kernel timings.

Contract: `forward_costs` times `llama.forward` the way the generation loop runs it (jitted, the
cache carried through a `fori_loop` and updated in place, batch 1, a cache of a given capacity
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


def forward_costs(variants: dict, capacity: int, length: int, calls: int, iters: int = 4) -> dict:
    """Median seconds of one `llama.forward` per variant {name: (params, cfg, T)}.

    Each timed call runs `iters` forwards in a jitted `fori_loop` with the cache in the carry (as
    the generation loop carries it, updated in place), and the time is divided by `iters`. The
    cache has `capacity` slots, `length` of them in use. Every variant compiles once (untimed),
    then `calls` timed calls go round-robin over the variants.
    """
    from jaxspec.cache import KVCache

    runners = {}
    for name, (params, cfg, steps) in variants.items():
        cache = KVCache.create(cfg, 1, capacity).set_length(jnp.full((1,), length, jnp.int32))
        tokens = jnp.asarray(np.arange(100, 100 + steps, dtype=np.int32)[None])  # [1, T]
        loop = functools.partial(forward_loop, cfg=cfg, iters=iters)
        timed(loop, params, tokens, cache)  # compile
        runners[name] = (loop, params, tokens, cache)
    samples = {name: [] for name in variants}
    for _ in range(calls):
        for name, (loop, params, tokens, cache) in runners.items():
            samples[name].append(timed(loop, params, tokens, cache)[1] / iters)
    return {name: statistics.median(s) for name, s in samples.items()}


@functools.partial(jax.jit, static_argnames=("cfg", "iters"))
def forward_loop(params, tokens, cache, *, cfg, iters):
    """`iters` forwards of `tokens` [1, T] at the cache's length; a checksum of their logits."""
    from jaxspec.models import llama

    def body(_, carry):
        cache, checksum = carry
        logits, _, cache = llama.forward(params, cfg, tokens, cache)
        return cache, checksum + logits[0, -1, 0]  # keeps every forward live

    return jax.lax.fori_loop(0, iters, body, (cache, jnp.zeros((), jnp.float32)))[1]
