"""Checkpoints: GGUF files, HF safetensors directories, jaxspec's converted directories, draft heads.

    resolve       names -> paths (the default model, packaged heads, directory kinds)
    gguf          the GGUF parser; a family's config and params from a GGUF file
    safetensors   safetensors reading, HF weight files and HF directories
    assemble      `Checkpoint`, and a family's params assembled from named tensors
    store         the orbax weight cache (one entry per file and weight format), converted directories
    load          the entry points: load_checkpoint, info, convert
    heads         EAGLE-3 heads and the two MTP head formats

Which tensors a model has and how they are named is never decided here: each trunk family
describes that (jaxspec.models.family), and every reader follows the description. Nothing here
unpickles: `.bin` checkpoints are refused.
"""

from jaxspec.checkpoints.assemble import Checkpoint
from jaxspec.checkpoints.gguf import GGUFFile, GGUFTensorInfo, config_from_gguf, read_gguf
from jaxspec.checkpoints.heads import (
    has_mtp,
    is_assistant_dir,
    is_eagle3_dir,
    is_mtp_head_dir,
    load_assistant,
    load_eagle3,
    load_mtp,
    load_mtp_head,
    save_eagle3,
    save_mtp_head,
)
from jaxspec.checkpoints.load import convert, info, load_checkpoint
from jaxspec.checkpoints.resolve import (
    DEFAULT_MODEL,
    INSTALL_DEFAULT_MODEL,
    JAXSPEC_META,
    MTP_HEAD_META,
    PACKAGED_HEADS,
    default_model_path,
    packaged_head_path,
    resolve_model,
)
from jaxspec.checkpoints.safetensors import hf_weight_files
from jaxspec.checkpoints.store import cache_dir, file_sha256

__all__ = [
    "DEFAULT_MODEL", "INSTALL_DEFAULT_MODEL", "JAXSPEC_META", "MTP_HEAD_META", "PACKAGED_HEADS",
    "Checkpoint", "GGUFFile", "GGUFTensorInfo", "cache_dir", "config_from_gguf", "convert",
    "default_model_path", "file_sha256", "has_mtp", "hf_weight_files", "info", "is_assistant_dir", "is_eagle3_dir",
    "is_mtp_head_dir", "load_checkpoint", "load_assistant", "load_eagle3", "load_mtp", "load_mtp_head", "packaged_head_path",
    "read_gguf", "resolve_model", "save_eagle3", "save_mtp_head",
]
