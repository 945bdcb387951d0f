"""A sentencepiece `tokenizer.model` as an HF `tokenizers.Tokenizer`, for directories without tokenizer.json.

The model file is sentencepiece's protobuf (parsed with sentencepiece's own schema; nothing is
executed or unpickled). What it says is rebuilt with `tokenizers` parts, so one Rust tokenizer
serves every source (jaxspec.tokenizer):

  * the normalizer spec: the precompiled character map (NFKC-like rules baked into the file) and
    the removal of extra whitespace as normalizers; spaces written as "▁" (U+2581) and the dummy
    "▁" prefix as a Metaspace pre-tokenizer;
  * the model: BPE (merges recovered from the vocabulary: a piece is the merge of two shorter
    pieces, ranked by the merged piece's score, as transformers' converter does) or Unigram
    (pieces with their log-probabilities), with byte fallback when the model was trained with it;
  * control and unknown pieces as special tokens, user-defined pieces matched whole;
  * the decoder: "▁" back to spaces, `<0xNN>` byte pieces back to bytes, the dummy prefix removed.

Anything the file uses that this does not rebuild (WORD/CHAR models, whitespace as a suffix or
left unescaped)
raises UnsupportedModelError; a file that is not a sentencepiece model raises CheckpointError.
"""

from __future__ import annotations

import dataclasses
import os

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from jaxspec.errors import CheckpointError, UnsupportedModelError

SPACE = "\u2581"  # sentencepiece's visible space, "▁"


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """The ids the model file's trainer spec names (None where it disables one, id < 0)."""

    bos: int | None
    eos: int | None
    pad: int | None
    unk: int | None


def _proto(path: str):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        with open(path, "rb") as handle:
            proto.ParseFromString(handle.read())
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror}") from None
    except Exception as err:  # protobuf's DecodeError
        raise CheckpointError(f"{path} is not a sentencepiece model: {err}") from None
    if not proto.pieces:
        raise CheckpointError(f"{path} is not a sentencepiece model: it has no pieces")
    return proto


def bpe_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a mergeable piece into two pieces, best-scored merged piece first.

    sentencepiece (and llama.cpp's SPM tokenizer, for a GGUF's "llama" vocabulary) merge the
    adjacent pair whose concatenation is the best-scored piece; as BPE merges that is this list.
    `scores` holds the pieces that may be merged into; `vocab` every piece a half may be.
    """
    ranked = []
    for merged, score in scores.items():
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece_decoder(*, strip_prefix: bool) -> decoders.Decoder:
    """"▁" back to spaces, `<0xNN>` byte pieces back to bytes, and (`strip_prefix`) the dummy
    prefix's space removed from the start of the text."""
    return decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(content=" ", left=1, right=0)] if strip_prefix else []))


def tokenizer_from_model_file(path: str | os.PathLike[str]) -> tuple[tokenizers.Tokenizer, SpecialIds]:
    """The `tokenizers` equivalent of a sentencepiece model file, and its special ids."""
    path = os.fspath(path)
    proto = _proto(path)
    piece_type = type(proto.pieces[0]).Type
    trainer, spec = proto.trainer_spec, proto.normalizer_spec
    model_type = type(trainer).ModelType
    if trainer.treat_whitespace_as_suffix or not spec.escape_whitespaces:
        raise UnsupportedModelError(f"{path}: treat_whitespace_as_suffix, or spaces not escaped as '▁', is not supported")

    pieces = [(piece.piece, piece.score, piece.type) for piece in proto.pieces]
    unk_id = trainer.unk_id if trainer.unk_id >= 0 else None
    if trainer.model_type == model_type.BPE:
        vocab = {piece: index for index, (piece, _, _) in enumerate(pieces)}
        mergeable = {piece: score for piece, score, kind in pieces
                     if kind in (piece_type.NORMAL, piece_type.USER_DEFINED)}
        model = models.BPE(vocab=vocab, merges=bpe_merges(vocab, mergeable),
                           unk_token=None if unk_id is None else pieces[unk_id][0], fuse_unk=True,
                           byte_fallback=trainer.byte_fallback)
    elif trainer.model_type == model_type.UNIGRAM:
        model = models.Unigram([(piece, score) for piece, score, _ in pieces], unk_id=unk_id,
                               byte_fallback=trainer.byte_fallback)
    else:
        name = model_type.Name(trainer.model_type)
        raise UnsupportedModelError(f"{path}: sentencepiece model_type {name} is not supported (only BPE, UNIGRAM)")

    hf = tokenizers.Tokenizer(model)
    steps = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        # Runs of spaces become one and trailing ones go. With a dummy prefix a single leading
        # space is kept instead of stripped: it becomes that prefix's "▁" below, and stripping it
        # would move the text's start, which is how Metaspace tells the first piece.
        steps += [normalizers.Replace(tokenizers.Regex(" {2,}"), " "),
                  normalizers.Strip(left=not spec.add_dummy_prefix, right=True)]
    hf.normalizer = normalizers.Sequence(steps)
    # Spaces become "▁" and the dummy prefix goes before the text's first piece only, after
    # user-defined pieces are cut out (so "a <think> b" keeps the "▁" before and after "<think>").
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, split=False,
                                                prepend_scheme="first" if spec.add_dummy_prefix else "never")
    hf.decoder = sentencepiece_decoder(strip_prefix=spec.add_dummy_prefix)

    special = (piece_type.CONTROL, piece_type.UNKNOWN)
    hf.add_special_tokens([tokenizers.AddedToken(piece, special=True, normalized=False)
                           for piece, _, kind in pieces if kind in special])
    # User-defined pieces are matched whole in the normalized text, as sentencepiece matches them.
    hf.add_tokens([tokenizers.AddedToken(piece, normalized=True)
                   for piece, _, kind in pieces if kind == piece_type.USER_DEFINED])

    def named(index: int) -> int | None:
        return index if 0 <= index < len(pieces) else None

    return hf, SpecialIds(bos=named(trainer.bos_id), eos=named(trainer.eos_id), pad=named(trainer.pad_id),
                          unk=unk_id)
