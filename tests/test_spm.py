"""A sentencepiece tokenizer.model as a `tokenizers` tokenizer (jaxspec.spm), against sentencepiece.

Tiny models are trained here (BPE and Unigram, byte fallback, a user-defined piece) and every
encode/decode is compared with sentencepiece's own on text that exercises the normalizer spec:
runs of spaces, leading and trailing spaces, accents, CJK, and characters the model never saw.
"""

from __future__ import annotations

import io
import pathlib

import pytest

from jaxspec import spm
from jaxspec.errors import CheckpointError, UnsupportedModelError
from jaxspec.tokenizer import Tokenizer


SPM_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target verifies them",
    "naïve café, ñandú; 日本語のテキスト",
    "numbers 12345 and   several   spaces",
    "hello world, hello there, world of tokens",
] * 40
SPM_TEXTS = ["the lazy fox", "  leading and trailing  ", "hello   world", "café ñ 日本", "unseen ZQX 😀 symbols",
             "tokens", ""]


def train(model_type: str, **options) -> bytes:
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_CORPUS), model_writer=model, model_type=model_type, minloglevel=2, **options)
    return model.getvalue()


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def spm_dir(request, tmp_path_factory) -> pathlib.Path:
    """A directory holding only a tiny sentencepiece model trained here (byte fallback on)."""
    directory = tmp_path_factory.mktemp(f"spm-{request.param}")
    (directory / "tokenizer.model").write_bytes(
        train(request.param, vocab_size=310, byte_fallback=True, character_coverage=0.98,
              user_defined_symbols=["<think>"]))
    return directory


def test_sentencepiece_model_encodes_and_decodes_like_sentencepiece(spm_dir):
    import sentencepiece

    reference = sentencepiece.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))
    tokenizer = Tokenizer.from_dir(spm_dir)
    assert tokenizer.vocab_size == reference.get_piece_size()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (reference.bos_id(), reference.eos_id())
    for text in [*SPM_TEXTS, "a <think> b"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == reference.decode(ids), text


def test_sentencepiece_model_loads_when_tokenizer_json_is_absent_only(spm_dir, tmp_path):
    assert Tokenizer.from_checkpoint_source(spm_dir) is not None
    (tmp_path / "tokenizer.model").write_bytes(b"not a protobuf")
    with pytest.raises(CheckpointError, match="not a sentencepiece model"):
        Tokenizer.from_dir(tmp_path)


def test_special_ids_come_from_the_trainer_spec(tmp_path):
    model = tmp_path / "tokenizer.model"
    model.write_bytes(train("bpe", vocab_size=100, pad_id=3, bos_id=-1, eos_id=1, unk_id=0))
    _, ids = spm.tokenizer_from_model_file(model)
    assert ids == spm.SpecialIds(bos=None, eos=1, pad=3, unk=0)


def test_models_it_cannot_rebuild_are_refused_by_name(tmp_path):
    model = tmp_path / "tokenizer.model"
    model.write_bytes(train("char"))
    with pytest.raises(UnsupportedModelError, match="model_type CHAR"):
        spm.tokenizer_from_model_file(model)
