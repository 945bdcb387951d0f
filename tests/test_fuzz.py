"""Hostile input, property-based (issue 19): config.json values, safetensors headers, shard
indexes, GGUF headers, EAGLE-3 head directories, converted-directory metadata, tokenizer files,
`jaxspec.load` names, generate() arguments and CLI flags, each mutated by hypothesis.

Every case must end in one of two ways: a `JaxspecError` with a message, or a correct result. Any
other exception, a hang (each case runs under a 20 s alarm) or a load that "succeeds" with values
the file does not hold fails the test. What counts as correct: for HF directories and heads, the
arrays the fixtures wrote, byte for byte; for a mutated GGUF or converted directory, the params of
the unmutated file (whose GGUF reading tests/test_gguf.py checks against gguf's own quants).

CI runs a fixed, derandomized set of examples (the suite's budget). For a wider run, set
JAXSPEC_FUZZ_EXAMPLES=N (random seeds, N examples per test) and JAXSPEC_FUZZ_REPORT=FILE to get
the outcomes by kind as JSON:
    JAXSPEC_FUZZ_EXAMPLES=2000 JAXSPEC_FUZZ_REPORT=/tmp/fuzz.json python -m pytest -q tests/test_fuzz.py
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import re
import shutil
import signal
import struct

import gguf
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

import ckpt_fixtures as fx
import jaxspec
from jaxspec import checkpoints, cli
from jaxspec.api import Model, prepare
from jaxspec.checkpoints.resolve import KNOWN_NAMES
from jaxspec.config import SANE_RANGES
from jaxspec.errors import JaxspecError
from jaxspec.models import eagle3
from jaxspec.spec import loop
from jaxspec.tokenizer import Tokenizer

_WIDE_RUN = int(os.environ.get("JAXSPEC_FUZZ_EXAMPLES", "0"))
OUTCOMES: collections.Counter = collections.Counter()  # (test, outcome) -> cases


def fuzz(examples: int):
    """CI: `examples` derandomized cases; a wide run: JAXSPEC_FUZZ_EXAMPLES random ones."""
    return settings(max_examples=_WIDE_RUN or examples, derandomize=not _WIDE_RUN, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.large_base_example])


@pytest.fixture(scope="module", autouse=True)
def outcome_report():
    yield
    report = os.environ.get("JAXSPEC_FUZZ_REPORT")
    if report:
        by_test = collections.defaultdict(dict)
        for (test, outcome), count in sorted(OUTCOMES.items()):
            by_test[test][outcome] = count
        pathlib.Path(report).write_text(json.dumps(by_test, indent=2))


@contextlib.contextmanager
def _alarm(seconds: int = 20):
    """A hang fails the case instead of stalling the suite (SIGALRM interrupts a blocking open)."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"hung for {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def outcome(test: str, call, *named):
    """Run `call`: its result, or None after a JaxspecError (whose message must name each of
    `named`). Every other exception propagates and fails the case."""
    try:
        with _alarm():
            result = call()
    except JaxspecError as error:
        message = str(error)
        assert message.strip(), f"{type(error).__name__} without a message"
        if named:  # a file's problem names the file, or its directory where the fault is the directory's
            assert any(str(name) in message for name in named), f"{message!r} names none of {named}"
        OUTCOMES[test, type(error).__name__] += 1
        return None
    OUTCOMES[test, "ok"] += 1
    return result


# ---------------------------------------------------------------------------------------------
# A tiny Llama written with numpy alone (no torch): the ground truth is the arrays written.
# ---------------------------------------------------------------------------------------------

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, torch_dtype="float32")


def tiny_state_dict(config: dict = CONFIG, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = d // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim

    def w(*shape):
        return rng.randn(*shape).astype(np.float32) * 0.5

    state = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": w(d), "lm_head.weight": w(v, d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state |= {p + "input_layernorm.weight": w(d), p + "post_attention_layernorm.weight": w(d),
                  p + "self_attn.q_proj.weight": w(d, d), p + "self_attn.k_proj.weight": w(kv, d),
                  p + "self_attn.v_proj.weight": w(kv, d), p + "self_attn.o_proj.weight": w(d, d),
                  p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d),
                  p + "mlp.down_proj.weight": w(d, f)}
    return state


