"""The GPT of the torch main job (Megatron-Core GPTModel, local spec) in MindSpore: its forward.

embedding (+ learned positions) -> L x [norm -> QKV (column) -> (q/k norms) -> RoPE -> causal attention
-> proj (row) -> residual -> norm -> fc1 (column) -> SwiGLU or GELU -> fc2 (row) -> residual] -> norm ->
output layer (tied or untied); norm is RMSNorm or LayerNorm (with bias), and with --qk-layernorm the
queries and keys are normalized per head by it too (Qwen3); positions are RoPE (rope.py), a
learned table (--position-embedding-type learned_absolute) or none; linear biases optional
(--add-bias-linear, or q/k/v only: --add-qkv-bias, Qwen2) -> vocab-parallel cross-entropy; with
--num-experts every MLP is Megatron-Core's MoE layer instead (moe.py: router, experts over the
expert-parallel ranks, shared experts), but for the layers --moe-layer-freq / --first-k-dense-replace
keep dense (GPTConfig.is_moe, by global layer index, so under PP too). What the model is comes from GPTConfig (gpt_config.py);
which parameters this rank holds, and their shapes, from param_layout.py. RMSNorm, SwiGLU, RoPE and
attention run through the backend's kernels (features reach the model via the interface only);
LayerNorm and GELU are MindSpore's own ops (no fused variant here).

What features change in the forward it reads from the config (recompute: full by layer chunks,
selective around the attention core, norm and activation; recompute_plan picks the chunks) or from
hooks a feature sets (enable_context_parallel, enable_activation_swap). Per micro-batch the model
can take `Extras`: a document mask (--reset-attention-mask), per-sample positions for the learned
table (--reset-position-ids) and dropout's keep masks (drawn by dropout.py; tensors, so a
recomputed forward drops the same values).
"""
from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
from mindspore import ops

from mindspeed.backends.mindspore import precision
from mindspeed.checkpoint import neutral as nf
from mindspeed.training.mindspore import mla, mtp, param_layout, rope
from mindspeed.training.mindspore.gpt_config import GPTConfig
from mindspeed.training.mindspore.layers import (column_parallel, row_parallel, vocab_parallel_cross_entropy,
                                                 vocab_parallel_embedding)
from mindspeed.training.mindspore import expert_bias
from mindspeed.training.mindspore.moe import MoELayer
from mindspeed.training.mindspore.parallel import ParallelState
from mindspeed.training.mindspore.param_layout import init_full_weights
from mindspeed.training.mindspore.recompute_plan import layer_chunks
from mindspeed.training.mindspore.reuse_fp32_param import FoldedMasters
from mindspeed.training.mindspore.rope import llama3_scaled_inv_freq

# the names callers import from here (the config and the layout live in their own modules)
__all__ = ["Extras", "NO_EXTRAS", "GPTConfig", "GPTModel", "init_full_weights", "llama3_scaled_inv_freq"]

_THIRDS = ops.Split(axis=-1, output_num=3)
_GELU = precision.fp32_compute(lambda h: ops.gelu(h, approximate="none"))
_GATHER = precision.fp32_compute(ops.gather)
# dropout's keep mask (fp32, 1/(1-p) where kept) times the activation; bf16: rounded once, as torch's
_DROPPED = precision.fp32_compute(lambda x, keep: x * keep)


@dataclass(frozen=True)
class Extras:
    """Per-micro-batch model inputs beyond the tokens (all optional)."""
    attention_mask: object = None    # [b, 1, s, s] bool, True = masked out (on top of causal)
    embed_positions: object = None   # [b, s] rows of the learned position table per sample
    hidden_keep: object = None       # [1 + 2 x layers, s_local, b, h]: keep mask / (1 - p); site 0 the
                                     # embedding, then per layer after attention and after the MLP
    probs_keep: object = None        # [layers, b, heads_local, s, s]: the attention probabilities' mask

    NAMES = ("attention_mask", "embed_positions", "hidden_keep", "probs_keep")


