"""Multi-token prediction in the MindSpore GPT (--mtp-num-layers): Megatron-Core 0.16's
MultiTokenPredictionBlock at PP 1, with its parameter names (mtp.layers.k.*).

MTP layer k takes the tokens and the positions rolled k+1 places left (the last ones zero, as
Megatron-Core's roll_tensor), embeds them with the model's embedding, normalizes the embedding
(enorm) and the previous hidden states (hnorm: the decoder's final-normed output, then each MTP
layer's), joins the two along the hidden dim ([embedding, hidden]) into eh_proj, runs one transformer
layer (the decoder's kind, RoPE at the unrolled positions) and its final_layernorm; the shared output
layer gives logits whose cross-entropy against the labels rolled k+1 places, masked by the loss mask
rolled alike, is averaged over the kept tokens. Their mean over the layers, times
--mtp-loss-scaling-factor, enters the gradient only (Megatron-Core's MTPLossAutoScaler): the loss
reported stays the language model's."""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import ops

from mindspeed.checkpoint import neutral as nf
from mindspeed.training.mindspore.layers import column_parallel


def layer_prefix(k: int) -> str:
    return f"mtp.layers.{k}."


def layer_param_name(num_layers: int, i: int, suffix: str) -> str:
    """Transformer layer i's parameter `suffix`: a decoder layer's, or past the decoder (i >= num_layers)
    MTP layer i - num_layers's own (mtp.layers.k.transformer_layer.*)."""
    if i < num_layers:
        return nf.layer_name(i, suffix)
    return f"{layer_prefix(i - num_layers)}transformer_layer.{suffix}"


def rolled(x):
    """x [b, s] one place left along s, the last column zero (roll_tensor at CP 1)."""
    return ops.cat((x[:, 1:], ops.zeros_like(x[:, :1])), axis=1)


def gradient_only_loss(model, hidden, tokens, labels, loss_mask, extras):
    """The MTP layers' scaled loss as a term whose value is 0 and whose gradient is the loss's.
    hidden [s, b, h]: the decoder's output after its final norm."""
    cfg = model.cfg
    positions = np.arange(tokens.shape[1])
    only_mask = type(extras)(attention_mask=extras.attention_mask)      # dropout is refused with MTP
    total = 0.0
    for k in range(cfg.mtp_num_layers):
        tokens, labels, loss_mask = rolled(tokens), rolled(labels), rolled(loss_mask)
        positions = np.concatenate([positions[1:], [0]])      # a learned position table reads them
        embedded = model._embed(tokens, ms.Tensor(positions.astype(np.int32)), only_mask)
        hidden = _layer(model, k, hidden, embedded, only_mask)
        total = total + model._masked_mean(model._output(hidden), labels, loss_mask)
    scaled = total * (cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers)
    return scaled - ops.stop_gradient(scaled)


def _layer(model, k, hidden, embedded, extras):
    name = lambda s: layer_prefix(k) + s
    joined = ops.cat((model._norm(embedded, name("enorm.weight")), model._norm(hidden, name("hnorm.weight"))), -1)
    x = column_parallel(model.backend, model.ps, joined, model.params[name("eh_proj.weight")])
    x = model._layer(model.cfg.num_layers + k, x, None, extras)
    return model._norm(x, name("final_layernorm.weight"))