def write_hf_dir(directory: pathlib.Path, config, state: dict[str, np.ndarray], *, shards: int = 1) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(to_json(config))
    if shards == 1:
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(state)
    weight_map = {}
    for shard in range(shards):
        file_name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: state[name] for name in names[shard::shards]}
        save_file(part, str(directory / file_name), metadata={"format": "pt"})
        weight_map |= {name: file_name for name in part}
    index = {"metadata": {"total_size": sum(a.nbytes for a in state.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def _fingerprints(arrays) -> collections.Counter:
    return collections.Counter((a.shape, a.dtype.str, a.tobytes()) for a in map(np.asarray, arrays))


def assert_sane_config(cfg) -> None:
    """What any loaded config must hold, whatever the file said."""
    for field in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
                  "max_position_embeddings"):
        value = getattr(cfg, field)
        assert isinstance(value, int) and not isinstance(value, bool) and value >= 1, (field, value)
    assert cfg.num_heads % cfg.num_kv_heads == 0
    for field, (low, high) in SANE_RANGES.items():
        value = getattr(cfg, field)
        assert isinstance(value, int | float) and not isinstance(value, bool), (field, value)
        assert math.isfinite(value) and low <= value <= high, (field, value)
    assert all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t for t in cfg.eos_token_ids)


def assert_loaded_what_the_file_holds(checkpoint, state: dict[str, np.ndarray]) -> None:
    """Every loaded array is one the file holds, bit for bit, and every tensor the file holds is
    loaded once: nothing misread, nothing silently dropped."""
    assert_sane_config(checkpoint.config)
    loaded = [leaf for leaf in jax.tree.leaves(checkpoint.params) if np.asarray(leaf).size]
    assert _fingerprints(loaded) == _fingerprints(state.values()), "the loaded params are not the file's tensors"
    assert checkpoint.config.num_layers == CONFIG["num_hidden_layers"]


class _Arrays(dict):
    """The written tensors by name (a short repr: hypothesis prints a failing case's arguments)."""

    def __repr__(self) -> str:
        return f"<{len(self)} tensors>"


@pytest.fixture(scope="module")
def ground_truth() -> dict[str, np.ndarray]:
    return _Arrays(tiny_state_dict())


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------

# Values a hostile or careless config holds: every JSON type, the edges of every range.
_EDGE_INTS = st.sampled_from([0, 1, 2, 3, -1, 7, 8, 16, 31, 32, 64, 127, 128, 129, 2**31, 2**32 + 1, 2**63, 10**18,
                              -(2**63)])
JSON_SCALARS = st.one_of(
    _EDGE_INTS, st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.5, 2.5, 32.0, 1e-30, -1e-5, 1e308, 1e9, 1e300, 1e-20, 0.5e-2, 1e11]), st.booleans(), st.none(),
    st.text(max_size=8), st.sampled_from(["32", "abc", "false", "true", "", "llama", "qwen2", "qwen3", "NaN"]))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                  st.dictionaries(st.text(max_size=6), inner,
                                                                                  max_size=3)), max_leaves=6)
CONFIG_KEYS = st.sampled_from(sorted(CONFIG) + [
    "head_dim", "rope_scaling", "rope_parameters", "attention_bias", "sliding_window", "use_sliding_window",
    "num_nextn_predict_layers", "partial_rotary_factor", "text_config", "layer_types", "hidden_act", "mlp_bias",
    "pad_token_id", "original_max_position_embeddings"])


@dataclasses.dataclass(frozen=True)
class Nested:
    """A JSON value `depth` lists deep (json recurses once per level, in reading and in writing:
    `to_json` writes it as text)."""

    depth: int

    def text(self) -> str:
        return "[" * self.depth + "1" + "]" * self.depth


def nested(depth: int) -> Nested:
    return Nested(depth)


def to_json(value) -> str:
    """json.dumps, with each `Nested` written out as its text."""
    deep = {}

    def placeholder(item):
        if not isinstance(item, Nested):
            raise TypeError(type(item).__name__)
        deep[f'"nested-{id(item)}"'] = item.text()
        return f"nested-{id(item)}"

    text = json.dumps(value, default=placeholder)
    for key, replacement in deep.items():
        text = text.replace(key, replacement)
    return text


DEEP = st.integers(900, 5000).map(nested)


@st.composite
def mutated_configs(draw):
    if draw(st.integers(0, 19)) == 0:  # not an object at all
        return draw(st.one_of(JSON_SCALARS, st.lists(JSON_SCALARS, max_size=3), DEEP))
    config = dict(CONFIG)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(CONFIG_KEYS)
        if key in config and draw(st.integers(0, 4)) == 0:
            del config[key]
        else:
            config[key] = draw(JSON_VALUES)
    return config


@fuzz(150)
@given(config=mutated_configs())
def test_config_values(tmp_path_factory, ground_truth, config):
    directory = tmp_path_factory.mktemp("config")
    write_hf_dir(directory, config, ground_truth)
    # jaxspec.load, as a user calls it (head detection first, then the trunk, then the tokenizer);
    # what loads is then checked tensor by tensor through the unfused checkpoint.
    if outcome("config.json", lambda: jaxspec.load(str(directory), use_cache=False), directory) is not None:
        assert_loaded_what_the_file_holds(checkpoints.load_checkpoint(directory, use_cache=False), ground_truth)
    shutil.rmtree(directory)


