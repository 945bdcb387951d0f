"""One GPU run of the kernels and the engine, in at most 8 minutes on one H100 or H200 (issue 60).

    bench/gpu_run.sh OUT                  # on the GPU machine: jaxspec from this tree, the machine's jax
    bench/gpu_run.sh --cpu OUT            # the rehearsal: every step on tiny shapes, Pallas interpreted
    python bench/gpu_run.py --only sweep OUT            # some of the steps
    python bench/gpu_run.py --step sweep --cpu OUT      # one step in this process (what the others spawn)

Four steps, each in its own process under its own time limit (BUDGET_S), so a step that fails,
hangs or runs out of memory leaves the next ones their time. A step writes OUT/<step>.md as it
goes (one cut off at its limit keeps the rows it finished); OUT/gpu_run.md collects them, and
each is printed when its step ends.

  tests     the kernel tests (tests/test_flash_decode.py, test_kv_quant.py, test_int8_matmul.py)
            natively under pytest, where pytest, chex and jaxspec's other dependencies import
            (--cpu: collected only; the suite runs them interpreted); then every kernel against
            its reference in a built-in check that needs only jax
  sweep     the decode-attention kernel (jaxspec/pallas/flash_decode.py, Pallas's Triton
            backend) tuned per K/V format (bf16, q8_0, q5_1, q8_0 K + q5_1 V) over full rows
            (B=8, S=8192), ragged rows (lengths spread over [1, S]) and a verify (T=5): block_s
            x split_size at the default warps and stages, then num_warps x num_stages at the
            best of those (jaxspec.pallas.tuning.GRID). Each config runs many calls in one
            jitted program (a fori_loop, so dispatch is not timed) beside XLA's attention, and
            the table gives each against the HBM roofline. Its last block is the tuned-table
            rows to paste into jaxspec/pallas/tuning.py. --cpu first exports the whole grid for
            CUDA (Pallas's Triton lowering, no GPU needed), then times two configs of one format.
  w8a16     the W8A16 product (jaxspec/pallas/int8_matmul.py) at Llama-3.2-1B's weight shapes,
            in one program (a fori_loop over passes through a stack of layers) beside XLA's int8
            product and XLA's bf16 dot
  generate  the engine end to end (jaxspec.spec.loop's prefill and decode programs, greedy, bf16
            weights and KV) on random weights: a Llama-3.2-1B-shaped trunk and an 8B-shaped one
            cut to EIGHT_B_LAYERS layers. Plain decode tok/s at batch 1 against the HBM roofline
            (weight + KV bytes per step), the cost of a forward of T = 1..16 tokens over a
            filled cache (timed in one program) and the break-even acceptance of k = 2, 4, 8
            drafts from that curve (`break_even`).

Why Triton and not Mosaic GPU: the kernel is written for Pallas's Triton lowering (any tile of
>= 16 rows, reductions over one axis), and a decode program's tile is G*T <= 20 query rows, so
it is bound by HBM bandwidth, not by Hopper's 64-row warpgroup products that Mosaic GPU exposes.

Imports: jaxspec/__init__.py loads the checkpoint readers and tokenizers (gguf, tokenizers,
jinja2, ...), which the GPU machine's image need not have; every step reads jaxspec's modules
without it (`narrow_imports`), so the GPU path needs jax, flax and numpy only.
"""

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import itertools
import math
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = ("tests", "sweep", "w8a16", "generate")
# Seconds per step on a GPU: a step starts no new work after its budget and is killed GRACE_S
# later; with process start-up the four fit in 8 minutes.
BUDGET_S = {"tests": 80, "sweep": 140, "w8a16": 40, "generate": 160}
GRACE_S = 15
# Peak HBM bandwidth (GB/s) by a part of jax's device_kind; the first match counts.
PEAK_HBM_GBPS = (("H200", 4800), ("H100 PCIe", 2000), ("H100 NVL", 3900), ("H100", 3350))
KV_FORMATS = ("bf16/bf16", "q8_0/q8_0", "q5_1/q5_1", "q8_0/q5_1")
KERNEL_TESTS = ("tests/test_flash_decode.py", "tests/test_kv_quant.py", "tests/test_int8_matmul.py")
BUILTIN_CHECKS_S = 25  # what the tests step keeps for its built-in checks after pytest
EIGHT_B_LAYERS = 8  # of 32: a forward's compile grows with its unrolled layers


def narrow_imports() -> None:
    """Make `import jaxspec.<module>` skip jaxspec/__init__.py (the checkpoint readers and
    tokenizers it loads import packages beyond jax, flax and numpy): an empty package object
    whose path is the tree's jaxspec/. Nothing to do where jaxspec is imported already."""
    if "jaxspec" not in sys.modules:
        package = types.ModuleType("jaxspec")
        package.__path__ = [str(ROOT / "jaxspec")]
        sys.modules["jaxspec"] = package


# --- what every step shares ----------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    """One step's run: where its table goes, whether it is the CPU rehearsal, when it must stop."""

    out: pathlib.Path
    cpu: bool
    deadline: float  # time.monotonic() after which the step starts no new work
    lowering_stride: int = 1  # the sweep's CUDA lowering check takes every n-th configuration (1: all)
    lines: list[str] = dataclasses.field(default_factory=list)
    path: pathlib.Path | None = None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, *lines: str) -> None:
        """Lines of the step's markdown, written through to OUT/<step>.md at once."""
        self.lines += lines
        self.path.write_text("\n".join(self.lines) + "\n", encoding="utf-8")

    def note(self, message: str) -> None:
        print(f"gpu_run: {message}", flush=True)


def device_line() -> str:
    import jax

    device = jax.devices()[0]
    peak = peak_gbps(device.device_kind)
    bandwidth = f"peak HBM {peak} GB/s" if peak else "no known peak HBM bandwidth: % of roofline not given"
    return f"Device: {device.device_kind} ({device.platform}), jax {jax.__version__}; {bandwidth}."


def peak_gbps(kind: str) -> int | None:
    return next((gbps for part, gbps in PEAK_HBM_GBPS if part in kind), None)


