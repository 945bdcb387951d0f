"""The head a run trains, built for its target: configs, initial params, the optimised part.

`eagle3_config_for` / `mtp_config_for` shape a head like one of the target's layers (bad aux
layers or a non-Llama MTP target raise before anything is traced); `init_head` draws its
initial params on the host, so a seed always gives the same head; `trainable_params` is the
part the optimizer updates. `HeadParams` and `Frozen` name the two halves a head step reads:
the head's own params, and the target's arrays passed beside them, never trained.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.api import Model
from jaxspec.config import ModelConfig
from jaxspec.errors import InvalidRequestError, UnsupportedModelError
from jaxspec.models import backends, eagle3, layers, mtp, quant
from jaxspec.train.config import Method
from jaxspec.train.data import DraftVocab

HeadParams = eagle3.Eagle3Params | mtp.MtpParams  # the trained head's own params
Frozen = dict[str, jax.Array]  # the target's arrays a head step reads beside them (embed, lm_head, vocab maps)


def eagle3_config_for(target_cfg, draft_vocab_size: int, aux_layer_ids: tuple[int, ...] | None = None
                      ) -> eagle3.Eagle3Config:
    """An EAGLE-3 head shaped like one of the target's layers. Aux layers default to the EAGLE
    repo's (2, L // 2, L - 3), or (0, L // 2, L - 1) for targets too shallow for those."""
    layers = target_cfg.num_layers
    if aux_layer_ids is None:
        aux_layer_ids = eagle3.default_aux_layers(layers)
        if not all(0 <= i < layers for i in aux_layer_ids):
            aux_layer_ids = (0, layers // 2, layers - 1)
    aux_layer_ids = tuple(int(i) for i in aux_layer_ids)
    if len(aux_layer_ids) != 3 or not all(0 <= i < layers for i in aux_layer_ids):
        raise InvalidRequestError(f"aux_layer_ids must be three layer indices in [0, {layers}); got {aux_layer_ids}")
    return eagle3.Eagle3Config(
        dim=target_cfg.dim, num_heads=target_cfg.num_heads, num_kv_heads=target_cfg.num_kv_heads,
        head_dim=target_cfg.head_dim, ffn_dim=target_cfg.ffn_dim, draft_vocab_size=draft_vocab_size,
        vocab_size=target_cfg.vocab_size, rope_theta=target_cfg.rope_theta, rotary_dim=target_cfg.rotary_dim,
        norm_eps=target_cfg.norm_eps, max_position_embeddings=target_cfg.max_position_embeddings,
        aux_layer_ids=aux_layer_ids,
    )


def mtp_config_for(target_cfg) -> mtp.MtpConfig:
    """An MTP head whose block is one layer of the (Llama-family) target's kind."""
    if not isinstance(target_cfg, ModelConfig):
        raise UnsupportedModelError(
            f"MTP training needs a Llama-family target (its block is a trunk layer); got {type(target_cfg).__name__}")
    return mtp.MtpConfig(block=dataclasses.replace(target_cfg, num_layers=1))


def init_head(method: Method, head_cfg, target: Model, vocab: DraftVocab, seed: int, scale: float = 0.02, *,
              mtp_block_from_last_layer: bool = False) -> HeadParams:
    """Initial head params: weights N(0, scale^2) (the lm_head included, as EAGLE-3's trainers
    start it: copying the target's rows makes a fresh head confidently wrong), norms one, and an
    EAGLE-3 head's d2t from the draft vocabulary. The embedding (and MTP's lm_head) stay the
    target's, frozen, passed beside these params. `mtp_block_from_last_layer`: an MTP head's
    block starts as a copy of the target's last layer (as DeepSeek-V3 and MiMo initialise their
    MTP modules): it already maps a late residual stream to the next token's, where a random
    block starts from nothing.

    Drawn with numpy on the host (shapes from the model module's own init, traced abstractly):
    jax.random here would cost a compile longer than a short training run.
    """
    rng = np.random.default_rng([seed, 0x4EAD])
    key = jax.random.PRNGKey(0)
    if method is Method.EAGLE3:
        shapes = eagle3.named_leaves(jax.eval_shape(lambda key: eagle3.init_params(head_cfg, key), key))
    else:
        shapes = mtp.named_leaves(jax.eval_shape(lambda key: mtp.init_params(head_cfg, key), key), head_cfg)

    def draw(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name.endswith("norm"):  # input_layernorm, hnorm, post_norm, block.q_norm, ...
            return np.ones(shape, np.float32)
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    # Drawn in sorted name order (d2t's draw included, then replaced), so a seed keeps its head.
    drawn = {name: draw(name, shapes[name].shape) for name in sorted(shapes)}
    if method is Method.EAGLE3:
        drawn["d2t"] = np.asarray(vocab.d2t, np.int32)
        params = eagle3.params_from(drawn.__getitem__)
    else:
        params = mtp.params_from(head_cfg, drawn.__getitem__)
        if mtp_block_from_last_layer:
            last = layers.unfuse_projections(backends.standard(target.params.layers[-1]))
            last = quant.map_linear(last, lambda w: None if w is None else quant.dequantize(w))  # int8 -> float32
            params = dataclasses.replace(params, block=jax.tree.map(lambda x: np.asarray(x, np.float32), last))
    return jax.tree.map(jnp.asarray, params)


def start_vocab(head: Model) -> np.ndarray:
    """int64[Vd]: the target token of each draft id of an EAGLE-3 head (its d2t added to its draft
    ids), the vocabulary `TrainConfig.keep_init_vocab` keeps and `start_from` carries rows by."""
    if not isinstance(head.config, eagle3.Eagle3Config):
        raise InvalidRequestError(f"keep_init_vocab: {head.source} is a {type(head.config).__name__} head, "
                                  "with no draft vocabulary to keep (it needs an EAGLE-3 head)")
    d2t = np.asarray(head.params.d2t, np.int64)
    return np.arange(len(d2t)) + d2t


def start_from(method: Method, head_cfg, fresh: HeadParams, vocab: DraftVocab, source: Model) -> tuple[HeadParams, int]:
    """The run's initial params taken from an existing head (`source`, as `jaxspec.load` gives
    it), and how many of the draft vocabulary's lm_head rows it supplied.

    The head must have the run's config: an MTP head exactly; an EAGLE-3 head all but its draft
    vocabulary, which may differ (a larger corpus ranks its tokens differently). Its lm_head rows
    then carry over by the target token they draft; a token new to the vocabulary keeps its row
    of `fresh`, as a new run would start it. Anything else raises InvalidRequestError naming the
    difference, before any step is traced."""
    kind = {Method.EAGLE3: eagle3.Eagle3Config, Method.MTP: mtp.MtpConfig}[method]
    if not isinstance(source.config, kind):
        raise InvalidRequestError(f"init_from {source.source}: a {type(source.config).__name__} head cannot start "
                                  f"an {method.value} run (it needs a {kind.__name__} head)")
    theirs = source.config
    if method is Method.EAGLE3:
        theirs = dataclasses.replace(theirs, draft_vocab_size=head_cfg.draft_vocab_size)
    if theirs != head_cfg:
        ours, other = dataclasses.asdict(head_cfg), dataclasses.asdict(theirs)
        differ = [f"{name} {other[name]} (the run: {ours[name]})" for name in ours if ours[name] != other[name]]
        raise InvalidRequestError(f"init_from {source.source} does not fit this run's head: {'; '.join(differ)}")
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) if x.dtype.kind == "f" else x,
                          layers.unfuse_projections(source.params))
    if method is Method.MTP:
        return params, head_cfg.block.vocab_size
    their_ids = start_vocab(source)  # each row's target token
    row_of = np.full(head_cfg.vocab_size, -1, np.int64)
    row_of[their_ids] = np.arange(len(their_ids))
    rows = row_of[vocab.target_ids]  # [Vd]: the source's row for each of the run's draft tokens, -1 none
    carried = rows >= 0
    lm_head = np.where(carried[:, None], np.asarray(params.lm_head)[np.maximum(rows, 0)], np.asarray(fresh.lm_head))
    params = dataclasses.replace(params, lm_head=jnp.asarray(lm_head, jnp.float32), d2t=fresh.d2t)
    return params, int(carried.sum())


def trainable_params(params: HeadParams) -> HeadParams:
    """The optimised params: all but the EAGLE-3 d2t table (integer, fixed by the data), which
    is None in the trainable copy (the head's forward never reads it)."""
    return dataclasses.replace(params, d2t=None) if isinstance(params, eagle3.Eagle3Params) else params