@pytest.mark.parametrize(("change", "needle"), [
    (dict(hidden_size="abc"), "expected an integer, got 'abc'"),
    (dict(hidden_size="32"), "expected an integer, got '32'"),  # int() would take it
    (dict(intermediate_size=64.5), "expected an integer, got 64.5"),  # int() would truncate it
    (dict(eos_token_id=2.5), "expected an integer, got 2.5"),
    (dict(eos_token_id=[2, True]), "expected an integer, got True"),
    (dict(eos_token_id=500), "eos_token_id=500 is not a token id of the 128-token vocabulary"),
    (dict(bos_token_id=-1), "bos_token_id=-1 is not a token id"),
    (dict(num_attention_heads=0), "ZeroDivisionError"),
    (dict(num_hidden_layers=10**9), "num_hidden_layers is 1000000000 but the file holds tensors for layers 0..1"),
    (dict(num_hidden_layers=1), "num_hidden_layers is 1 but the file holds tensors for layers 0..1"),
    (dict(rope_theta=float("nan")), "rope_theta=nan must be a finite number > 0"),
    (dict(rms_norm_eps=0.0), "norm_eps=0.0 must be a finite number > 0"),
    (dict(max_position_embeddings=0), "max_position_embeddings=0 must be >= 1"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false"),
    (dict(tie_word_embeddings=True), "the file contradicts its config"),  # an untied file's head would be dropped
    (dict(rope_scaling=1), "wrong type or range"),
    (dict(model_type=None), "model_type None is not supported"),
    (dict(rms_norm_eps=1e9), "norm_eps=1000000000.0 is outside [1e-12, 0.01]"),
    (dict(rms_norm_eps=1e300), "norm_eps=1e+300 is outside"),
    (dict(rope_theta=1e300), "rope_theta=1e+300 is outside [1, 1e+10]"),
    (dict(rope_theta=0.5), "rope_theta=0.5 is outside"),
    (dict(vocab_size=nested(3000)), "nested too deeply"),
])
def test_issue_config_examples_are_named(tmp_path, ground_truth, change, needle):
    """The config examples issue 19 lists, each a JaxspecError naming config.json and the problem."""
    write_hf_dir(tmp_path, {**CONFIG, **change}, ground_truth)
    with pytest.raises(JaxspecError, match=re.escape(needle)) as error:
        jaxspec.load(str(tmp_path), use_cache=False)
    assert str(tmp_path / "config.json") in str(error.value)


@pytest.mark.parametrize("eps, theta", [(1e-12, 1.0), (1e-6, 1e4), (1e-5, 5e5), (1e-6, 1e6), (1e-2, 1e8)])
def test_every_real_models_numbers_load(tmp_path, ground_truth, eps, theta):
    """The edges of SANE_RANGES and the values real checkpoints use (Llama 3's 5e5, Qwen's 1e6) load."""
    write_hf_dir(tmp_path, {**CONFIG, "rms_norm_eps": eps, "rope_theta": theta}, ground_truth)
    model = jaxspec.load(str(tmp_path), use_cache=False)
    assert (model.config.norm_eps, model.config.rope_theta) == (eps, theta)


def test_a_config_that_is_not_an_object_is_named(tmp_path, ground_truth):
    write_hf_dir(tmp_path, [], ground_truth)
    with pytest.raises(JaxspecError, match=re.escape(f"{tmp_path / 'config.json'} is not a JSON object")):
        jaxspec.load(str(tmp_path), use_cache=False)


# ---------------------------------------------------------------------------------------------
# safetensors headers and the shard index
# ---------------------------------------------------------------------------------------------

DTYPES = st.sampled_from(["F32", "F16", "BF16", "F64", "I32", "I64", "U8", "I8", "BOOL", "F8_E4M3", "X", "", 7])


@st.composite
def header_edits(draw, names: list[str]):
    """One edit of a safetensors header (as JSON) or of its raw bytes."""
    kind = draw(st.sampled_from(["dtype", "shape", "offsets", "drop", "rename", "duplicate", "length", "bytes",
                                 "metadata", "truncate"]))
    return kind, draw(st.sampled_from(names)), draw(st.data())


def _edit_header(data: bytes, kind: str, name: str, draw) -> bytes:
    (length,) = struct.unpack_from("<Q", data)
    header, body = json.loads(data[8 : 8 + length]), data[8 + length :]
    if kind == "length":
        return struct.pack("<Q", draw.draw(st.one_of(_EDGE_INTS.filter(lambda n: 0 <= n < 2**64),
                                                     st.integers(0, len(data) + 64)))) + data[8:]
    if kind == "bytes":
        raw = bytearray(data)
        for _ in range(draw.draw(st.integers(1, 4))):
            raw[draw.draw(st.integers(0, 8 + length - 1))] = draw.draw(st.integers(0, 255))
        return bytes(raw)
    if kind == "truncate":
        return data[: draw.draw(st.integers(0, len(data) - 1))]
    entry = header[name]
    if kind == "dtype":
        entry["dtype"] = draw.draw(DTYPES)
    elif kind == "shape":
        entry["shape"] = draw.draw(st.one_of(st.lists(st.one_of(_EDGE_INTS, st.integers(-3, 70)), max_size=4),
                                             JSON_SCALARS))
    elif kind == "offsets":
        start, end = entry["data_offsets"]
        entry["data_offsets"] = draw.draw(st.one_of(
            st.tuples(st.integers(-8, len(body) + 8), st.integers(-8, len(body) + 8)).map(list),
            st.just([start + 4, end + 4]), st.just([start, end - 4]), st.just([0, end - start]), JSON_SCALARS))
    elif kind == "drop":
        del header[name]
    elif kind == "rename":
        header[draw.draw(st.sampled_from(["x", name + "x", name.replace("layers.1", "layers.7"), "lm_head.bias"]))] = \
            header.pop(name)
    elif kind == "duplicate":
        other = draw.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
        header[other] = dict(entry)
    elif kind == "metadata":
        header["__metadata__"] = draw.draw(JSON_VALUES)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory, ground_truth) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("hf-source")
    write_hf_dir(directory, CONFIG, ground_truth)
    return directory


