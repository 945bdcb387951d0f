"""Sharded generation: bytes per device and (CPU-simulated) step time by mesh, on the default model.

    . .venv/bin/activate && python bench/sharding.py
    . .venv/bin/activate && python bench/sharding.py --max-new-tokens 8 --repeats 1 --no-write   # plumbing

SmolLM2-135M (f32; 9 query heads, 3 kv heads, so the model axis is 1 or 3) sharded with
`jaxspec.shard` over meshes of the 8 CPU devices XLA simulates
(`--xla_force_host_platform_device_count=8`, set here before jax starts). A batch of 6 Spec-Bench
prompts (chat template), greedy, `--max-new-tokens` each with EOS ignored, plain and prompt lookup
(k = 4), and the shipped EAGLE-3 head both sharded like the target and replicated on every
device. Every device here is a slice of the same 2 cores: the step times are a simulation of the
program's partitioning and collectives, not of a real multi-device speed-up (a mesh of 8 on
2 cores is slower than 1 device by construction). Bytes per device are real: the params each
device holds (measured from the arrays' shards), and the KV cache for 8 rows x 2048 slots
(computed from the cache's sharding: rows over "data", kv heads over "model").
On a machine with a GPU the table adds a real one-device row. The table replaces the
`## Sharding (bench/sharding.py)` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 " + os.environ.get("XLA_FLAGS", "")

import jax  # noqa: E402

import jaxspec  # noqa: E402
from jaxspec.cache import KVFormat  # noqa: E402
from jaxspec.sharding import DEFAULT_RULES  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from results_md import add_output_options, replace_section  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "bench" / "data" / "spec_bench" / "question.jsonl"
MESHES = [None, (2, 1), (8, 1), (1, 3), (2, 3)]
BATCH, KV_ROWS, KV_SLOTS = 6, 8, 2048
REPLICATED = {name: None for name in DEFAULT_RULES if name != "batch"}


def prompts() -> list[str]:
    """The first question of each of BATCH categories (a ragged batch: lengths differ)."""
    firsts = {}
    for line in QUESTIONS.read_text().splitlines():
        row = json.loads(line)
        firsts.setdefault(row["category"], row["turns"][0])
    return list(firsts.values())[:BATCH]


def param_bytes(params) -> tuple[int, int]:
    total, per_device = 0, {}
    for leaf in jax.tree.leaves(params):
        total += leaf.nbytes
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return total, max(per_device.values())


def kv_bytes_per_device(model: jaxspec.Model) -> int:
    total = KV_ROWS * KV_SLOTS * KVFormat().bytes_per_token(model.config)
    plan = model.sharding
    return total if plan is None else total // (plan.data_size * plan.axis_size("kv_heads"))


def step_ms(model, draft, texts, args, **options) -> tuple[float, float]:
    """Median ms per loop iteration (one target forward for the whole batch) and tokens/s."""
    jaxspec.generate(model, draft, texts, chat=True, max_new_tokens=args.max_new_tokens, ignore_eos=True, **options)
    per_step, rates = [], []
    for _ in range(args.repeats):
        stats = jaxspec.generate(model, draft, texts, chat=True, max_new_tokens=args.max_new_tokens,
                                 ignore_eos=True, **options).stats
        per_step.append(1000 * stats.decode_seconds / stats.target_forwards)
        rates.append(stats.decode_tokens_per_second)
    return statistics.median(per_step), statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    add_output_options(parser)
    args = parser.parse_args()
    jaxspec.set_compile_notices(False)
    base = jaxspec.load()
    head = jaxspec.load("eagle3-smollm2-135m")
    texts = prompts()
    rows = []
    for shape in MESHES:
        model = base if shape is None else jaxspec.shard(base, jaxspec.make_mesh(*shape))
        label = "1 device, no mesh" if shape is None else f"data={shape[0]}, model={shape[1]}"
        total, held = param_bytes(model.params) if shape is not None else (param_bytes(base.params)[0],) * 2
        plain_ms, plain_rate = step_ms(model, None, texts, args)
        ngram_ms, ngram_rate = step_ms(model, None, texts, args, method="ngram", num_draft_tokens=4)
        eagle_ms, eagle_rate = step_ms(model, head, texts, args, num_draft_tokens=4)
        replicated = "-"
        if shape is not None and shape[1] > 1:  # the head on every device in full
            whole_head = jaxspec.shard(head, model.sharding.mesh, rules=REPLICATED)
            replicated = "%.1f" % step_ms(model, whole_head, texts, args, num_draft_tokens=4)[0]
        rows.append(f"| {label} | {total / 2**20:.0f} | {held / 2**20:.0f} | {kv_bytes_per_device(model) / 2**20:.0f} | "
                    f"{plain_ms:.1f} ({plain_rate:.0f}) | {ngram_ms:.1f} ({ngram_rate:.0f}) | "
                    f"{eagle_ms:.1f} ({eagle_rate:.0f}) | {replicated} |")
        print(rows[-1], flush=True)
    if jax.default_backend() == "gpu":
        gpu_ms, gpu_rate = step_ms(base, None, texts, args)
        rows.append(f"| GPU, 1 device ({jax.devices()[0].device_kind}) | | | | {gpu_ms:.1f} ({gpu_rate:.0f}) | | | |")
    else:
        rows.append("| GPU, 1 device | no GPU in this run | | | | | | |")
    section = "\n".join([
        "## Sharding (bench/sharding.py)",
        "",
        f"SmolLM2-135M f32, `jaxspec.shard` over meshes of 8 simulated CPU devices ({os.cpu_count()} cores "
        f"in all), batch {BATCH} Spec-Bench prompts, {args.max_new_tokens} greedy tokens each, median of "
        f"{args.repeats}. Params: MiB in all / the most one device holds (measured from the shards). KV: MiB one "
        f"device holds of an f32 cache for {KV_ROWS} rows x {KV_SLOTS} slots. Step: ms per loop iteration (one "
        "target forward for the whole batch) and, in brackets, tokens/s over the batch; EAGLE-3 k = 4 with the "
        "shipped head sharded like the target, and replicated on every device. **The step times are a "
        "simulation**: every simulated device is a slice of the same cores, so a mesh shows its partitioning "
        "and collectives, not a speed-up; read the bytes as real and the times as the cost of the "
        "collectives on one host.",
        "",
        "| mesh | params MiB | params MiB / device | KV MiB / device | plain ms (tok/s) | ngram ms (tok/s) "
        "| eagle3 ms (tok/s) | eagle3, head replicated ms |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    print(section)
    if not args.no_write:
        replace_section(args.results, "## Sharding (bench/sharding.py)", section)


if __name__ == "__main__":
    main()
