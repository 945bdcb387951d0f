"""Text <-> token ids for the models jaxspec serves, from an HF directory or a GGUF's metadata.

Sources: an HF directory's `tokenizer.json`, or only its sentencepiece `tokenizer.model`
(rebuilt by jaxspec.spm); a GGUF's `tokenizer.*` metadata (rebuilt by jaxspec.gguf_tokenizer the
way llama.cpp splits text). A checkpoint with no tokenizer at all loads with none
(`Tokenizer.from_checkpoint_source` -> None) and serves token-id prompts.

All sources end in one HF `tokenizers.Tokenizer` (Rust, fast) wrapped by `Tokenizer`, which owns
what the Rust object does not know: whether to prepend BOS, which ids end a turn, the chat template.
Our `encode` never runs a `tokenizer.json` post-processor; BOS/EOS are added from explicit flags so
that the HF and GGUF paths cannot disagree about them.

Decoding never applies HF's `clean_up_tokenization_spaces`: it rewrites " ." to "." and so would
break both `decode(encode(s)) == s` and streaming (`StreamDecoder`), which must add up to `decode`.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from jaxspec import gguf_tokenizer, spm
from jaxspec.errors import CheckpointError, InvalidRequestError, JaxspecError, UnsupportedModelError

logger = logging.getLogger(__name__)

__all__ = ["StreamDecoder", "Tokenizer"]

# Files that make a directory's tokenizer, in the order from_dir prefers them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


# Tokens that end an assistant turn in common chat templates. One of them counts as an end token
# only if the model's template writes it, so a base model's `<|endoftext|>` does not cut a chat short.
_END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<|end|>",
)


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict[str, Any]:
    """A tokenizer side file (tokenizer_config.json, generation_config.json): a JSON object in
    UTF-8, else a CheckpointError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    except RecursionError:  # json recurses per nesting level
        raise CheckpointError(f"cannot read {path}: its JSON is nested too deeply") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object")
    try:  # JSON's \ud800 escapes parse to lone surrogates, which no tokenizer can look up
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise CheckpointError(f"{path} holds {e.object[e.start:e.end]!r}, a lone surrogate that is not text") from None
    return value


def _field(path: str, config: Mapping[str, Any], name: str, ok, expected: str) -> Any:
    """config[name] if absent (None) or of the expected kind; else a CheckpointError naming the
    file, the field and what it must be."""
    value = config.get(name)
    if value is not None and not ok(value):
        raise CheckpointError(f"{path}: {name} is {value!r:.60}; expected {expected}")
    return value


def _is_token(value: Any) -> bool:  # "<s>", or an AddedToken dict {"content": "<s>", ...}
    return isinstance(value, str) or (isinstance(value, Mapping) and isinstance(value.get("content"), str))


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_chat_template(value: Any) -> bool:  # a template, or [{"name": ..., "template": ...}]
    return isinstance(value, str) or (isinstance(value, list) and all(
        isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        for t in value))


def _rust_call(what: str, call):
    """A call into the tokenizers library: its errors (a bare Exception, or a pyo3 PanicException,
    which derives from BaseException) become a CheckpointError naming `what`."""
    try:
        return call()
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 (PanicException is not an Exception)
        raise CheckpointError(f"{what}: {type(e).__name__}: {e}") from None