NO_EXTRAS = Extras()


def _assign(params: dict, name: str, value) -> None:
    if name in params:
        precision.assign(params[name], value)   # in place: a traced graph holds the storage
    else:
        params[name] = ms.Parameter(value, name=name)


class GPTModel:
    def __init__(self, cfg: GPTConfig, backend, ps: ParallelState):
        param_layout.check_divisible(cfg, ps)
        self.cfg, self.backend, self.ps = cfg, backend, ps
        self.params = {}
        # --fp16 / --bf16 (Megatron's Float16Module): the model computes with 16-bit copies of fp32 master
        # weights; the masters are what the optimizer updates and checkpoints hold (empty in fp32). bf16
        # ops without a CPU kernel compute in fp32 (backends/mindspore/precision.py)
        self.dtype = {"fp16": ms.float16, "bf16": ms.bfloat16}.get(cfg.params_dtype, ms.float32)
        self.masters = {}
        # --reuse-fp32-param: the masters folded into the bf16 weights and their residuals (reuse_fp32_param.py)
        self.folded = FoldedMasters(self.params) if cfg.reuse_fp32_param else None
        self.heads_local = cfg.num_attention_heads // ps.tp_size
        self.groups_local = cfg.num_query_groups // ps.tp_size
        self.cos, self.sin = rope.rope_tables(cfg.rope_head_dim, cfg.rotary_percent, cfg.rotary_base, cfg.seq_length,
                                              cfg.rope_scaling_factor, dict(cfg.yarn))
        self.band = dict(cfg.attention_band)
        if cfg.mla is not None:        # the attention kernel's keywords carry MLA's softmax scale too
            self.band["scale"] = cfg.mla.softmax_scale
        # the features' hooks the forward reads (None: off); set by enable_context_parallel and
        # enable_activation_swap
        self.cp = None                 # CPGroups when context parallelism is on
        self.cp_attention = None       # the context-parallel feature's attention hook
        self.swap_scope, self.swap_modules = None, frozenset()   # --swap-attention's hook
        # pipeline parallelism: this stage's slice of the layers (Megatron's split)
        self.layers = [i for i in cfg.stage_layers(ps.pp_rank) if i not in cfg.noop_layers]
        self._slot = {layer: pos for pos, layer in enumerate(self.layers)}   # index into the dropout masks
        # MTP's transformer layers (numbered after the decoder's; no dropout masks: refused with MTP)
        self._slot.update({cfg.num_layers + k: len(self.layers) + k for k in range(cfg.mtp_num_layers)})
        self.moe_layers = {}
        self.expert_bias = expert_bias.for_model(cfg)     # --moe-router-enable-expert-bias: state, not parameters

    def enable_context_parallel(self, cp_groups, attention_fn) -> None:
        """Route attention through the CP feature (written once against the backend interface)."""
        self.cp, self.cp_attention = cp_groups, attention_fn

    def enable_activation_swap(self, scope, modules) -> None:
        """--swap-attention: the named parts of each layer run inside scope(layer number), so what they
        save for backward waits in host memory (features/memory/activation_swap.py)."""
        self.swap_scope, self.swap_modules = scope, frozenset(modules)

    # parameters: what this rank holds (param_layout.py), as MindSpore parameters -------------------
    def load_full(self, full: dict) -> None:
        """Set parameters from whole tensors (Megatron names), keeping this TP rank's shard."""
        for name in param_layout.check_fits(self.cfg, self.ps, full):
            shard = param_layout.tp_shard(self.cfg, self.ps, name, full[name])
            if self.folded is not None:      # the loaded fp32 values are the masters, exactly
                self.folded.write(name, ms.Tensor(shard))
                continue
            if self.dtype != ms.float32:      # the loaded fp32 values are the masters, exactly
                _assign(self.masters, name, ms.Tensor(shard))
            _assign(self.params, name, ms.Tensor(shard).astype(self.dtype))

    def master_params(self) -> dict:
        """The fp32 weights by name: what the optimizer updates and checkpoints hold (with --fp16 the
        masters, with --reuse-fp32-param joined from their halves, else the parameters themselves)."""
        if self.folded is not None:
            return self.folded.arrays()
        return self.masters or self.params

    def copy_from_masters(self) -> None:
        """--fp16 / --bf16: the model's weights rounded from the updated masters (Megatron's
        _copy_main_params_to_model_params)."""
        for name, master in self.masters.items():
            precision.assign(self.params[name], master.astype(self.dtype))

    def parameters(self) -> list:
        return list(self.params.values())

    def owned_shapes(self) -> dict:
        return param_layout.owned_shapes(self.cfg, self.ps)

    def owns_expert(self, e: int) -> bool:
        return param_layout.owns_expert(self.cfg, self.ps, e)

    # class-level: checkpoint.py and optimizer.py ask them of any stage (type(model).stage_shapes)
    stage_shapes = staticmethod(param_layout.stage_shapes)
    shared_across_stages = staticmethod(param_layout.shared_across_stages)

    def counted_in_grad_norm(self, name: str) -> bool:
        return param_layout.counted_in_grad_norm(self.cfg, self.ps, name)

    def is_tp_sharded(self, name: str) -> bool:
        return param_layout.is_tp_sharded(self.cfg, name)

    # forward: the entry points --------------------------------------------------------------------
    def logits(self, tokens, position_ids=None, extras=NO_EXTRAS):
        """tokens [b, s] -> this rank's vocab shard of the logits [s, b, V/tp]. position_ids [b, s]
        (the same in every row) place RoPE when the sequence is sharded by context parallelism."""
        positions = None if position_ids is None else position_ids[0]
        return self._head(self._decoder(self._embed(tokens, positions, extras), positions, extras))

    def loss(self, tokens, labels, loss_mask, position_ids=None, denominator=None, extras=NO_EXTRAS):
        """Mean cross-entropy over the tokens loss_mask keeps (Megatron's lm loss). With context
        parallelism, `denominator` is the kept-token count of the whole sequence, so the CP ranks'
        losses (and gradients) sum to the full-sequence ones. With --mtp-num-layers the MTP layers'
        scaled loss adds to the gradient, not to the value (mtp.py)."""
        positions = None if position_ids is None else position_ids[0]
        hidden = self._final_norm(self._decoder(self._embed(tokens, positions, extras), positions, extras))
        loss = self._masked_mean(self._output(hidden), labels, loss_mask, denominator)
        if not self.cfg.mtp_num_layers:
            return loss
        return loss + mtp.gradient_only_loss(self, hidden, tokens, labels, loss_mask, extras)

    def stage_forward(self, hidden, tokens, labels, loss_mask, chunk: int = 0, extras=NO_EXTRAS):
        """One pipeline stage's model chunk `chunk` (the stage itself without a virtual pipeline): the
        embedding of `tokens` on the first stage's first chunk, else the previous (virtual) stage's
        output `hidden` [s, b, h], through the chunk's layers -> the loss on the last stage's last
        chunk, else the activation for the next one. extras: the micro-batch's document mask and positions."""
        first = self.ps.first_stage and chunk == 0
        last = self.ps.last_stage and chunk == self.cfg.virtual_chunks - 1
        x = self._decoder(self._embed(tokens, None, extras) if first else hidden, None, extras,
                          layers=self.chunk_layers(chunk))
        return self._masked_mean(self._head(x), labels, loss_mask) if last else x

    def chunk_layers(self, chunk: int) -> list:
        """The layers (with weights) of this stage's model chunk `chunk` (virtual pipeline)."""
        return [i for i in self.cfg.chunk_layers(self.ps.pp_rank, chunk) if i not in self.cfg.noop_layers]

    def kernel(self, name: str):
        """The device's fast path when its fused feature is on, else the reference (the same
        callable on CPU, where the fast path is the reference)."""
        kernels = self.backend.kernels
        # bf16 on CPU: in fp32 (the references widen most ops, not GQA's repeat or every gradient)
        return precision.fp32_compute(getattr(kernels if name in self.cfg.fused_kernels else kernels.reference, name))

    # forward: embedding, decoder, head, loss ------------------------------------------------------
    def _embed(self, tokens, positions=None, extras=NO_EXTRAS):
        x = vocab_parallel_embedding(self.backend, self.ps, tokens, self.params["embedding.word_embeddings.weight"])
        if self.cfg.position_embedding_type == "learned_absolute":
            x = x + self._position_embedding(x.shape[0], positions, extras.embed_positions)
        return self._dropped(x, extras, 0)

    def _position_embedding(self, s_local, positions, per_sample=None):
        """[s_local, 1 or b, h] rows of the learned table for this rank's tokens: its CP positions (or
        per_sample [b, s], --reset-position-ids), and with sequence parallelism its TP rank's slice
        (the table's gradient is summed over TP then)."""
        table = self.params["embedding.position_embeddings.weight"]
        ps = self.ps
        sp_split = ps.sequence_parallel and ps.tp_size > 1
        rows = s_local * ps.tp_size if sp_split else s_local
        if per_sample is not None:
            rows_emb = _GATHER(table, per_sample.T, 0)          # [s, b, h]
        else:
            rows_emb = (table[:rows] if positions is None else _GATHER(table, positions, 0)).expand_dims(1)
        if sp_split:
            rows_emb = rows_emb[ps.tp_rank * s_local:(ps.tp_rank + 1) * s_local]
        return rows_emb

    def _dropped(self, x, extras, site):
        """Dropout at one site of the hidden stream (Megatron's embedding dropout and bias-dropout-add)."""
        return x if extras.hidden_keep is None else _DROPPED(x, extras.hidden_keep[site])

    def _decoder(self, x, positions=None, extras=NO_EXTRAS, layers=None):
        """This pipeline stage's layers (`layers`: one model chunk's), recomputed as Megatron's
        TransformerBlock does within each chunk."""
        method = self.cfg.recompute_method if self.cfg.recompute else None
        for layers, recomputed in layer_chunks(self.layers if layers is None else layers, method,
                                               self.cfg.recompute_num_layers):
            if recomputed:     # one chunk: only its input is kept, its layers rerun in backward
                x = self.backend.memory.recompute(lambda h, ls=layers: self._layers(ls, h, positions, extras), x)
            else:
                x = self._layers(layers, x, positions, extras)
        return x

    def _layers(self, layers, x, positions, extras=NO_EXTRAS):
        for i in layers:
            x = self._layer(i, x, positions, extras)
        return x

    def _layer(self, i, x, positions=None, extras=NO_EXTRAS):
        # each part inside its --swap-attention scope when named; norms and the activation through
        # --recompute-norm / --recompute-activation-function (done(consumer) frees their output)
        normed, done = self._part("input_layernorm", i, self._layer_norm, i, x, "input_layernorm.weight")
        attn = self._part("self_attention", i, self._attention_block, normed, i, positions, extras)
        done(attn)
        x = x + self._dropped(attn, extras, 1 + 2 * self._slot[i])
        normed, done = self._part("pre_mlp_layernorm", i, self._layer_norm, i, x, "pre_mlp_layernorm.weight")
        mlp = self._part("mlp", i, self._mlp, i, normed)
        done(mlp)
        return x + self._dropped(mlp, extras, 2 + 2 * self._slot[i])

    def layer_name(self, i, suffix):
        """Layer i's parameter `suffix`: a decoder layer's, or past the decoder MTP layer i - num_layers's own."""
        return mtp.layer_param_name(self.cfg.num_layers, i, suffix)

    def _part(self, name, i, fn, *args):
        if self.swap_scope is None or name not in self.swap_modules:
            return fn(*args)
        with self.swap_scope(i + 1):        # Megatron's layer numbers start at 1
            return fn(*args)

    def _head(self, x):
        return self._output(self._final_norm(x))

    def _final_norm(self, x):
        return self._norm(x, "decoder.final_layernorm.weight")

    def _output(self, x):
        """The (shared) output layer: normed hidden states -> this rank's vocab shard of the logits."""
        out_w = self.params["embedding.word_embeddings.weight" if self.cfg.tied_embeddings else "output_layer.weight"]
        return column_parallel(self.backend, self.ps, x, out_w)

    def _masked_mean(self, logits, labels, loss_mask, denominator=None):
        per_token = vocab_parallel_cross_entropy(self.backend, self.ps, logits, labels.T)   # [s, b]
        mask = loss_mask.T.astype(ms.float32)
        return (per_token * mask).sum() / (mask.sum() if denominator is None else denominator)

    # forward: norms, and recompute of a layer's parts --------------------------------------------
    def _norm(self, x, name):
        return self._normalize(x, self.params[name], self._norm_bias(name))

    def _norm_bias(self, weight_name):
        return self.params[weight_name[:-len("weight")] + "bias"] if self.cfg.normalization == "LayerNorm" else None

    def _normalize(self, x, weight, bias=None):
        if self.cfg.normalization == "LayerNorm":     # MindSpore's own LayerNorm (bias and eps as torch's)
            return precision.fp32_compute(ops.LayerNorm(-1, -1, self.cfg.norm_epsilon))(x, weight, bias)[0]
        return self.kernel("rms_norm")(x, weight, self.cfg.norm_epsilon)[0]

    def _layer_norm(self, i, x, suffix):
        name = self.layer_name(i, suffix)
        bias = self._norm_bias(name)
        if bias is not None:
            return self._recomputed(self.cfg.recompute_norm_layers, i, self._normalize, x, self.params[name], bias)
        return self._recomputed(self.cfg.recompute_norm_layers, i, self._normalize, x, self.params[name])

    def _recomputed(self, layers: int, i: int, fn, *inputs):
        """fn(*inputs), and a `done(consumer_output)` to call once fn's output has been used:
        with recompute on for layer i, the output is then freed and rebuilt in backward."""
        if i >= layers:
            return fn(*inputs), lambda consumer_output: None
        handle = self.backend.memory.recompute_output(fn, *inputs)
        return handle.output, handle.discard

    # forward: attention ---------------------------------------------------------------------------
    def _attention_block(self, x, i, positions, extras):
        """bf16 on CPU: the block in fp32 on bf16 weights, its output rounded once (the q/k/v split's
        gradient, GQA's repeat and the softmax have no bf16 CPU kernel)."""
        return precision.fp32_compute(lambda h: self._attention(i, h, positions, extras))(x)

    def _attention(self, i, x, positions=None, extras=NO_EXTRAS):
        q, k, v = (mla.query_key_value(self, i, x, positions) if self.cfg.mla
                   else self._query_key_value(i, x, positions))
        core = lambda q, k, v: self._core_attention(q, k, v, i, extras)
        if self.cfg.recompute_core_attention:     # selective recompute: only q, k, v are kept for backward
            out = self.backend.memory.recompute(core, q, k, v)
        else:
            out = core(q, k, v)
        proj = self.params[self.layer_name(i, "self_attention.linear_proj.weight")]
        return row_parallel(self.backend, self.ps, out, proj, self._bias(i, "self_attention.linear_proj.bias"))

    def _query_key_value(self, i, x, positions=None):
        """q [s, b, heads x d], k and v [s, b, groups x d] of layer i's linear_qkv, normed and rotated."""
        cfg, rotate = self.cfg, self.kernel("rope")
        p = lambda s: self.params[self.layer_name(i, s)]
        qkv = column_parallel(self.backend, self.ps, x, p("self_attention.linear_qkv.weight"),
                              self._bias(i, "self_attention.linear_qkv.bias"))
        s, b = qkv.shape[0], qkv.shape[1]
        d, per_group = cfg.kv_channels, self.heads_local // self.groups_local
        qkv = qkv.reshape(s, b, self.groups_local, (per_group + 2) * d)
        # one query head per group: equal thirds, MindSpore's Split kernel (ops.split lowers to three
        # StridedSlice on CPU, which is slower)
        q, k, v = _THIRDS(qkv) if per_group == 1 else ops.split(qkv, [per_group * d, d, d], axis=-1)
        q, k = self._qk_normed(i, q.reshape(s, b, self.heads_local, d), k)
        if cfg.position_embedding_type == "rope":
            cos, sin = rope.rows_at(self.cos, self.sin, s, positions)
            q = rotate(q, cos, sin, 0)
            k = rotate(k, cos, sin, 0)
        return q.reshape(s, b, -1), k.reshape(s, b, -1), v.reshape(s, b, -1)

    def _qk_normed(self, i, q, k):
        """--qk-layernorm: the queries [s, b, heads, d] and keys [s, b, groups, d] normalized per head
        over d, before RoPE, by one weight (and bias) the heads share (Megatron-Core's q_layernorm /
        k_layernorm); their gradients are summed over TP (optimizer.reduce_gradients)."""
        if not self.cfg.qk_layernorm:
            return q, k
        norm = lambda x, which: self._norm(x, self.layer_name(i, f"self_attention.{which}.weight"))
        q_norm, k_norm = nf.QK_NORMS
        return norm(q, q_norm), norm(k, k_norm)

    def mla_norm(self, i, which, x):
        """MLA's q_layernorm / kv_layernorm of layer i over x's last dim (--qk-layernorm; else x)."""
        return self._norm(x, self.layer_name(i, f"self_attention.{which}.weight")) if self.cfg.qk_layernorm else x

    def _core_attention(self, q, k, v, i=0, extras=NO_EXTRAS):
        if self.cp is not None:      # this rank holds a shard of the sequence
            # --attention-mask-type general: the batch's own mask over the whole sequence (the documents'
            # mask, which holds the causal one); else Megatron's causal mask, implicit
            whole = {} if extras.attention_mask is None else {"mask": extras.attention_mask}
            return self.cp_attention(q, k, v, self.cp, head_num=self.heads_local, causal=True, **whole)
        if extras.probs_keep is not None:   # an explicit drop mask: the reference kernel takes one
            return precision.fp32_compute(self.backend.kernels.reference.attention)(
                q, k, v, layout="SBH", head_num=self.heads_local, mask=extras.attention_mask,
                drop_mask=extras.probs_keep[self._slot[i]], **self.band)[0]
        document_mask = {} if extras.attention_mask is None else {"mask": extras.attention_mask}
        return self.kernel("attention")(q, k, v, layout="SBH", head_num=self.heads_local, **self.band,
                                        **document_mask)[0]

    # forward: MLP ---------------------------------------------------------------------------------
    def _mlp(self, i, x):
        if self.cfg.is_moe(i):       # else a dense layer among MoE ones (--first-k-dense-replace): the plain MLP
            if i not in self.moe_layers:
                self.moe_layers[i] = MoELayer(self, i)
            return precision.fp32_compute(self.moe_layers[i])(x)     # bf16 on CPU: the layer in fp32
        p = lambda s: self.params[self.layer_name(i, s)]
        h = column_parallel(self.backend, self.ps, x, p("mlp.linear_fc1.weight"), self._bias(i, "mlp.linear_fc1.bias"))
        act, done = self._recomputed(self.cfg.recompute_activation_layers, i, self._activation, h)
        out = row_parallel(self.backend, self.ps, act, p("mlp.linear_fc2.weight"), self._bias(i, "mlp.linear_fc2.bias"))
        done(out)
        return out

    def _activation(self, h):
        if self.cfg.swiglu:
            return self.kernel("swiglu")(h, -1)
        return _GELU(h)       # Megatron-Core's default activation_func, F.gelu

    def _bias(self, i, suffix):
        on = self.cfg.add_bias_linear or (self.cfg.add_qkv_bias and suffix == "self_attention.linear_qkv.bias")
        return self.params[self.layer_name(i, suffix)] if on else None