def percent(needed_bytes: float, seconds: float | None, peak: int | None) -> str:
    """The time the bytes take at peak bandwidth, as a share of `seconds` ("-" without a peak or a time)."""
    return "-" if peak is None or not seconds else f"{needed_bytes / (peak * 1e9) / seconds:.0%}"


def compile_all(lowered: dict) -> dict:
    """{name: compiled program or the exception its compile raised}, compiled on several threads
    (XLA compiles outside the interpreter lock; tracing, before this, does not)."""
    workers = max(1, min(8, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {name: pool.submit(program.compile) for name, program in lowered.items()}
    compiled = {}
    for name, future in futures.items():
        try:
            compiled[name] = future.result()
        except Exception as error:  # a config Triton refuses is a row, not the end of the step
            compiled[name] = error
    return compiled


def seconds_per_call(program, args, calls: int, repeats: int) -> tuple[float, object]:
    """Median seconds of one of the `calls` calls a compiled fori_loop program makes, and its
    output (after one untimed run)."""
    import jax

    output = jax.block_until_ready(program(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(program(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / calls, output


def short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".replace("|", "/").replace("\n", " ")
    return text[:160]


# --- (a) kernel tests ----------------------------------------------------------------------------


def step_tests(ctx: Context) -> None:
    ctx.add("## Kernel tests", "", device_line(), "")
    pytest_run(ctx)
    builtin_checks(ctx)


def builtin_checks(ctx: Context) -> None:
    """Each kernel against its reference at the sizes its model uses, natively (--cpu: interpreted)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.pallas import flash_decode as fd
    from jaxspec.pallas import int8_matmul, kv_quant

    interpret = jax.default_backend() != "gpu"
    capacity, head_dim = (64, 32) if ctx.cpu else (512, 128)
    rng = np.random.RandomState(0)
    reference = jax.jit(fd.flash_decode_reference)
    ctx.add("", "Built-in checks (max |kernel - reference|; tolerance atol = rtol, the tests' own):", "",
            "| check | max diff | tolerance | result |", "|---|---:|---:|---|")

    def row(name: str, check) -> None:
        if ctx.left() < 0:
            ctx.add(f"| {name} | - | - | not run: out of time |")
            return
        try:
            diff, tolerance, ok = check()
            ctx.add(f"| {name} | {diff:.1e} | {tolerance:.0e} | {'ok' if ok else 'FAILED'} |")
        except Exception as error:
            ctx.add(f"| {name} | - | - | ERROR {short(error)} |")

    def attention(kv_format: str, group: int, steps: int, tree: bool):
        key_format, value_format = kv_format.split("/")
        lengths = jnp.array([0, 37, capacity - steps], jnp.int32)
        q = jnp.asarray(rng.randn(3, steps, 2, group, head_dim), jnp.float32)  # [B, T, K, G, H]
        keys = kv_quant.quantize_reference(jnp.asarray(rng.randn(3, 2, capacity, head_dim) * 2), key_format)
        values = kv_quant.quantize_reference(jnp.asarray(rng.randn(3, 2, capacity, head_dim)), value_format)
        mask = None
        if tree:  # node t's parent is a random earlier node; t sees its ancestors and itself
            visible = np.eye(steps, dtype=bool)[None].repeat(3, 0)  # [B, T, T]
            for node in range(1, steps):
                visible[:, node] |= visible[:, rng.randint(node)]
            mask = fd.TreeMask(start=lengths, visible=jnp.asarray(visible))
        ours = fd.flash_decode(q, keys, values, lengths, mask=mask, block_s=16, split_size=32, interpret=interpret)
        theirs = reference(q, keys, values, lengths, mask=mask)
        tolerance = 3e-5 if "q" in kv_format else 2e-5
        diff = float(jnp.max(jnp.abs(ours - theirs)))
        return diff, tolerance, bool(jnp.all(jnp.abs(ours - theirs) <= tolerance * (1 + jnp.abs(theirs))))

    cases = itertools.product(("f32/f32", *KV_FORMATS), (1, 5))
    if ctx.cpu:  # the suite checks every case interpreted; here the plumbing only
        cases = (("f32/f32", 1), ("q8_0/q5_1", 5))
    for kv_format, steps in cases:
        row(f"flash_decode {kv_format} G=4 T={steps}", functools.partial(attention, kv_format, 4, steps, False))
    row("flash_decode q8_0/q5_1 tree of 9", functools.partial(attention, "q8_0/q5_1", 2, 9, True))

    def quantize(fmt: str):
        x = jnp.asarray(rng.randn(2, 5, 2, head_dim), jnp.float32)  # [B, T, K, H]: a verify's new K
        ours, theirs = kv_quant.quantize(x, fmt, interpret=interpret), kv_quant.quantize_reference(x, fmt)
        same = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)))
        return 0.0 if same else float("inf"), 0.0, same

    for fmt in ("q8_0", "q5_1"):
        row(f"quantize {fmt} (bit for bit)", functools.partial(quantize, fmt))

    def matmul(out_features: int, in_features: int, tokens: int):
        values = jnp.asarray(rng.randint(-127, 128, (out_features, in_features)), jnp.int8)  # [O, I]
        scales = jnp.asarray(rng.uniform(0.5, 4.0, out_features) / 127.0, jnp.float32)  # [O]
        x = jnp.asarray(rng.randn(in_features, tokens), jnp.bfloat16)  # [I, N]
        ours = int8_matmul.w8a16_matmul_pallas(values, scales, x, interpret=interpret)
        theirs = int8_matmul.w8a16_matmul_reference(values, scales, x)
        diff = float(jnp.max(jnp.abs(ours - theirs)) / jnp.max(jnp.abs(theirs)))
        return diff, 1e-5, diff <= 1e-5

    shapes = ((48, 40, 3),) if ctx.cpu else ((2048, 2048, 5), (3072, 2048, 16), (200, 96, 37))
    for out_features, in_features, tokens in shapes:
        row(f"w8a16 {out_features}x{in_features} N={tokens} (relative)",
            functools.partial(matmul, out_features, in_features, tokens))


def pytest_run(ctx: Context) -> None:
    """The kernel test files under pytest: they need pytest, chex and jaxspec's other dependencies,
    which the GPU image may lack; then the log's last line says which import failed."""
    # addopts cleared: pyproject's name pytest-xdist's options, which the GPU image may lack.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *KERNEL_TESTS]
    if ctx.cpu:
        command.append("--collect-only")  # the suite runs them interpreted; this checks the command
    log = ctx.out / "pytest.log"
    try:
        with open(log, "w", encoding="utf-8") as handle:  # leaves the built-in checks their time
            result = subprocess.run(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                    timeout=max(10.0, ctx.left() - BUILTIN_CHECKS_S))
        outcome = f"exit {result.returncode}"
    except subprocess.TimeoutExpired:
        outcome = "stopped at the step's time limit"
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR", "E   ModuleNotFoundError"))]
    summary = next((line for line in reversed(lines) if line.strip()), "no output").strip().replace("`", "'")
    ctx.add(f"pytest {' '.join(KERNEL_TESTS)}{' --collect-only' if ctx.cpu else ''}: {outcome}; `{summary}` "
            f"(log: {log.name})", *[f"- {line}" for line in failed[:20]])


# --- (b) the decode kernel's sweep ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionSizes:
    batch: int  # B
    capacity: int  # S
    num_kv_heads: int  # K
    group: int  # G: query heads per kv head
    head_dim: int  # H
    verify_steps: int  # T of the verify shape


GPU_ATTENTION = AttentionSizes(batch=8, capacity=8192, num_kv_heads=8, group=4, head_dim=128, verify_steps=5)
CPU_ATTENTION = AttentionSizes(batch=2, capacity=128, num_kv_heads=1, group=4, head_dim=32, verify_steps=5)


def kv_buffers_shape(kv_format: str, sizes: AttentionSizes):
    """The shape structs of the [B, K, S, H] keys and values in `kv_format` ("keys/values")."""
    import jax

    from jaxspec.pallas import kv_quant

    shape = (sizes.batch, sizes.num_kv_heads, sizes.capacity, sizes.head_dim)
    return tuple(jax.eval_shape(lambda fmt=fmt: kv_quant.zeros(shape, kv_quant.Format(fmt)))
                 for fmt in kv_format.split("/"))


def export_for_cuda(kv_format: str, steps: int, params, sizes: AttentionSizes = GPU_ATTENTION, *,
                    tree: bool = False) -> str:
    """The kernel at `params` (a tuning.KernelParams) exported for CUDA from shape structs, as MLIR
    text: Pallas's Triton lowering runs without a GPU (every op needs a Triton rule, every tile a
    Triton shape); only Triton's own compile is left for the GPU. `tree`: under a draft tree's
    mask over the T new tokens."""
    import jax
    import jax.numpy as jnp
    from jax import export

    from jaxspec.pallas import flash_decode as fd

    B, K, G, H = sizes.batch, sizes.num_kv_heads, sizes.group, sizes.head_dim
    keys, values = kv_buffers_shape(kv_format, sizes)
    mask = None
    if tree:
        mask = fd.TreeMask(start=jax.ShapeDtypeStruct((B,), jnp.int32),
                           visible=jax.ShapeDtypeStruct((B, steps, steps), jnp.bool_))
    kernel = functools.partial(fd._flash_decode_pallas, **dataclasses.asdict(params), interpret=False)
    triton_call = "__gpu$xla.gpu.triton"
    exported = export.export(jax.jit(kernel), platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(triton_call)])(
        jax.ShapeDtypeStruct((B, steps, K, G, H), jnp.float32), keys, values,
        jax.ShapeDtypeStruct((B,), jnp.int32), mask)
    text = exported.mlir_module()
    if triton_call not in text:
        raise AssertionError(f"{kv_format} {params}: no Triton call in the exported program")
    return text


def lowering_configs() -> list[tuple]:
    """(K/V format, T, tree, tuning.KernelParams) of the grid the sweep may time: every K/V format x
    shape (decode, verify, a tree's verify) x block_s x split_size at the default warps and stages,
    then each num_warps x num_stages once (attributes of the Triton call, not of the lowering)."""
    from jaxspec.pallas.tuning import GRID, KernelParams

    shapes = ((1, False), (GPU_ATTENTION.verify_steps, False), (9, True))
    configs = [(kv_format, steps, tree, KernelParams(block_s=block_s, split_size=split_size))
               for kv_format, (steps, tree), block_s, split_size
               in itertools.product(KV_FORMATS, shapes, GRID["block_s"], GRID["split_size"])]
    return configs + [("q8_0/q5_1", 1, False, KernelParams(num_warps=num_warps, num_stages=num_stages))
                      for num_warps, num_stages in itertools.product(GRID["num_warps"], GRID["num_stages"])]


def lowers_for_cuda(kv_format: str, steps: int, tree: bool, params) -> None:
    """AssertionError unless the kernel exports for CUDA with `params` in its Triton call."""
    text = export_for_cuda(kv_format, steps, params, tree=tree)
    for name in ("num_warps", "num_stages"):
        if f"{name} = {getattr(params, name)} : i32" not in text:
            raise AssertionError(f"{kv_format} T={steps} {params}: {name} is not the Triton call's")


def lowering_check(ctx: Context) -> None:
    """The grid (`lowering_configs`, every `ctx.lowering_stride`-th) exported for CUDA at the GPU sizes."""
    configs = lowering_configs()[::ctx.lowering_stride]
    failures, start = [], time.monotonic()
    for kv_format, steps, tree, params in configs:
        try:
            lowers_for_cuda(kv_format, steps, tree, params)
        except Exception as error:
            failures.append(f"{kv_format} T={steps}{' tree' if tree else ''} {params}: {short(error)}")
    every = "" if ctx.lowering_stride == 1 else f", every {ctx.lowering_stride}th"
    ctx.add(f"Lowering for CUDA (jax.export, no GPU): {len(configs) - len(failures)} of {len(configs)} "
            f"configurations lower ({len(KV_FORMATS)} K/V formats x decode, verify, tree x block_s x split_size, and "
            f"each num_warps x num_stages{every}; {time.monotonic() - start:.0f} s).",
            *[f"- FAILED {line}" for line in failures], "")


def attention_loop(attend, calls: int):
    """A jitted program of `calls` attention calls in a fori_loop; each call's q is scaled by its
    index, so no call is loop-invariant (XLA would hoist it) and the last output is comparable
    across programs."""
    import jax
    import jax.numpy as jnp

    def run(q, keys, values, lengths):  # q [B, T, K, G, H] -> the last call's output, float32
        def body(index, _):
            return attend(q * (1.0 + 1e-3 * index.astype(jnp.float32)), keys, values, lengths)

        return jax.lax.fori_loop(0, calls, body, jnp.zeros(q.shape, jnp.float32))

    return jax.jit(run)


def step_sweep(ctx: Context) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.pallas import flash_decode as fd
    from jaxspec.pallas import kv_quant
    from jaxspec.pallas.tuning import GRID, KernelParams, ShapeClass, Tuned

    sizes = CPU_ATTENTION if ctx.cpu else GPU_ATTENTION
    interpret = jax.default_backend() != "gpu"
    kind = jax.devices()[0].device_kind
    peak = peak_gbps(kind)
    calls, repeats = (2, 1) if ctx.cpu else (32, 3)
    ctx.add("## Decode attention: the kernel's sweep", "", device_line(), "")
    formats = KV_FORMATS
    if ctx.cpu:
        lowering_check(ctx)
        # Timed interpreted only for the plumbing: one format, a tiny S (the grid's sizes would be one block).
        formats = (KV_FORMATS[-1],)
        first = [KernelParams(block_s=16, split_size=64)]
        second = [(2, 1)]
    else:
        # The kernel's defaults first: if time runs out, every cell has been timed at them.
        first = sorted((KernelParams(block_s=b, split_size=s)
                        for b, s in itertools.product(GRID["block_s"], GRID["split_size"])),
                       key=lambda params: params != KernelParams())
        second = [pair for pair in itertools.product(GRID["num_warps"], GRID["num_stages"])
                  if pair != (KernelParams.num_warps, KernelParams.num_stages)]

    B, S, K, G, H, T = (sizes.batch, sizes.capacity, sizes.num_kv_heads, sizes.group, sizes.head_dim,
                        sizes.verify_steps)
    key = jax.random.PRNGKey(0)
    lengths = {"full": jnp.full((B,), S - 1, jnp.int32),
               "ragged": jnp.asarray(np.linspace(1, S - 1, B).round(), jnp.int32),
               "verify": jnp.full((B,), S - T, jnp.int32)}
    steps = {"full": 1, "ragged": 1, "verify": T}
    queries = {1: jax.random.normal(jax.random.fold_in(key, 1), (B, 1, K, G, H)),
               T: jax.random.normal(jax.random.fold_in(key, T), (B, T, K, G, H))}
    raw_keys = jax.random.normal(jax.random.fold_in(key, 100), (B, K, S, H)) * 2  # [B, K, S, H]
    raw_values = jax.random.normal(jax.random.fold_in(key, 101), (B, K, S, H))
    cache = {}  # kv_format -> (keys, values)
    for kv_format in formats:
        key_format, value_format = kv_format.split("/")
        cache[kv_format] = (kv_quant.quantize_reference(raw_keys, key_format),
                            kv_quant.quantize_reference(raw_values, value_format))
    del raw_keys, raw_values

    def needed_bytes(kv_format: str, shape: str) -> float:
        """K/V bytes a call must read: the slots its rows' queries can see."""
        slot_bytes = sum(kv_quant.nbytes(x) for x in cache[kv_format]) / (B * S)
        return float(np.minimum(np.asarray(lengths[shape]) + steps[shape], S).sum()) * slot_bytes

    # A cell is (K/V format, program shape); full and ragged rows share the decode program.
    cells = [(kv_format, program) for kv_format in formats for program in ("decode", "verify")]
    shapes_of = {"decode": ("full", "ragged"), "verify": ("verify",)}

    def args(kv_format: str, shape: str):
        return (queries[steps[shape]], *cache[kv_format], lengths[shape])

    def run_programs(programs: dict) -> dict:
        """{(cell, params): {shape: seconds per call, "<shape> output": its last output} or
        {"error": text}}; each also a row of the every-config table as soon as it is timed."""
        lowered, results = {}, {}
        for (cell, params), attend in programs.items():
            if ctx.left() < 0:
                break
            kv_format, program = cell
            shape = shapes_of[program][0]
            try:
                lowered[(cell, params)] = attention_loop(attend, calls).lower(*args(kv_format, shape))
            except Exception as error:
                results[(cell, params)] = {"error": short(error)}
        for name, compiled in compile_all(lowered).items():
            if isinstance(compiled, Exception):
                results[name] = {"error": short(compiled)}
                continue
            (kv_format, program), _ = name
            timing = {}
            for shape in shapes_of[program]:
                if ctx.left() < 0:
                    break
                try:
                    timing[shape], timing[f"{shape} output"] = seconds_per_call(compiled, args(kv_format, shape),
                                                                                calls, repeats)
                except Exception as error:
                    timing = {"error": short(error)}
                    break
            if timing:
                results[name] = timing
        for ((kv_format, program), params), value in results.items():
            times = value.get("error") or ", ".join(f"{shape} {value[shape] * 1e6:.0f}"
                                                    for shape in shapes_of[program] if shape in value)
            if params == "xla":
                ctx.add(f"| {kv_format} | {program} | XLA | | | | {times} |")
            else:
                ctx.add(f"| {kv_format} | {program} | {params.block_s} | {params.split_size} | {params.num_warps} | "
                        f"{params.num_stages} | {times} |")
        return results

    def kernel(params):
        return functools.partial(fd.flash_decode, **dataclasses.asdict(params), interpret=interpret)

    ctx.add(f"Each program: {calls} calls in one jitted fori_loop, median of {repeats} runs. B={B} S={S} K={K} "
            f"G={G} H={H}; decode T=1 over full rows (length S-1) and ragged rows (lengths "
            f"{', '.join(str(int(n)) for n in lengths['ragged'])}); verify T={T} over full rows.", "",
            "Every program, as timed (us per call):", "",
            "| K / V | program | block_s | split | warps | stages | us per shape |",
            "|---|---|---:|---:|---:|---:|---|")
    ctx.note(f"sweep: XLA's attention, {len(cells)} programs")
    reference = run_programs({(cell, "xla"): fd.flash_decode_reference for cell in cells})
    ctx.note(f"sweep: block_s x split_size, {len(first) * len(cells)} programs ({ctx.left():.0f} s left)")
    measured = run_programs({(cell, params): kernel(params) for params in first for cell in cells})

    def speedup(cell, params) -> float:
        """XLA's time / the kernel's; for decode the worse of full and ragged rows (0: not measured)."""
        ours, theirs = measured.get((cell, params), {}), reference.get((cell, "xla"), {})
        shapes = shapes_of[cell[1]]
        if not all(shape in ours and shape in theirs for shape in shapes):
            return 0.0
        return min(theirs[shape] / ours[shape] for shape in shapes)

    def best(cell):
        return max((params for (c, params) in measured if c == cell), key=lambda p: speedup(cell, p), default=None)

    ctx.note(f"sweep: num_warps x num_stages at each cell's best, {len(second) * len(cells)} programs "
             f"({ctx.left():.0f} s left)")
    stage_two = {}
    for cell in cells:
        top = best(cell)
        if top is not None and speedup(cell, top) > 0:
            for num_warps, num_stages in second:
                params = dataclasses.replace(top, num_warps=num_warps, num_stages=num_stages)
                stage_two[(cell, params)] = kernel(params)
    measured |= run_programs(stage_two)

    ctx.add("", "Best per cell: the kernel at its shape class's tuned row (decode: the best by the worse of full and "
            "ragged rows) beside XLA; roofline = the K/V bytes the rows' queries can see / peak bandwidth (XLA reads "
            "every slot; the kernel stops at a row's last visible block).", "",
            "| shape | K / V | MB needed | XLA us | XLA of roofline | kernel us | kernel of roofline | XLA / kernel "
            "| block_s | split | warps | stages | max diff | programs timed (failed) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    rows = []
    for cell in cells:
        kv_format, program = cell
        top = best(cell)
        tried = [params for (c, params) in measured if c == cell]
        failed = sum("error" in measured[(cell, params)] for params in tried)
        theirs = reference.get((cell, "xla"), {})
        ours = measured.get((cell, top), {})
        tiling = "| - | - | - | - |" if top is None else \
            f"| {top.block_s} | {top.split_size} | {top.num_warps} | {top.num_stages} |"
        for shape in shapes_of[program]:
            needed = needed_bytes(kv_format, shape)
            xla_s, ours_s = theirs.get(shape), ours.get(shape)
            ratio, diff = "-", "-"
            if ours_s and xla_s:
                ratio = f"{xla_s / ours_s:.2f}x"
                diff = f"{float(jnp.max(jnp.abs(ours[f'{shape} output'] - theirs[f'{shape} output']))):.1e}"
            ctx.add(f"| {shape} | {kv_format} | {needed / 1e6:.1f} | {microseconds(xla_s)} | "
                    f"{percent(needed, xla_s, peak)} | {microseconds(ours_s)} | {percent(needed, ours_s, peak)} | "
                    f"{ratio} {tiling} {diff} | {len(tried) - failed} ({failed}) |")
        if top is not None and speedup(cell, top) > 0:
            rows.append(Tuned(kind, ShapeClass(program), kv_format, top, round(speedup(cell, top), 2)))
    errors = sorted({value["error"] for value in (*measured.values(), *reference.values()) if "error" in value})
    if errors:
        ctx.add("", *[f"- error seen: {error}" for error in errors[:10]])
    ctx.add("", "Rows for jaxspec/pallas/tuning.py's TUNED (as they are: \"auto\" takes the kernel where speedup >= "
            "WIN_MARGIN):", "", "```python", *[f"    {format_row(row)}," for row in rows], "```")


def microseconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.0f}"


def format_row(row) -> str:
    """A tuning.Tuned as the source line TUNED holds."""
    p = row.params
    return (f"Tuned({row.device_kind!r}, ShapeClass.{row.shape_class.name}, {row.kv_format!r}, "
            f"KernelParams(block_s={p.block_s}, split_size={p.split_size}, num_warps={p.num_warps}, "
            f"num_stages={p.num_stages}), speedup={row.speedup})")


# --- (c) the W8A16 product -----------------------------------------------------------------------

# Llama-3.2-1B's weights [O, I]: q/k/v and gate/up fused (as jaxspec.load fuses them), the tied head.
W8A16_SHAPES = (("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
                ("lm_head", 128256, 2048))
W8A16_TOKENS = (1, 5, 16)  # N: a decode step, a verify of 4 drafts, a batch of 16 rows
# Each pass reads at least this many int8 weight bytes, in distinct weights (several times a
# Hopper's L2, so no pass finds its weights cached).
PASS_BYTES = 128 * 2**20
MAX_LAYERS = 32


def step_w8a16(ctx: Context) -> None:
    import jax
    import jax.numpy as jnp

    from jaxspec.pallas import int8_matmul

    interpret = jax.default_backend() != "gpu"
    peak = peak_gbps(jax.devices()[0].device_kind)
    divisor, calls, repeats = (64, 2, 1) if ctx.cpu else (1, 16, 3)
    token_counts = (5,) if ctx.cpu else W8A16_TOKENS
    max_layers = 2 if ctx.cpu else MAX_LAYERS
    ctx.add("## W8A16 product", "", device_line(), "",
            f"int8 [O, I] x bf16 [I, N] -> float32 [O, N], a product per layer over a stack of L distinct weights, "
            f"{calls} passes in one jitted fori_loop (us per product; median of {repeats} runs). Beside it XLA's int8 "
            f"product (w8a16_matmul_reference: the int8 -> bf16 convert fused into XLA's dot) and XLA's bf16 dot "
            f"of bf16 weights (the bf16 format's product). Roofline: weight + scale + x + out bytes / peak.", "",
            "| weight | O x I | N | L | kernel us | kernel of roofline | XLA int8 us | XLA int8 of roofline | "
            "XLA bf16 us | bf16 of its roofline | bf16 / kernel | max rel diff |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    products = {
        "kernel": lambda w, s, x: int8_matmul.w8a16_matmul_pallas(w, s, x, interpret=interpret),
        "int8": int8_matmul.w8a16_matmul_reference,
        "bf16": lambda w, s, x: jax.lax.dot(w, x.astype(jnp.bfloat16), preferred_element_type=jnp.float32),
    }

    def passes(product, layers: int):
        def run(weights, scales, x):  # weights: L of [O, I]; x [I, N] -> float32 [O, N]
            def body(index, total):
                x_now = (x * (1.0 + 1e-3 * index.astype(jnp.float32))).astype(x.dtype)  # not loop-invariant
                for layer in range(layers):
                    total = total + product(weights[layer], scales[layer], x_now)
                return total

            return jax.lax.fori_loop(0, calls, body, jnp.zeros((weights[0].shape[0], x.shape[1]), jnp.float32))

        return jax.jit(run)

    for name, out_features, in_features in W8A16_SHAPES[:2] if ctx.cpu else W8A16_SHAPES:
        out_features, in_features = out_features // divisor, in_features // divisor
        layers = max(1, min(max_layers, math.ceil(PASS_BYTES / divisor**2 / (out_features * in_features))))
        if ctx.left() < 0:
            ctx.add(f"| {name} | {out_features}x{in_features} | - | {layers} | not run: out of time |")
            continue
        ctx.note(f"w8a16: {name} {out_features}x{in_features}, {layers} layers ({ctx.left():.0f} s left)")
        keys = jax.random.split(jax.random.PRNGKey(out_features), layers)
        int8_weights = [jax.random.randint(k, (out_features, in_features), -127, 128, jnp.int8) for k in keys]
        scales = [jnp.full((out_features,), 0.01, jnp.float32) for _ in keys]
        bf16_weights = [(w.astype(jnp.float32) * 0.01).astype(jnp.bfloat16) for w in int8_weights]
        inputs, lowered, timing = {}, {}, {}
        for tokens, path in itertools.product(token_counts, products):
            x = jax.random.normal(jax.random.PRNGKey(tokens), (in_features, tokens)).astype(jnp.bfloat16)
            inputs[tokens, path] = (bf16_weights if path == "bf16" else int8_weights, scales, x)
            try:
                lowered[tokens, path] = passes(products[path], layers).lower(*inputs[tokens, path])
            except Exception as error:
                timing[tokens, path] = error
        for program, compiled in compile_all(lowered).items():
            try:
                if isinstance(compiled, Exception):
                    raise compiled
                if ctx.left() < 0:
                    raise TimeoutError("out of time")
                timing[program] = seconds_per_call(compiled, inputs[program], calls * layers, repeats)
            except Exception as error:
                timing[program] = error
        for tokens in token_counts:
            ctx.add(w8a16_row(name, out_features, in_features, tokens, layers,
                              {path: timing.get((tokens, path)) for path in products}, peak))
        del int8_weights, bf16_weights, inputs, lowered


def w8a16_row(name, out_features, in_features, tokens, layers, timing, peak) -> str:
    """One product's table row from {path: (seconds, output) or the exception it raised}."""
    int8_weight = out_features * in_features + 4 * out_features  # int8 values, float32 scales
    activations = 2 * in_features * tokens + 4 * out_features * tokens  # bf16 x in, float32 out
    moved = {"kernel": int8_weight + activations, "int8": int8_weight + activations,
             "bf16": 2 * out_features * in_features + activations}
    cells, errors = [], []
    for path in ("kernel", "int8", "bf16"):
        value = timing.get(path)
        if isinstance(value, tuple):
            cells += [f"{value[0] * 1e6:.1f}", percent(moved[path], value[0], peak)]
        else:
            cells += ["-", "-"]
            errors.append(f"{path}: {short(value) if value is not None else 'not run'}")
    ratio, diff = "-", "-"
    if all(isinstance(timing.get(path), tuple) for path in ("kernel", "bf16")):
        ratio = f"{timing['bf16'][0] / timing['kernel'][0]:.2f}x"
    if all(isinstance(timing.get(path), tuple) for path in ("kernel", "int8")):
        ours, theirs = timing["kernel"][1], timing["int8"][1]
        diff = f"{float(abs(ours - theirs).max() / abs(theirs).max()):.1e}"
    note = f" {'; '.join(errors)}" if errors else ""
    return (f"| {name} | {out_features}x{in_features} | {tokens} | {layers} | {' | '.join(cells)} | {ratio} | "
            f"{diff}{note} |")


# --- (d) generate end to end ---------------------------------------------------------------------


def trunk_configs(cpu: bool) -> dict:
    """{name: ModelConfig}: Llama-3.2-1B's shapes, and Llama-3.1-8B's cut to EIGHT_B_LAYERS layers."""
    from jaxspec.config import ModelConfig

    if cpu:  # one trunk: the second differs only in its config
        return {"1B-shaped (tiny)": ModelConfig(vocab_size=512, dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                                head_dim=16, ffn_dim=128, rotary_dim=16, tie_embeddings=True)}
    common = dict(vocab_size=128256, num_heads=32, num_kv_heads=8, rope_theta=500000.0, norm_eps=1e-5,
                  max_position_embeddings=131072)
    return {"Llama-3.2-1B-shaped": ModelConfig(dim=2048, num_layers=16, head_dim=64, rotary_dim=64, ffn_dim=8192,
                                               tie_embeddings=True, **common),
            f"Llama-3.1-8B-shaped, {EIGHT_B_LAYERS} of 32 layers": ModelConfig(
                dim=4096, num_layers=EIGHT_B_LAYERS, head_dim=128, rotary_dim=128, ffn_dim=14336, **common)}


def break_even(cost_ratio: float, drafts: int) -> float | None:
    """The per-token acceptance rate a at which k drafts pay for their verify: the expected
    tokens a round commits, (1 - a^(k+1)) / (1 - a) (drafts accepted independently with
    probability a, plus the bonus token), equals the verify's cost over a plain step's,
    cost(T = k+1) / cost(T = 1), drafting taken as free. None where even a = 1 does not pay."""
    if cost_ratio <= 1:
        return 0.0
    if cost_ratio >= drafts + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        rate = (low + high) / 2
        tokens = sum(rate**i for i in range(drafts + 1))
        low, high = (rate, high) if tokens < cost_ratio else (low, rate)
    return (low + high) / 2


def step_generate(ctx: Context) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec import models
    from jaxspec.cache import KVFormat
    from jaxspec.compilation import full_precision_products
    from jaxspec.models import backends, llama, quant
    from jaxspec.models.layers import fuse_projections
    from jaxspec.sampling import SamplerSpec, SamplingParams
    from jaxspec.spec import loop

    peak = peak_gbps(jax.devices()[0].device_kind)
    prompt_tokens, new_tokens, capacity = (8, 8, 32) if ctx.cpu else (128, 256, 512)
    curve_ts = (1, 3, 8, 16) if ctx.cpu else tuple(range(1, 17))  # --cpu: k = 2, and k = 2, 8 padded
    calls, repeats = (2, 1) if ctx.cpu else (8, 3)
    kv_format = KVFormat.parse("bf16")
    ctx.add("## Generate end to end (bf16)", "", device_line(), "",
            f"Random weights of real shapes, bf16 weights and KV, batch 1, greedy. Decode: jaxspec's prefill and "
            f"decode programs (jaxspec.spec.loop), a {prompt_tokens}-token prompt and {new_tokens} new tokens, "
            f"the decode program timed (median of {repeats}); the engine pads a decode forward to the backend's token "
            f"lanes. Roofline: the weights a step reads (every linear weight; the embedding table only where it is "
            f"the head) + the K/V of the filled slots (mean over the run), over peak bandwidth. Verify cost: one "
            f"forward of T tokens over a cache of {capacity} slots holding {capacity // 2}, {calls} forwards in one "
            f"jitted fori_loop (median of {repeats}).", "")
    for name, cfg in trunk_configs(ctx.cpu).items():
        if ctx.left() < 0:
            ctx.add(f"### {name}", "", "Not run: out of time.", "")
            continue
        ctx.note(f"generate: {name}: random weights")
        params = llama.init_params(cfg, jax.random.PRNGKey(0))
        params = fuse_projections(quant.convert(params, "bf16"))
        lanes = backends.of_params(params).token_lanes
        weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
        if not cfg.tie_embeddings:
            weight_bytes -= params.embed.nbytes  # a step reads one row of the table
        prompt = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (1, prompt_tokens)), jnp.int32)
        request = loop.Request(prompt=prompt, prompt_length=jnp.array([prompt_tokens], jnp.int32),
                               max_new_tokens=jnp.array([new_tokens], jnp.int32), sampling=SamplingParams.create(1),
                               key=jax.random.PRNGKey(0))
        spec = loop.LoopSpec(cfg=cfg, capacity=capacity, sampler=SamplerSpec(), kv_format=kv_format,
                             token_lanes=lanes)
        state = jax.eval_shape(functools.partial(loop.prefill_jit, spec=spec), params, None, request)
        forward = jax.jit(full_precision_products(forward_passes), static_argnames=("cfg", "calls"))
        cache = models.create_cache(cfg, 1, capacity, kv_format=kv_format).set_length(jnp.array([capacity // 2]))
        tokens = {steps: jnp.full((1, steps), 7, jnp.int32) for steps in curve_ts}
        lowered = {"prefill": loop.prefill_jit.lower(params, None, request, spec=spec),
                   "decode": loop.decode_jit.lower(params, None, state, request, spec=spec)}
        lowered |= {steps: forward.lower(params, tokens[steps], cache, cfg=cfg, calls=calls) for steps in curve_ts}
        ctx.note(f"generate: {name}: compiling {len(lowered)} programs ({ctx.left():.0f} s left)")
        compiled = compile_all(lowered)
        ctx.add(f"### {name}", "")
        try:
            for program in ("prefill", "decode"):
                if isinstance(compiled[program], Exception):
                    raise compiled[program]
            times, generated = [], 0
            for _ in range(repeats):
                state = compiled["prefill"](params, None, request)
                jax.block_until_ready(state)
                start = time.perf_counter()
                state = jax.block_until_ready(compiled["decode"](params, None, state, request))
                times.append(time.perf_counter() - start)
                generated = int(state.num_generated[0]) - 1  # the prefill committed the first
            seconds = statistics.median(times)
            mean_slots = prompt_tokens + new_tokens / 2
            kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * mean_slots
            step_bytes = weight_bytes + kv_bytes
            tokens_per_s = generated / seconds
            roofline = f"{peak * 1e9 / step_bytes:.0f}" if peak else "-"
            share = percent(step_bytes, 1 / tokens_per_s, peak)
            ctx.add(f"Plain decode: {tokens_per_s:.1f} tok/s ({generated} tokens in {seconds * 1e3:.0f} ms; token "
                    f"lanes {lanes}); a step reads {weight_bytes / 1e9:.2f} GB of weights + {kv_bytes / 1e6:.1f} MB "
                    f"of K/V: roofline {roofline} tok/s, reached {share}.", "")
        except Exception as error:
            ctx.add(f"Plain decode: ERROR {short(error)}", "")
        costs = {}
        for steps in curve_ts:
            program = compiled[steps]
            if isinstance(program, Exception) or ctx.left() < 0:
                continue
            costs[steps] = [seconds_per_call(program, (params, tokens[steps], cache), calls, 1)[0]
                            for _ in range(repeats)]
        costs = {steps: statistics.median(samples) for steps, samples in costs.items()}
        errors = {steps: short(program) for steps, program in compiled.items() if isinstance(program, Exception)}
        ctx.add("| T | ms per forward | cost(T) / cost(1) |", "|---:|---:|---:|")
        for steps in curve_ts:
            if steps in costs:
                ctx.add(f"| {steps} | {costs[steps] * 1e3:.3f} | {costs[steps] / costs.get(1, float('nan')):.3f} |")
            else:
                ctx.add(f"| {steps} | {errors.get(steps, 'not run: out of time')} | - |")
        ctx.add("", "Break-even acceptance: the per-token acceptance rate a at which k drafts pay, "
                "(1 - a^(k+1)) / (1 - a) = cost(k+1) / cost(1), drafting free (prompt lookup's); with the engine's "
                f"padding to {lanes} token lanes both sides are padded first (`loop.padded_tokens`).", "",
                "| k | cost(k+1) / cost(1) | break-even a | padded: cost / cost | padded: break-even a |",
                "|---:|---:|---:|---:|---:|")
        for drafts in (2, 4, 8):
            padded = (loop.padded_tokens(drafts + 1, 1, lanes), loop.padded_tokens(1, 1, lanes))
            cells = []
            for verify, plain in ((drafts + 1, 1), padded):
                if verify in costs and plain in costs:
                    ratio = costs[verify] / costs[plain]
                    rate = break_even(ratio, drafts)
                    cells += [f"{ratio:.3f}", "never" if rate is None else f"{rate:.2f}"]
                else:
                    cells += ["-", "-"]
            ctx.add(f"| {drafts} | {' | '.join(cells)} |")
        ctx.add("")
        del params, state, compiled


def forward_passes(params, tokens, cache, *, cfg, calls):
    """`calls` forwards of tokens [B, T] at the cache's length in a fori_loop, the cache carried
    (updated in place, as the loop carries it); a checksum of every row's last logits."""
    import jax
    import jax.numpy as jnp

    from jaxspec import models

    def body(_, carry):
        cache, checksum = carry
        logits, _, cache = models.forward(params, cfg, tokens, cache)
        return cache, checksum + logits[:, -1].max()  # a whole row reduced, as greedy's argmax reads it

    return jax.lax.fori_loop(0, calls, body, (cache, jnp.zeros((), jnp.float32)))[1]


# --- the run -------------------------------------------------------------------------------------

STEP_FUNCTIONS = {"tests": step_tests, "sweep": step_sweep, "w8a16": step_w8a16, "generate": step_generate}


def run_step(name: str, out: pathlib.Path, *, cpu: bool, budget: float | None = None, lowering_stride: int = 1,
             name_imports: bool = False) -> None:
    """One step in this process: its table to OUT/<name>.md (an error ends it as a row).
    name_imports: end the table with the packages the process imported (a step's own process)."""
    # The tests step's pytest is a process of its own: neither may hold the GPU's memory ahead of
    # use (JAX's default preallocation) while the other runs. Read when jax starts its backend.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    narrow_imports()
    import jax

    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out=out, cpu=cpu, deadline=time.monotonic() + (BUDGET_S[name] if budget is None else budget),
                  lowering_stride=lowering_stride, path=out / f"{name}.md")
    ctx.add()
    if not cpu and jax.default_backend() != "gpu":
        ctx.add(f"## {name}", "", f"Not run: jax's backend is {jax.default_backend()!r}, not a GPU (--cpu rehearses "
                "on CPU).")
        raise SystemExit(2)
    start = time.monotonic()
    try:
        STEP_FUNCTIONS[name](ctx)
    except Exception as error:
        ctx.add("", f"Step ERROR after {time.monotonic() - start:.0f} s: {short(error)}")
        raise
    ctx.add("", f"({name}: {time.monotonic() - start:.0f} s)")
    if name_imports:
        ctx.add("", f"Imported packages: {', '.join(imported_packages())}.")


def imported_packages() -> list[str]:
    """The top-level packages outside the standard library (and jaxspec) this process imported."""
    names = {name.partition(".")[0] for name in sys.modules}
    return sorted(name for name in names - set(sys.stdlib_module_names)
                  if not name.startswith("_") and name not in ("jaxspec", "cython_runtime"))


def run_all(out: pathlib.Path, steps: list[str], cpu: bool, lowering_stride: int = 1) -> int:
    """Each step in a child process under its time limit; prints each table as its step ends and
    collects them in OUT/gpu_run.md. Returns the first failing step's exit status."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:  # no git on the GPU machine
        commit = ""
    header = (f"# GPU run (bench/gpu_run.sh{' --cpu' if cpu else ''})\n\n{datetime.date.today().isoformat()}, "
              f"jaxspec {commit or 'from a tree without git'}.\n")
    sections, status = [header], 0
    env = os.environ | ({"JAX_PLATFORMS": "cpu"} if cpu else {})
    for name in steps:
        table = out / f"{name}.md"
        table.unlink(missing_ok=True)
        command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--step", name, str(out),
                   f"--lowering-stride={lowering_stride}", *(["--cpu"] if cpu else [])]
        start = time.monotonic()
        # A session of its own, so a step cut off takes its children (the tests step's pytest) with it.
        child = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
        try:
            code = child.wait(timeout=BUDGET_S[name] + GRACE_S)
            ending = "" if code == 0 else f"\n\n(step {name} exited with status {code})"
        except subprocess.TimeoutExpired:
            code, ending = 124, (f"\n\n(step {name} stopped at its {BUDGET_S[name] + GRACE_S} s limit: the rows above "
                                 "are what it finished)")
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        status = status or code
        text = (table.read_text(encoding="utf-8") if table.exists() else f"## {name}\n\nNo table.") + ending
        sections.append(text.strip() + "\n")
        print(f"\n{text.strip()}\n\n(gpu_run: {name} took {time.monotonic() - start:.0f} s)", flush=True)
    (out / "gpu_run.md").write_text("\n".join(sections), encoding="utf-8")
    print(f"gpu_run: wrote {out / 'gpu_run.md'}")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="the directory the tables go to")
    parser.add_argument("--cpu", action="store_true", help="the rehearsal: tiny shapes, Pallas interpreted")
    parser.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps (default {','.join(STEPS)})")
    parser.add_argument("--step", choices=STEPS, help="run this one step in this process")
    parser.add_argument("--lowering-stride", type=int, default=1,
                        help="--cpu: lower every n-th configuration of the grid for CUDA (default 1: all)")
    args = parser.parse_args(argv)
    if args.step:
        run_step(args.step, args.out, cpu=args.cpu, lowering_stride=args.lowering_stride, name_imports=True)
        return 0
    steps = [step.strip() for step in args.only.split(",")]
    if unknown := set(steps) - set(STEPS):
        parser.error(f"unknown steps {sorted(unknown)}; choose from {STEPS}")
    return run_all(args.out, steps, args.cpu, args.lowering_stride)


if __name__ == "__main__":
    sys.exit(main())
