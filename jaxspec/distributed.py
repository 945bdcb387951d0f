"""Many hosts: one jaxspec process per host, every process running the same program.

    jaxspec.distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=rank)
    model = jaxspec.shard(jaxspec.load(), jaxspec.make_mesh(data=2, model=4))  # all hosts' devices
    result = jaxspec.generate(model, None, prompts)  # every process calls it with the same arguments
    if jaxspec.distributed.is_main_process():
        print(result.text)

A thin wrapper over `jax.distributed.initialize` (call it first, before anything touches a
device). After it, `jax.devices()` lists every process's devices, so `jaxspec.make_mesh` spans
hosts; each process loads the same weights and places its own shards; `generate` gathers the
tokens to every process and detokenizes on process 0 only (other processes' `text` is None).
On CPU, cross-process collectives go through gloo.
"""

from __future__ import annotations

import jax

from jaxspec.errors import InvalidRequestError


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids: list[int] | None = None) -> None:
    """Join this process to a multi-process run (`jax.distributed.initialize`'s arguments; on a
    cluster JAX can find them itself: Slurm, TPU pods, Kubernetes). Must run before any device is used."""
    for name, value in (("num_processes", num_processes), ("process_id", process_id)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise InvalidRequestError(f"distributed.initialize's {name} must be a non-negative integer; got {value!r}")
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise InvalidRequestError(f"process_id {process_id} is not below num_processes {num_processes}")
    if "cpu" in str(jax.config.jax_platforms or "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids)


def is_main_process() -> bool:
    """Process 0: the one that detokenizes and prints."""
    return jax.process_index() == 0


def shutdown() -> None:
    jax.distributed.shutdown()
