"""jaxspec: exact, fast speculative decoding of language models in JAX.

    model = jaxspec.load()                      # SmolLM2-135M-Instruct, the default
    # jaxspec.load(weight_format="int8")        # int8 weights: W8A8 products on CPU
    result = jaxspec.generate(model, prompt="Tell me a joke", max_new_tokens=64)  # chat template: the model's
    print(result.text[0], result.stats.decode_tokens_per_second)

Every type an option or `load` takes, and every error raised for bad input, is named here.
"""

from jaxspec.api import (DEFAULT_MODEL, GenerateResult, Model, SpecStats, Stream, TokenLogprob, generate, layer_skip,
                         load, load_mtp, prepare, stream)
from jaxspec.cache import KVFormat
from jaxspec.compilation import set_compile_notices
from jaxspec.config import Architecture, ModelConfig
from jaxspec.errors import CheckpointError, InvalidRequestError, JaxspecError, UnsupportedModelError
from jaxspec.grammar import GrammarError
from jaxspec.model import convert_weights, shard
from jaxspec.models.backends import Products
from jaxspec.models.quant import WeightFormat
from jaxspec.options import GenerateOptions
from jaxspec.pallas.flash_decode import Attention
from jaxspec.score import ScoreResult, score
from jaxspec.sharding import ShardingError, make_mesh
from jaxspec.spec.methods import Method
from jaxspec.spec.tree import DraftTree

__all__ = [
    "DEFAULT_MODEL", "Architecture", "Attention", "CheckpointError", "DraftTree", "GenerateOptions", "GenerateResult",
    "GrammarError", "InvalidRequestError", "JaxspecError", "KVFormat", "Method", "Model", "ModelConfig", "Products",
    "ScoreResult", "ShardingError", "SpecStats", "Stream", "TokenLogprob", "UnsupportedModelError", "WeightFormat",
    "convert_weights", "generate", "layer_skip", "load", "load_mtp", "make_mesh", "prepare", "score",
    "set_compile_notices", "shard", "stream",
]