class Tokenizer:
    """A model's tokenizer: `encode`, `encode_chat`, `decode`, `stream_decoder`.

    Build it with `from_dir` (an HF checkpoint) or `from_gguf_metadata`; the constructor takes an
    already configured HF `tokenizers.Tokenizer` plus what the model's files say around it.
    """

    def __init__(
        self,
        hf_tokenizer: tokenizers.Tokenizer,
        *,
        vocab_size: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
    ):
        self._hf = hf_tokenizer
        self._vocab_size = (
            vocab_size
            if vocab_size is not None
            else hf_tokenizer.get_vocab_size(with_added_tokens=True)
        )
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._pad_token_id = pad_token_id
        self._unk_token_id = unk_token_id
        self._add_bos = add_bos and bos_token_id is not None
        self._add_eos = add_eos and eos_token_id is not None
        self._chat_template = chat_template
        for name, token_id in (("bos", bos_token_id), ("eos", eos_token_id), ("pad", pad_token_id)):
            if token_id is not None and not 0 <= token_id < self._vocab_size:
                raise CheckpointError(
                    f"{name}_token_id={token_id} is outside the vocabulary ({self._vocab_size})"
                )

        eos_ids = [] if eos_token_id is None else [eos_token_id]
        eos_ids += [i for i in extra_eos_token_ids if 0 <= i < self._vocab_size]
        for token in _END_OF_TURN_TOKENS:
            token_id = hf_tokenizer.token_to_id(token)
            if token_id is not None and chat_template is not None and token in chat_template:
                eos_ids.append(token_id)
        self._eos_token_ids = tuple(dict.fromkeys(eos_ids))  # ordered, unique

    # --- construction ----------------------------------------------------------------------------

    @classmethod
    def from_checkpoint_source(cls, source: str | os.PathLike[str] | Mapping[str, Any],
                               origin: str | os.PathLike[str] | None = None) -> Tokenizer | None:
        """The tokenizer a checkpoint carries: a directory's files (`from_dir`) or a GGUF's
        `tokenizer.*` metadata (`from_gguf_metadata`); None when it carries none at all. An error
        names `origin` (the checkpoint's file or directory) when its message does not already."""
        try:
            if isinstance(source, Mapping):
                if "tokenizer.ggml.model" in source:
                    return cls.from_gguf_metadata(source)
                # A vocabulary without its model is half a tokenizer: a corrupt file, not a model
                # without one (special ids alone are the config's, and name no tokenizer).
                carried = [f"tokenizer.ggml.{key}" for key in ("tokens", "merges", "scores", "token_type", "pre")
                           if f"tokenizer.ggml.{key}" in source]
                if carried:
                    raise CheckpointError(f"the GGUF carries tokenizer metadata ({', '.join(carried[:3])}"
                                          f"{', ...' if len(carried) > 3 else ''}) but no tokenizer.ggml.model")
                return None
            # A tokenizer file that exists but is no file (a directory, a dangling link) is corrupt.
            if not any(os.path.lexists(os.path.join(source, name)) for name in TOKENIZER_FILES):
                return None
            return cls.from_dir(source)
        except JaxspecError as e:
            if origin is None or os.fspath(origin) in str(e):
                raise
            raise type(e)(f"{os.fspath(origin)}: {e}") from None

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF describes, from its metadata (keys exactly as in the file).

        `tokenizer.ggml.model` "gpt2" (byte-level BPE: the split regexes are llama.cpp's for
        `tokenizer.ggml.pre`) or "llama" (sentencepiece BPE: merges recovered from the scores,
        `tokenizer.ggml.add_space_prefix`); llama.cpp's reading is the ground truth for what a GGUF
        means, defaults included. Without `tokenizer.ggml.eot_token_id`, the tokens llama.cpp takes
        for end of turn by their text (`gguf_tokenizer.end_of_turn_ids`) end generation too, where
        the chat template writes them.
        """
        model = metadata.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise UnsupportedModelError(
                f"tokenizer.ggml.model={model!r} is not supported; only byte-level BPE ('gpt2') and "
                "sentencepiece BPE ('llama') are"
            )
        if "tokenizer.ggml.tokens" not in metadata:
            raise CheckpointError(f"GGUF metadata lacks tokenizer.ggml.tokens, needed for a {model} tokenizer")
        for key in ("tokens", "merges", "token_type", "scores"):
            value = metadata.get(f"tokenizer.ggml.{key}", [])
            if not isinstance(value, list):  # a string would be taken as a list of its characters
                raise CheckpointError(f"GGUF metadata tokenizer.ggml.{key} is a {type(value).__name__}, not an array")
        tokens = metadata["tokenizer.ggml.tokens"]
        if not all(isinstance(token, str) for token in tokens):
            raise CheckpointError("tokenizer.ggml.tokens holds a value that is not a string")
        token_types = metadata.get("tokenizer.ggml.token_type", [gguf_tokenizer.TokenType.NORMAL] * len(tokens))
        if len(token_types) != len(tokens):
            raise CheckpointError(
                f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_types):
            raise CheckpointError("tokenizer.ggml.token_type holds a value that is not an integer")
        for key, kind in (("tokenizer.ggml.add_bos_token", bool), ("tokenizer.ggml.add_eos_token", bool),
                          ("tokenizer.ggml.add_space_prefix", bool), ("tokenizer.chat_template", str)):
            value = metadata.get(key)
            if value is not None and not isinstance(value, kind):
                raise CheckpointError(f"GGUF metadata {key} is {value!r:.60}, not a {kind.__name__}")

        def token_id(key: str, default: int | None = None) -> int | None:
            value = metadata.get(f"tokenizer.ggml.{key}")
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, int):
                raise CheckpointError(f"tokenizer.ggml.{key}={value!r} is not a token id")
            return value

        if model == "gpt2":
            (hf, add_bos), defaults = cls._gguf_byte_level_bpe(metadata, tokens, token_types), {}
        else:
            # llama.cpp's SPM defaults where the file names no id (`llama_vocab::impl::load`).
            defaults = {key: i for key, i in (("bos", 1), ("eos", 2), ("unknown", 0)) if i < len(tokens)}
            hf = cls._gguf_sentencepiece_bpe(metadata, tokens, token_types,
                                             token_id("unknown_token_id", defaults.get("unknown")))
            add_bos = True  # llama.cpp's default for an SPM vocabulary
        _rust_call(f"the GGUF's {model} tokenizer cannot encode text", lambda: hf.encode("Hello, world! 123"))
        chat_template = metadata.get("tokenizer.chat_template")
        if chat_template is not None:
            _compile_chat_template(chat_template)
        extra_eos = [i for i in [token_id("eot_token_id"), token_id("eom_token_id")] if i is not None]
        if token_id("eot_token_id") is None and chat_template is not None:
            # llama.cpp ends generation at every one of these; here, as for every source, only at
            # those the template writes (SmolLM2 ends turns with <|im_end|>, and its <|endoftext|>
            # does not stop a chat, as in transformers).
            extra_eos += [i for i in gguf_tokenizer.end_of_turn_ids(tokens, token_types) if tokens[i] in chat_template]
        return cls(
            hf,
            vocab_size=len(tokens),
            bos_token_id=token_id("bos_token_id", defaults.get("bos")),
            eos_token_id=token_id("eos_token_id", defaults.get("eos")),
            extra_eos_token_ids=extra_eos,
            pad_token_id=token_id("padding_token_id"),
            unk_token_id=token_id("unknown_token_id", defaults.get("unknown")),
            add_bos=metadata.get("tokenizer.ggml.add_bos_token", add_bos),
            add_eos=metadata.get("tokenizer.ggml.add_eos_token", False),
            chat_template=chat_template,
        )

    @staticmethod
    def _gguf_pre(metadata: Mapping[str, Any]) -> str:
        """`tokenizer.ggml.pre`, checked against the pre-tokenizers jaxspec knows."""
        pre = metadata.get("tokenizer.ggml.pre")
        if pre is None:
            # llama.cpp does the same, and warns that quality degrades.
            logger.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer")
            pre = "default"
        if not isinstance(pre, str) or pre not in gguf_tokenizer.PRE_TOKENIZERS:
            raise UnsupportedModelError(
                f"tokenizer.ggml.pre={pre!r} is not a supported pre-tokenizer; supported: "
                f"{', '.join(sorted(gguf_tokenizer.PRE_TOKENIZERS))}"
            )
        return pre

    @classmethod
    def _gguf_byte_level_bpe(cls, metadata: Mapping[str, Any], tokens: list[str],
                             token_types: list[int]) -> tuple[tokenizers.Tokenizer, bool]:
        """A "gpt2" GGUF vocabulary's tokenizer, its merges checked, and whether llama.cpp adds BOS
        for its pre-tokenizer when the file does not say."""
        spec = gguf_tokenizer.PRE_TOKENIZERS[cls._gguf_pre(metadata)]
        if "tokenizer.ggml.merges" not in metadata:
            raise CheckpointError("GGUF metadata lacks tokenizer.ggml.merges, needed for a BPE tokenizer")
        merges = metadata["tokenizer.ggml.merges"]
        for index, merge in enumerate(merges):
            if not isinstance(merge, str) or len(merge.split(" ")) != 2:
                raise CheckpointError(
                    f"tokenizer.ggml.merges[{index}]={merge!r} is not two tokens separated by one space")
        hf = _rust_call("GGUF tokenizer metadata does not make a BPE tokenizer",
                        lambda: gguf_tokenizer.byte_level_bpe(tokens, merges, token_types, spec))
        return hf, spec.add_bos

    @staticmethod
    def _gguf_sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str], token_types: list[int],
                                unk_token_id: int | None) -> tokenizers.Tokenizer:
        """A "llama" (SPM) GGUF vocabulary's tokenizer, its scores checked. llama.cpp reads neither
        `tokenizer.ggml.pre` nor `tokenizer.ggml.merges` for one, and neither does this."""
        if "tokenizer.ggml.scores" not in metadata:
            # llama.cpp scores every token 0 then, and merges leftmost first: an order BPE merges
            # (one rank each) cannot express.
            raise UnsupportedModelError(
                "tokenizer.ggml.model='llama' without tokenizer.ggml.scores is not supported: the "
                "scores rank the merges"
            )
        scores = metadata["tokenizer.ggml.scores"]
        if len(scores) != len(tokens):
            raise CheckpointError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
        for index, score in enumerate(scores):
            if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
                raise CheckpointError(f"tokenizer.ggml.scores[{index}]={score!r:.60} is not a finite number")
        add_space_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)  # llama.cpp's default
        return _rust_call(
            "GGUF tokenizer metadata does not make a sentencepiece BPE tokenizer",
            lambda: gguf_tokenizer.sentencepiece_bpe(tokens, scores, token_types, add_space_prefix=add_space_prefix,
                                                     unk_token_id=unk_token_id))

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer of an HF checkpoint directory.

        Reads tokenizer.json, else a sentencepiece tokenizer.model (one is required; the model
        file's own bos/eos/pad/unk ids serve where the config names none), tokenizer_config.json
        (special tokens, add_bos_token, chat_template), chat_template.jinja (newer transformers
        save the template there) and generation_config.json (its eos_token_id, often a list, all
        end generation).
        """
        path = os.fspath(path)
        tokenizer_json = os.path.join(path, "tokenizer.json")
        sentencepiece_model = os.path.join(path, "tokenizer.model")
        model_ids = spm.SpecialIds(bos=None, eos=None, pad=None, unk=None)
        if os.path.lexists(tokenizer_json):  # a directory or a dangling link fails to load, by name
            hf = _rust_call(f"cannot load {tokenizer_json}", lambda: tokenizers.Tokenizer.from_file(tokenizer_json))
            # A file that parses can still fail on first use (a merge of tokens the vocabulary
            # lacks panics in the BPE model): try it now, so the failure names the file at load.
            _rust_call(f"{tokenizer_json} cannot encode text",
                       lambda: hf.encode("Hello, world! 123", add_special_tokens=True))
        elif os.path.lexists(sentencepiece_model):
            hf, model_ids = spm.tokenizer_from_model_file(sentencepiece_model)
        else:
            raise CheckpointError(f"{path} has no tokenizer.json or tokenizer.model")

        config_path = os.path.join(path, "tokenizer_config.json")
        config = _read_json(config_path) if os.path.isfile(config_path) else {}
        generation_path = os.path.join(path, "generation_config.json")
        generation = _read_json(generation_path) if os.path.isfile(generation_path) else {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            _field(config_path, config, name, _is_token, 'a token string or {"content": "..."}')
        for name in ("add_bos_token", "add_eos_token"):
            _field(config_path, config, name, lambda v: isinstance(v, bool), "true or false")
        _field(config_path, config, "chat_template", _is_chat_template,
               'a template string or a list of {"name", "template"}')
        for name in ("bos_token_id", "pad_token_id"):
            _field(generation_path, generation, name, _is_token_id, "a token id (an integer >= 0)")
        _field(generation_path, generation, "eos_token_id",
               lambda v: _is_token_id(v) or (isinstance(v, list) and all(map(_is_token_id, v))),
               "a token id or a list of token ids")

        def special_id(name: str) -> int | None:  # the config's token, else the model file's id
            content = _token_content(config.get(f"{name}_token"))
            return getattr(model_ids, name) if content is None else hf.token_to_id(content)

        bos_id, eos_id = special_id("bos"), special_id("eos")
        if bos_id is None and generation.get("bos_token_id") is not None:
            bos_id = generation["bos_token_id"]
        generation_eos = generation.get("eos_token_id")  # null: none given (the config's or tokenizer's serve)
        generation_eos = ([] if generation_eos is None else [generation_eos] if isinstance(generation_eos, int)
                          else list(generation_eos))
        if eos_id is None and generation_eos:
            eos_id = generation_eos[0]

        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # [{"name": ..., "template": ...}], as HF saves several
            chat_template = {t["name"]: t["template"] for t in chat_template}.get("default")
        template_file = config_path
        jinja_path = os.path.join(path, "chat_template.jinja")
        if chat_template is None and os.path.isfile(jinja_path):
            template_file = jinja_path
            try:
                with open(jinja_path, encoding="utf-8") as f:
                    chat_template = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise CheckpointError(f"cannot read {jinja_path}: {e}") from None
        if chat_template is not None:  # a template that does not compile is refused at load
            try:
                _compile_chat_template(chat_template)
            except CheckpointError as e:
                raise CheckpointError(f"{template_file}: {e}") from None

        try:  # the ids the files name are checked against the vocabulary there
            return cls(
                hf,
                bos_token_id=bos_id,
                eos_token_id=eos_id,
                extra_eos_token_ids=generation_eos,
                pad_token_id=special_id("pad"),
                unk_token_id=special_id("unk"),
                add_bos=_adds_token(hf, config.get("add_bos_token"), bos_id, first=True),
                add_eos=_adds_token(hf, config.get("add_eos_token"), eos_id, first=False),
                chat_template=chat_template,
            )
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write tokenizer.json + tokenizer_config.json, so that `from_dir(path)` gives this back."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self._hf.save(os.path.join(path, "tokenizer.json"))

        def content(token_id: int | None) -> str | None:
            return None if token_id is None else self._hf.id_to_token(token_id)

        config = {
            "bos_token": content(self._bos_token_id),
            "eos_token": content(self._eos_token_id),
            "pad_token": content(self._pad_token_id),
            "unk_token": content(self._unk_token_id),
            "add_bos_token": self._add_bos,
            "add_eos_token": self._add_eos,
            "clean_up_tokenization_spaces": False,
            "chat_template": self._chat_template,
        }
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(
                {k: v for k, v in config.items() if v is not None}, f, ensure_ascii=False, indent=2
            )
        if extra := [i for i in self._eos_token_ids if i != self._eos_token_id]:
            with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
                json.dump({"eos_token_id": [self._eos_token_id, *extra]}, f)

    # --- properties ------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids (V), added tokens included; every id in [0, V) decodes."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The model's one declared EOS; see `eos_token_ids` for everything that ends generation."""
        return self._eos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: EOS, end-of-turn tokens the chat template writes, and
        generation_config's list. A chat model often stops with `<|im_end|>`/`<|eot_id|>`, not EOS."""
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int:
        """The id padded positions hold; EOS when the model names none (padding is masked anyway)."""
        if self._pad_token_id is not None:
            return self._pad_token_id
        if self._eos_token_id is not None:
            return self._eos_token_id
        return 0

    @property
    def add_bos(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` prepends BOS."""
        return self._add_bos

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        """The wrapped Rust tokenizer (its post-processor is never used by `encode`)."""
        return self._hf

    # --- encode / decode -------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token text such as "<|im_start|>" becomes its single id.

        With `add_special_tokens`, BOS (and EOS) are added only where the model asks for them
        (`add_bos_token`); SmolLM2 asks for neither.
        """
        if not isinstance(text, str):
            raise InvalidRequestError(f"text must be a str, got {type(text).__name__}")
        ids = _rust_call("the tokenizer failed on this text", lambda: self._hf.encode(text, add_special_tokens=False)).ids
        if add_special_tokens:
            if self._add_bos:
                ids = [self._bos_token_id, *ids]
            if self._add_eos:
                ids = [*ids, self._eos_token_id]
        return ids

    def render_chat(
        self,
        messages: str | Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text the model's chat template makes of `messages`, as transformers renders it.

        `messages` is a user turn's text or a list of {"role", "content"} dicts. `template_kwargs`
        are extra template variables (e.g. `enable_thinking` for Qwen3).
        """
        if self._chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template; encode a raw prompt with encode()"
            )
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        messages = list(messages)
        if not messages:
            raise InvalidRequestError("a chat needs at least one message")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                raise InvalidRequestError(f"message {i} must be a mapping with 'role' and 'content'")

        def content(token_id: int | None) -> str | None:
            return None if token_id is None else self._hf.id_to_token(token_id)

        variables = {
            "bos_token": content(self._bos_token_id),
            "eos_token": content(self._eos_token_id),
            "pad_token": content(self._pad_token_id),
            "unk_token": content(self._unk_token_id),
            **(template_kwargs or {}),
        }
        try:
            return _compile_chat_template(self._chat_template).render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **{k: v for k, v in variables.items() if v is not None},
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template rejected the conversation: {e}") from e
        except Exception as e:  # a template's own bug (1/0, a filter on the wrong type) is not the caller's
            raise CheckpointError(f"chat template failed while rendering: {type(e).__name__}: {e}") from None

    def encode_chat(
        self,
        messages: str | Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the chat prompt; equal to transformers'
        `apply_chat_template(messages, tokenize=True, add_generation_prompt=...)`.

        No BOS is added: the template writes every special token the model wants, as in HF.
        """
        text = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Control tokens (`<|im_end|>`, ...) are dropped when `skip_special_tokens`.

        Raises InvalidRequestError naming the first id outside [0, vocab_size); HF would silently
        drop it, which would hide a sampling bug.
        """
        return self._hf.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, *, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh incremental detokenizer for one generated sequence."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        checked = [int(i) for i in ids]
        for token_id in checked:
            if not 0 <= token_id < self._vocab_size:
                raise InvalidRequestError(
                    f"token id {token_id} is out of range for vocab_size={self._vocab_size}"
                )
        return checked

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self._vocab_size}, bos={self._bos_token_id}, "
            f"eos={self._eos_token_ids}, add_bos={self._add_bos})"
        )


def _adds_token(
    hf: tokenizers.Tokenizer, configured: Any, token_id: int | None, *, first: bool
) -> bool:
    """Whether an HF directory's tokenizer adds BOS (`first`) or EOS around a text.

    tokenizer_config.json's flag wins; without one, what tokenizer.json's post-processor does
    (Llama 3 adds `<|begin_of_text|>` only there).
    """
    if token_id is None:
        return False
    if isinstance(configured, bool):
        return configured
    with_special = hf.encode("a", add_special_tokens=True).ids
    without = hf.encode("a", add_special_tokens=False).ids
    if len(with_special) == len(without):
        return False
    return (with_special[0] if first else with_special[-1]) == token_id


@functools.lru_cache(maxsize=8)
def _compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses, so output matches it byte for byte.

    Sandboxed because templates come with downloaded checkpoints; `trim_blocks`/`lstrip_blocks`
    and the `tojson`/`raise_exception`/`strftime_now` helpers are what templates are written for.
    """

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson HTML-escapes, which would change the prompt.
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"chat template does not compile: {e}") from e


class StreamDecoder:
    """Incremental detokenization: feed committed ids, get back the text that is now final.

    The pieces returned by `feed` and then `flush` concatenate to exactly `decode(all ids)`. Text is
    held back while its decoded tail ends in U+FFFD (a UTF-8 character split across tokens), so a
    half character is never emitted. Each step decodes a small window starting a little before the
    new ids rather than everything so far, so a long generation costs O(1) per token; the window's
    earlier part gives decoders that look at neighbours (SentencePiece's leading-space strip) the
    same context as a full decode.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []  # ids from the window start on; earlier ones are dropped
        self._prefix_offset = 0  # window start: text before it was emitted at a clean boundary
        self._read_offset = 0  # ids[:read_offset] are emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer._hf.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def feed(self, token_ids: int | Iterable[int]) -> str:
        """Append committed ids; return the newly final text ("" while a character is incomplete)."""
        new_ids = [token_ids] if isinstance(token_ids, int) else token_ids
        self._ids.extend(self._tokenizer._check_ids(new_ids))
        emitted = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(emitted) or text.endswith("\ufffd"):
            return ""
        # The window moves to the end of what was just emitted; earlier ids are no longer needed.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return text[len(emitted) :]

    def flush(self) -> str:
        """The text still held back (a trailing incomplete character decodes to U+FFFD); call once,
        at the end of the sequence."""
        emitted = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        del self._ids[:]
        self._prefix_offset = self._read_offset = 0
        return text[len(emitted) :]
