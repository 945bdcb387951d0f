"""One of the two processes of tests/test_sharding.py's multi-host test: 4 CPU devices here,
4 in the other process, one (2, 4) mesh over all 8 (`jaxspec.distributed`).

    python tests/multihost_worker.py RANK PORT OUT.json

Both processes run the same sharded generate; process 0 writes the tokens it got to OUT.json
(gloo prints its own lines on stdout, so the result goes to a file).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 " + os.environ.get("XLA_FLAGS", "")
os.environ["JAX_PLATFORMS"] = "cpu"

import jaxspec.distributed  # noqa: E402

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jaxspec.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=rank)

import jax  # noqa: E402

import jaxspec  # noqa: E402
from jaxspec.api import Model  # noqa: E402
from jaxspec.models import llama  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from sharding_worker import NEW_TOKENS, PROMPTS, TARGET  # noqa: E402

target = Model(config=TARGET, params=llama.init_params(TARGET, jax.random.PRNGKey(0), scale=0.2))
sharded = jaxspec.shard(target, jaxspec.make_mesh(2, 4))
result = jaxspec.generate(sharded, None, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, method="ngram",
                          num_draft_tokens=3)
if jaxspec.distributed.is_main_process():
    with open(out, "w") as f:
        json.dump({"processes": jax.process_count(), "devices": len(jax.devices()),
                   "local_devices": len(jax.local_devices()), "tokens": result.tokens}, f)
