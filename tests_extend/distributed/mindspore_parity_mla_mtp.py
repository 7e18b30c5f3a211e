"""Multi-latent attention and multi-token prediction in the parity experiment (mindspore_parity.py):
Megatron-Core's MLASelfAttention and MultiTokenPredictionBlock on its local spec (torch, TP 1) and the
MindSpore trainer's (training/mindspore/mla.py, mtp.py), from the same weights. The main case is
DeepSeek-V3's attention and MTP together: the query compressed (--q-lora-rank) and normed, the kv norm
(--qk-layernorm), a v head size unlike q's, YaRN with mscale_all_dim (so the softmax scale is not
1/sqrt(d)), one MTP layer (an MLA layer) with --mtp-loss-scaling-factor 0.3. The others: MLA with the
uncompressed query, no norms, plain RoPE and no MTP; two MTP layers on the plain GQA model.

One torch harness process writes every case's initial weights (write_init) and trains them."""
from __future__ import annotations

import os

from tests_extend.distributed import mindspore_parity as mp

SHORT_STEPS = 2     # step 1 checks the forward and the gradients, step 2 an update
SIZES = dict(kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)
SIZE_FLAGS = ("--multi-latent-attention", "--kv-lora-rank", "12", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
              "--v-head-dim", "6")
YARN = dict(rope_type="yarn", rotary_scaling_factor=4.0, original_max_position_embeddings=8, mscale=1.0,
            mscale_all_dim=1.0)
YARN_FLAGS = ("--rope-scaling-type", "yarn", "--rope-scaling-factor", "4",
              "--rope-scaling-original-max-position-embeddings", "8", "--rope-scaling-mscale", "1.0",
              "--rope-scaling-mscale-all-dim", "1.0")
FULL = "mla_q_lora_norms_yarn_mtp"
PLAIN = "mla_q_proj_rope"
MTP2 = "gqa_mtp2"
# name -> (build_torch_model keywords, trainer flags, steps)
CASES = {
    FULL: (dict(mla=dict(SIZES, q_lora_rank=16, **YARN), qk_layernorm=True,
                mtp=dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.3)),
           SIZE_FLAGS + ("--q-lora-rank", "16", "--qk-layernorm") + YARN_FLAGS
           + ("--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3"), mp.STEPS),
    PLAIN: (dict(mla=dict(SIZES, q_lora_rank=None, rope_type="rope")), SIZE_FLAGS, SHORT_STEPS),
    MTP2: (dict(mtp=dict(mtp_num_layers=2, mtp_loss_scaling_factor=0.5)),
           ("--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.5"), SHORT_STEPS),
}


ATTENTION_STD = 0.3     # the attention's projections: scores of order 1, so RoPE's channels and the scale show


def init_ckpt(root: str, case: str) -> str:
    return os.path.join(root, f"init_{case}")


def write_init(root: str, case: str, seed: int = 11) -> None:
    """The case's initial weights, which both trainers load: Megatron's init (the MindSpore trainer's
    param_layout, under Megatron-Core's names: Megatron-Core's MLA/MTP GPT loads them strictly) with MLA's
    projections drawn wider (std 0.3:
    with 0.02 the scores are near 0 and the attention near uniform, whatever RoPE does) and the q/kv
    norms' weights around 1, each channel its own value."""
    import numpy as np
    from mindspeed.checkpoint import neutral as nf
    from mindspeed.training.mindspore.gpt_config import GPTConfig
    from mindspeed.training.mindspore.mla_layout import MLASizes
    from mindspeed.training.mindspore.param_layout import init_full_weights
    kw = CASES[case][0]
    mla = kw.get("mla")
    given = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
    sizes = mla and MLASizes(q_lora_rank=mla["q_lora_rank"] or 0, softmax_scale=0.0, **{k: mla[k] for k in given})
    cfg = GPTConfig(num_layers=mp.LAYERS, hidden_size=mp.HIDDEN, ffn_hidden_size=mp.FFN, num_attention_heads=mp.HEADS,
                    num_query_groups=mp.GROUPS, kv_channels=mp.HIDDEN // mp.HEADS, vocab_size=mp.VOCAB,
                    seq_length=mp.SEQ, tied_embeddings=False, qk_layernorm=kw.get("qk_layernorm", False),
                    mla=sizes, mtp_num_layers=kw.get("mtp", {}).get("mtp_num_layers", 0))
    rng = np.random.RandomState(seed)
    weights = init_full_weights(cfg, seed)
    for name, value in weights.items():
        if "self_attention.linear_q" in name or "self_attention.linear_kv" in name:
            weights[name] = rng.normal(0.0, ATTENTION_STD, value.shape).astype(np.float32)
        elif "q_layernorm" in name or "kv_layernorm" in name:
            weights[name] = (1.0 + 0.3 * rng.standard_normal(value.shape)).astype(np.float32)
    nf.save(init_ckpt(root, case), 0, weights, meta={"backend": "numpy"})


def torch_all(rank, world_size, root):
    """Harness body (one process): every case from its initial weights (write_init)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    results = {}
    for case, (kw, _, steps) in CASES.items():
        write_init(root, case)
        MTPLossLoggingHelper.tracker.clear()     # its logging buffer is sized by the first model's MTP layers
        results[case] = mp.torch_train(rank, world_size, 1, init_ckpt(root, case), False, model_kw=kw, steps=steps)
    return results


def torch_evaluates(rank, world_size, root, case, ms_ckpt):
    """Harness body: Megatron-Core's GPT of `case` loads the MindSpore trainer's checkpoint and evaluates it."""
    kw = CASES[case][0]
    return mp.torch_train(rank, world_size, 1, init_ckpt(root, case), False, ms_ckpt, model_kw=kw, steps=0)