@fuzz(150)
@given(edit=header_edits(sorted(tiny_state_dict())))
def test_safetensors_headers(tmp_path_factory, hf_source, ground_truth, edit):
    kind, name, draw = edit
    directory = tmp_path_factory.mktemp("st")
    (directory / "config.json").write_bytes((hf_source / "config.json").read_bytes())
    data = (hf_source / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(_edit_header(data, kind, name, draw))
    checkpoint = outcome("safetensors header", lambda: checkpoints.load_checkpoint(directory, use_cache=False),
                         "model.safetensors", directory)
    if checkpoint is not None:
        assert_loaded_what_the_file_holds(checkpoint, ground_truth)
    shutil.rmtree(directory)


@pytest.fixture(scope="module")
def sharded_source(tmp_path_factory, ground_truth) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("sharded")
    write_hf_dir(directory / "model", CONFIG, ground_truth, shards=2)
    save_file({"x": np.zeros(4, np.float32)}, str(directory / "outside.safetensors"))
    return directory / "model"


@st.composite
def index_edits(draw):
    index_value = st.one_of(
        st.sampled_from(["../outside.safetensors", "/etc/passwd", str(pathlib.Path("/tmp") / "outside.safetensors"),
                         "missing.safetensors", "", ".", "config.json", "model.safetensors.index.json",
                         "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "sub/../x"]),
        JSON_SCALARS)
    kind = draw(st.sampled_from(["entry", "drop", "add", "weight_map", "top", "bytes"]))
    return kind, draw(index_value), draw(st.integers(0, 10**6)), draw(st.data())


@fuzz(80)
@given(edit=index_edits())
def test_shard_index(tmp_path_factory, sharded_source, ground_truth, edit):
    kind, value, pick, draw = edit
    directory = tmp_path_factory.mktemp("index") / "model"
    shutil.copytree(sharded_source, directory)
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    names = sorted(index["weight_map"])
    if kind == "entry":
        index["weight_map"][names[pick % len(names)]] = value
    elif kind == "drop":
        del index["weight_map"][names[pick % len(names)]]
    elif kind == "add":
        index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = value
    elif kind == "weight_map":
        index["weight_map"] = value
    elif kind == "top":
        index = value
    text = json.dumps(index).encode()
    if kind == "bytes":
        raw = bytearray(text)
        raw[pick % len(raw)] = draw.draw(st.integers(0, 255))
        text = bytes(raw)
    index_path.write_bytes(text)
    checkpoint = outcome("shard index", lambda: checkpoints.load_checkpoint(directory, use_cache=False))
    if checkpoint is not None:
        assert_loaded_what_the_file_holds(checkpoint, ground_truth)
    shutil.rmtree(directory.parent)


# ---------------------------------------------------------------------------------------------
# EAGLE-3 head directories: config.json values and safetensors headers
# ---------------------------------------------------------------------------------------------

HEAD_CONFIG = eagle3.Eagle3Config(vocab_size=CONFIG["vocab_size"], dim=CONFIG["hidden_size"], num_heads=4,
                                  num_kv_heads=2, head_dim=8, ffn_dim=64, draft_vocab_size=16, rope_theta=10000.0,
                                  rotary_dim=8, norm_eps=1e-5, max_position_embeddings=128)


@pytest.fixture(scope="module")
def head_source(tmp_path_factory):
    """A random EAGLE-3 head saved as a checkpoint directory, and its arrays as saved."""
    directory = tmp_path_factory.mktemp("head")
    params = eagle3.init_params(HEAD_CONFIG, jax.random.PRNGKey(1))
    checkpoints.save_eagle3(directory, HEAD_CONFIG, params)
    return directory, _Arrays(eagle3.named_leaves(params))


HEAD_KEYS = st.sampled_from(["architectures", "hidden_size", "num_attention_heads", "num_key_value_heads",
                             "head_dim", "intermediate_size", "draft_vocab_size", "vocab_size", "rope_theta",
                             "rms_norm_eps", "max_position_embeddings", "partial_rotary_factor", "eagle_config",
                             "rope_scaling", "num_hidden_layers", "target_hidden_size"])


@fuzz(120)
@given(edits=st.lists(st.tuples(HEAD_KEYS, JSON_VALUES), min_size=1, max_size=2),
       header=st.one_of(st.none(), header_edits(["fc.weight", "d2t", "t2d", "lm_head.weight", "norm.weight",
                                                 "midlayer.self_attn.q_proj.weight"])))
def test_eagle3_head(tmp_path_factory, head_source, edits, header):
    source, arrays = head_source
    directory = tmp_path_factory.mktemp("head-edit")
    config = json.loads((source / "config.json").read_text())
    for key, value in edits if header is None else ():  # one kind of damage per case
        config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    data = (source / "model.safetensors").read_bytes()
    if header is not None:
        data = _edit_header(data, *header)
    (directory / "model.safetensors").write_bytes(data)
    head = outcome("EAGLE-3 head", lambda: jaxspec.load(str(directory)), directory)
    if head is not None:
        assert isinstance(head.config, eagle3.Eagle3Config)
        cfg = head.config
        for field in ("dim", "num_heads", "num_kv_heads", "head_dim", "ffn_dim", "draft_vocab_size", "vocab_size",
                      "max_position_embeddings", "rotary_dim"):
            assert type(getattr(cfg, field)) is int and getattr(cfg, field) >= 1, field
        assert math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0 and math.isfinite(cfg.norm_eps) and cfg.norm_eps > 0
        _, unfused = checkpoints.load_eagle3(directory)
        for name, want in arrays.items():
            np.testing.assert_array_equal(np.asarray(eagle3.named_leaves(unfused)[name]), np.asarray(want), name)
    shutil.rmtree(directory)


# ---------------------------------------------------------------------------------------------
# GGUF headers: metadata and tensor infos (the tensor data itself is not checksummed by GGUF)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_source(tmp_path_factory, ground_truth):
    """A tiny GGUF (quantized tensors of several types, a loadable tokenizer), what it loads as,
    and the byte ranges of its header's numeric fields."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fx, "TOKENS", _TOKENS)
        mp.setattr(fx, "MERGES", ["t o", "to k"])
        fx.write_gguf(path, ground_truth, CONFIG)
    reader = gguf.GGUFReader(path)
    base = np.lib.array_utils.byte_bounds(reader.data)[0]
    fields = []  # (offset, width) of every fixed-size number in the header: counts, types, dims, offsets
    for field in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        for part in field.parts:
            if part.dtype.kind in "iuf" and part.size == 1:
                fields.append((int(np.lib.array_utils.byte_bounds(part)[0] - base), part.dtype.itemsize))
    data_offset = min(t.data_offset for t in reader.tensors)
    model = jaxspec.load(str(path), use_cache=False)
    return path, model, sorted(fields), data_offset


_TOKENS = ["<unk>", "<s>", "</s>", "t", "o", "k", "to", "tok", *"0123456789 "]
_TOKENS += [f"x{i}" for i in range(CONFIG["vocab_size"] - len(_TOKENS))]


@st.composite
def gguf_edits(draw, fields, data_offset, size):
    kind = draw(st.sampled_from(["field", "field", "field", "bytes", "truncate"]))
    if kind == "field":
        offset, width = draw(st.sampled_from(fields))
        value = draw(st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 8, 12, 30, 31, 32, 33, 2**31 - 1, 2**31, 2**32 - 1,
                                                2**63, 2**64 - 1]), st.integers(0, 2 ** (8 * width) - 1)))
        return kind, offset, (value % 2 ** (8 * width)).to_bytes(width, "little")
    if kind == "bytes":
        return kind, draw(st.integers(0, data_offset - 1)), bytes([draw(st.integers(0, 255))])
    return kind, draw(st.integers(0, size - 1)), b""


def test_gguf_headers(tmp_path_factory, gguf_source):
    path, model, fields, data_offset = gguf_source
    original = path.read_bytes()
    cache = tmp_path_factory.mktemp("gguf-cache")

    @fuzz(200)
    @given(edit=gguf_edits(fields, data_offset, len(original)))
    def case(edit):
        kind, offset, new = edit
        data = original[:offset] if kind == "truncate" else original[:offset] + new + original[offset + len(new):]
        if data == original:
            return
        mutated = tmp_path_factory.mktemp("gguf-edit") / "edited.gguf"
        mutated.write_bytes(data)
        # Half the cases through the weight cache: a failed load must leave no entry behind.
        use_cache = offset % 2 == 0
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("JAXSPEC_CACHE_DIR", str(cache))
            loaded = outcome("GGUF header", lambda: jaxspec.load(str(mutated), use_cache=use_cache), mutated)
            if loaded is None:
                entries = list((cache / "params").glob(f"{checkpoints.file_sha256(mutated)}-*"))
                assert not entries, f"a failed load left cache entries {entries}"
        if loaded is not None:
            assert_sane_config(loaded.config)
            same_layout = (loaded.config.num_heads, loaded.config.num_kv_heads) == (model.config.num_heads,
                                                                                     model.config.num_kv_heads)
            if same_layout:  # else Q/K rows are un-permuted by other head counts: other, valid weights
                for got, want in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(model.params), strict=True):
                    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            if loaded.tokenizer is not None:
                loaded.tokenizer.decode(loaded.tokenizer.encode("tok1 to k"))
        mutated.unlink()

    case()


# GGUF tensor shapes against the config: a tensor's dims and the head counts that reshape it
# (llama.cpp's Q/K row order is undone by reshaping with the config's head counts).
GGUF_TENSORS = st.sampled_from(["token_embd.weight", "output_norm.weight", "output.weight", "blk.0.attn_q.weight",
                                "blk.0.attn_k.weight", "blk.1.attn_v.weight", "blk.1.attn_output.weight",
                                "blk.0.ffn_gate.weight", "blk.1.ffn_down.weight", "blk.0.attn_norm.weight"])
SHAPE_EDITS = st.sampled_from(["append a unit dim", "prepend a unit dim", "drop the last dim", "double the first dim",
                               "halve the first dim"])
HEAD_COUNT_KV = st.one_of(st.just("missing"), st.integers(0, 9), st.lists(st.integers(1, 4), min_size=1, max_size=3))


def _reshaped(array: np.ndarray, edit: str) -> np.ndarray:
    if edit == "append a unit dim":
        return array[..., None]
    if edit == "prepend a unit dim":
        return array[None]
    if edit == "drop the last dim":
        return array[..., 0]
    if edit == "double the first dim":
        return np.concatenate([array, array])
    return array[: max(1, array.shape[0] // 2)]


@fuzz(30)
@given(change=st.one_of(st.tuples(st.just("tensor"), GGUF_TENSORS, SHAPE_EDITS),
                        st.tuples(st.just("head_count_kv"), HEAD_COUNT_KV)))
def test_gguf_tensor_shapes_and_head_counts(tmp_path_factory, ground_truth, gguf_source, change):
    """A tensor whose shape the config does not imply, and a head_count_kv that is missing (then
    equal to head_count, as in llama.cpp), per-layer, or disagrees with the k/v tensors: refused
    naming the tensor or the key before any reshape, or loaded exactly when the value is right."""
    _, model, _, _ = gguf_source
    path = tmp_path_factory.mktemp("gguf-shape") / "shaped.gguf"
    hf_names = {gguf: hf for hf, (gguf, _) in fx._GGUF_TOP.items()}
    hf_names |= {f"blk.{i}.{gguf}": f"model.layers.{i}.{hf}" for i in range(2) for hf, (gguf, _) in
                 fx._GGUF_LAYER.items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fx, "TOKENS", _TOKENS)
        mp.setattr(fx, "MERGES", ["t o", "to k"])
        if change[0] == "tensor":
            _, name, edit = change
            weight = ground_truth[hf_names[name]]
            if name.endswith(("attn_q.weight", "attn_k.weight")):
                weight = fx.llama_cpp_permute(weight, CONFIG["num_attention_heads"] if "attn_q" in name
                                              else CONFIG["num_key_value_heads"])
            fx.write_gguf(path, ground_truth, CONFIG, skip=(name,),
                          extra_tensors={name: (_reshaped(weight, edit), fx.QT.F32)})
        else:
            value = change[1]
            if value == "missing":
                mp.setattr(gguf.GGUFWriter, "add_head_count_kv", lambda self, count: None)
            else:
                mp.setattr(gguf.GGUFWriter, "add_head_count_kv",
                           lambda self, count: self.add_array(f"{self.arch}.attention.head_count_kv", value)
                           if isinstance(value, list) else self.add_uint32(f"{self.arch}.attention.head_count_kv",
                                                                            value))
            fx.write_gguf(path, ground_truth, CONFIG)
    if change[0] == "tensor":  # refused, naming the tensor (or, where the embedding's rows size the
        # vocabulary, the output head that then disagrees with it)
        named = [change[1]] + (["output.weight"] if change[1] == "token_embd.weight" else [])
        with _alarm(), pytest.raises(JaxspecError, match="|".join(re.escape(repr(name)) for name in named)):
            jaxspec.load(str(path), use_cache=False)
        OUTCOMES["GGUF shapes", "refused"] += 1
        return
    loaded = outcome("GGUF shapes", lambda: jaxspec.load(str(path), use_cache=False), path)
    if loaded is not None:  # the right count, however written: the file's own weights
        assert_sane_config(loaded.config)
        assert loaded.config.num_kv_heads == CONFIG["num_key_value_heads"]
        for got, want in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(model.params), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.fixture(scope="module")
def converted_source(tmp_path_factory, gguf_source):
    """The tiny GGUF converted to a jaxspec directory, and what it loads as."""
    path, model, _, _ = gguf_source
    out = tmp_path_factory.mktemp("converted") / "model"
    checkpoints.convert(str(path), str(out))
    return out, jaxspec.load(str(out))


META_KEYS = st.sampled_from(["format", "format_version", "family", "config", "weight_format", "source"])


@fuzz(100)
@given(edit=st.one_of(st.tuples(st.just("top"), JSON_VALUES),
                      st.tuples(META_KEYS, JSON_VALUES),
                      st.tuples(st.just("config"), st.tuples(st.sampled_from(
                          ["vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
                           "rope_theta", "rotary_dim", "norm_eps", "max_position_embeddings", "tie_embeddings",
                           "eos_token_ids", "bos_token_id", "rope_scaling", "architecture"]), JSON_VALUES))))
def test_converted_directory_metadata(tmp_path_factory, converted_source, edit):
    source, model = converted_source
    directory = tmp_path_factory.mktemp("conv-edit") / "model"
    shutil.copytree(source, directory)
    meta_path = directory / checkpoints.JAXSPEC_META
    meta = json.loads(meta_path.read_text())
    key, value = edit
    if key == "top":
        meta = value
    elif key == "config" and isinstance(value, tuple):
        meta["config"][value[0]] = value[1]
    else:
        meta[key] = value
    meta_path.write_text(json.dumps(meta))
    loaded = outcome("converted directory", lambda: jaxspec.load(str(directory)), directory)
    if loaded is not None:
        assert_sane_config(loaded.config)
        for got, want in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(model.params), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    shutil.rmtree(directory.parent)


# ---------------------------------------------------------------------------------------------
# Tokenizer files
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_source(tmp_path_factory) -> pathlib.Path:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("tokenizer")
    vocab = {token: i for i, token in enumerate(["<s>", "</s>", "t", "o", "k", "to", "tok", "Ġ", "a", "b"])}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=[("t", "o"), ("to", "k")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "{% for m in messages %}{{ m['content'] }}"
                                                                     "{% endfor %}"}))
    assert Tokenizer.from_dir(directory).encode("tok") == [vocab["tok"]]
    return directory


@st.composite
def tokenizer_edits(draw):
    file_name = draw(st.sampled_from(["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                      "generation_config.json"]))
    kind = draw(st.sampled_from(["bytes", "truncate", "value", "binary", "null", "deep"]))
    return file_name, kind, draw(st.data())


# The fields the tokenizer side files name (a null one means "none given"; a deep one is refused).
SIDE_FILE_KEYS = st.sampled_from(["eos_token_id", "bos_token_id", "pad_token_id", "eos_token", "bos_token",
                                  "chat_template", "add_bos_token", "model_max_length"])


def _json_paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _json_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value[:12]):
            yield from _json_paths(item, (*prefix, i))


def test_null_and_deep_side_files(tmp_path, tokenizer_source):
    """generation_config.json's "eos_token_id": null means none given (the tokenizer's EOS stays);
    a side file nested thousands deep is refused naming it, not a RecursionError."""
    for file in tokenizer_source.iterdir():
        shutil.copy(file, tmp_path / file.name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None, "bos_token_id": None}))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.eos_token_ids == (1,)  # "</s>", from tokenizer_config.json
    (tmp_path / "generation_config.json").write_text(to_json({"eos_token_id": nested(5000)}))
    with pytest.raises(JaxspecError, match="generation_config.json.*nested too deeply"):
        Tokenizer.from_dir(tmp_path)


@fuzz(120)
@given(edit=tokenizer_edits())
def test_tokenizer_files(tmp_path_factory, tokenizer_source, edit):
    file_name, kind, draw = edit
    directory = tmp_path_factory.mktemp("tok-edit")
    for file in tokenizer_source.iterdir():
        shutil.copy(file, directory / file.name)
    target = directory / file_name
    data = target.read_bytes() if target.exists() else b"{}"
    if kind == "bytes":
        raw = bytearray(data)
        for _ in range(draw.draw(st.integers(1, 3))):
            raw[draw.draw(st.integers(0, len(raw) - 1))] = draw.draw(st.integers(0, 255))
        data = bytes(raw)
    elif kind == "truncate":
        data = data[: draw.draw(st.integers(0, len(data) - 1))]
    elif kind == "binary":
        data = draw.draw(st.binary(min_size=1, max_size=64))
    elif kind in ("null", "deep") and file_name != "tokenizer.json":
        document = json.loads(data)
        document = document if isinstance(document, dict) else {}
        document[draw.draw(SIDE_FILE_KEYS)] = None if kind == "null" else draw.draw(DEEP)
        data = to_json(document).encode("utf-8")
    elif kind == "deep":  # tokenizer.json nested deep: the tokenizers library's to refuse
        data = nested(draw.draw(st.integers(900, 3000))).text().encode("utf-8")
    else:  # one JSON value anywhere in the file replaced
        document = json.loads(data)
        path = draw.draw(st.sampled_from(list(_json_paths(document))))
        replacement = draw.draw(st.one_of(JSON_VALUES, st.sampled_from(["a b c", "t", "zz yy", "to k", "\ud800"])))
        if not path:
            document = replacement
        else:
            holder = document
            for key in path[:-1]:
                holder = holder[key]
            holder[path[-1]] = replacement
        data = json.dumps(document).encode("utf-8", "surrogatepass")
    target.write_bytes(data)
    tokenizer = outcome("tokenizer files", lambda: Tokenizer.from_dir(directory), file_name, directory)
    if tokenizer is not None:
        with _alarm():
            ids = tokenizer.encode("tok ab to")
            assert all(isinstance(t, int) for t in ids)
            tokenizer.decode(ids)
            outcome("tokenizer files (chat)", lambda: tokenizer.encode_chat("tok"))
    shutil.rmtree(directory)


# ---------------------------------------------------------------------------------------------
# generate() arguments: checked by prepare(), before anything is traced
# ---------------------------------------------------------------------------------------------

WEIRD = st.one_of(
    _EDGE_INTS, st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.sampled_from([np.int64(4), np.int32(-1), np.uint8(3), np.float32(0.5), np.float64("nan"), np.bool_(True),
                     np.array(3), np.array([0.5, 0.7]), "0.5", "4", "", "abc", b"4", 2**40, 2**64, -(2**70),
                     1e300, (1, 2), [0.5], [0.5, 0.9], [], {}, object(), 1 + 2j, "q8_0", "f32", "q8_0,q5_1",
                     ("q8_0", "q5_1"), "3,4,7", (3, 4, 7), "plain", "ngram", "draft", "eagle3", "mtp", "layer_skip",
                     "reference", "pallas", "interpret", "sample", "argmax"]),
    st.text(max_size=6))
OPTION_NAMES = st.sampled_from(sorted(f.name for f in __import__("dataclasses").fields(jaxspec.GenerateOptions))
                               + ["draft_params", "bogus"])
PROMPTS = st.one_of(
    st.text(max_size=12), st.text(alphabet=st.characters(categories=["Cs", "Co", "Cc", "Zs", "Ll"]), max_size=6),
    st.binary(max_size=6), st.lists(st.integers(-3, 200), max_size=5), st.lists(st.booleans(), max_size=3),
    st.lists(st.one_of(st.text(max_size=4), st.lists(st.integers(-1, 130), max_size=3)), max_size=3),
    st.sampled_from([np.array([1, 2, 3]), np.array([[1, 2], [3, 4]]), np.array([1.5]), np.array([], np.int64),
                     np.array([True]), [np.int64(5)], [[np.uint16(7)]], [1.0, 2.0], [[1, 2], []], [2**40],
                     [[1, 2], "tok"], None, 5, "tok" * 80]))


@pytest.fixture(scope="module")
def request_models(gguf_source):
    """A target with a tokenizer, and drafts of every kind (a draft model, a random EAGLE-3 head)."""
    _, model, _, _ = gguf_source
    head_config = eagle3.Eagle3Config(vocab_size=model.config.vocab_size, dim=model.config.dim, num_heads=4,
                                      num_kv_heads=2, head_dim=8, ffn_dim=64, draft_vocab_size=16, rope_theta=10000.0,
                                      rotary_dim=8, norm_eps=1e-5, max_position_embeddings=128)
    head = Model(config=head_config, params=eagle3.init_params(head_config, jax.random.PRNGKey(0)))
    return model, {"none": None, "self": model, "head": head, "junk": "draft.gguf"}


@fuzz(300)
@given(prompt=PROMPTS, options=st.dictionaries(OPTION_NAMES, WEIRD, max_size=4),
       draft=st.sampled_from(["none", "self", "head", "junk"]))
def test_generate_arguments(request_models, prompt, options, draft):
    model, drafts = request_models
    options = dict(options)
    draft_params = options.pop("draft_params", drafts[draft])
    prepared = outcome("generate arguments", lambda: prepare(model, draft_params, prompt, **options))
    if prepared is not None:
        # What prepare accepts is what runs: rows of in-vocabulary ints, options normalised to the
        # Python types the compiled program is keyed on.
        assert all(isinstance(t, int) and 0 <= t < model.config.vocab_size for row in prepared.rows for t in row)
        hash(prepared.spec)
        for name in ("max_new_tokens", "seed"):
            assert type(getattr(prepared.options, name)) is int
        assert prepared.options.num_draft_tokens is None or type(prepared.options.num_draft_tokens) is int
        # And what prepare accepts traces: both programs, abstractly (no compile), so a request that
        # would only fail inside jit (a head given to method='draft') cannot pass as accepted.
        args = (model.params, prepared.speculation.draft_inputs(model))
        state = jax.eval_shape(lambda: loop.prefill_jit(*args, prepared.request, spec=prepared.spec))
        jax.eval_shape(lambda: loop.decode_jit(*args, state, prepared.request, spec=prepared.spec))


SAMPLING_VALUES = {"temperature": 0.7, "top_k": 3, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1}


@fuzz(15)
@given(name=st.sampled_from(sorted(SAMPLING_VALUES)), rows=st.integers(1, 3), length=st.integers(0, 4),
       nested_list=st.booleans())
def test_per_row_sampling_lists(request_models, name, rows, length, nested_list):
    """A per-row sampling option holds one value per prompt, or is refused before anything is
    traced, naming the option, the count given and the prompts."""
    model, _ = request_models
    values = [SAMPLING_VALUES[name]] * length
    value = [values] if nested_list else values
    prompts = [[3, 4, 5]] * rows
    if length == rows and not nested_list:
        prepared = prepare(model, None, prompts, **{name: value})
        args = (model.params, prepared.speculation.draft_inputs(model))
        jax.eval_shape(lambda: loop.prefill_jit(*args, prepared.request, spec=prepared.spec))
        return
    needle = (rf"{name} must be one number, or a flat sequence" if nested_list
              else rf"{name} has {length} per-row values for {rows} prompt")
    with pytest.raises(JaxspecError, match=needle):
        prepare(model, None, prompts, **{name: value})


@pytest.mark.parametrize("kind", ["eagle3", "mtp", "assistant"])
@pytest.mark.parametrize("call", ["generate", "stream", "score"])
def test_a_draft_head_passed_as_the_target_is_refused_by_name(tiny_model, kind, call):
    from conftest import random_drafts

    if kind == "assistant":
        from conftest import GEMMA_CONFIGS
        from jaxspec.models import assistant

        target = GEMMA_CONFIGS["gemma4-shared-per-layer"]
        text = dataclasses.replace(target, num_layers=2, layer_types=target.layer_types[:2], per_layer_dim=0,
                                   per_layer_vocab=0, num_kv_shared_layers=0, final_logit_softcap=None)
        config = assistant.AssistantConfig(text=text, backbone_dim=target.dim)
        head = Model(config=config, params=assistant.init_params(config, jax.random.PRNGKey(0)))
    else:
        head = random_drafts(kind)["draft_params"]
    name = {"eagle3": "an EAGLE-3 draft head", "mtp": "an MTP draft head", "assistant": "a shared-KV assistant draft"}
    run = {"generate": lambda: jaxspec.generate(head, None, [[3, 4]], max_new_tokens=2),
           "stream": lambda: list(jaxspec.stream(head, prompt=[3, 4], max_new_tokens=2)),
           "score": lambda: jaxspec.score(head, [[3, 4, 5]])}[call]
    with pytest.raises(JaxspecError, match=f"this is {name[kind]}.*pass it as draft_params beside its target"):
        run()


NAMES = st.one_of(
    st.text(max_size=20).filter(lambda t: t.strip().lower() not in KNOWN_NAMES),
    st.binary(max_size=8), st.integers(), st.none(), st.floats(), st.lists(st.text(max_size=3), max_size=2),
    st.sampled_from(["a" * 5000, "/dev/null", "/dev/zero", "/proc/self/mem", "/etc/passwd", "/etc", "/", "~",
                     "..", "x\x00y", "\udcff", "model.safetensors", "pytorch_model.bin", "/nonexistent/x.gguf",
                     pathlib.Path("/nonexistent"), pathlib.Path("/tmp")]))


@fuzz(200)
@given(name=NAMES, weight_format=st.one_of(st.just("auto"), WEIRD), use_cache=st.one_of(st.just(False), WEIRD))
def test_load_names_and_flags(name, weight_format, use_cache):
    """What jaxspec.load is handed in place of a model: none of it names one, so each is refused."""
    assert outcome("load names", lambda: jaxspec.load(name, weight_format=weight_format, use_cache=use_cache)) is None


# ---------------------------------------------------------------------------------------------
# CLI flags: every bad value is one stderr line and exit status 2, before a model loads
# ---------------------------------------------------------------------------------------------

FLAG_VALUES = st.one_of(st.sampled_from(["0", "-1", "1", "2.5", "nan", "inf", "-inf", "1e400", str(2**70), "abc", "",
                                         "q9", "q8_0,", ",", "3,4", "3,4,7", "0,0,0", "ngram", "eagle3",
                                         "draft", "1,2,3,4", "\udcff", "--", "-k"]),
                        st.text(max_size=5))
GENERATE_FLAGS = st.sampled_from(["--max-new-tokens", "--temperature", "--top-p", "--top-k", "--min-p",
                                  "--repetition-penalty", "--seed", "--method", "-k", "--tree", "--draft-sampling",
                                  "--kv-format", "--attention", "--exit-layer", "--weight-format", "--stop"])


@fuzz(150)
@given(flags=st.lists(st.tuples(GENERATE_FLAGS, FLAG_VALUES), min_size=1, max_size=3))
def test_cli_flags(capsys, monkeypatch, flags):
    # Only what is refused before the model loads is exercised here: a load would mean a run.
    def load(*args, **kwargs):
        raise _Loaded

    monkeypatch.setattr(cli.api, "load", load)
    argv = ["generate", "tok", "--model", "tiny.gguf"] + [part for flag in flags for part in flag]
    capsys.readouterr()
    try:
        with _alarm():
            code = cli.main(argv)
    except SystemExit as exit_:  # argparse: a usage error
        code = exit_.code
    except _Loaded:
        OUTCOMES["CLI flags", "reached load"] += 1
        return
    out, err = capsys.readouterr()
    assert code == cli.EXIT_BAD_INPUT, (argv, code, err)
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (argv, err)
    OUTCOMES["CLI flags", "exit 2"] += 1


class _Loaded(Exception):
    """Raised by the stand-in loader: the flags passed every check before the model load."""
