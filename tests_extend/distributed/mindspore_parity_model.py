"""Model variants of the parity experiment (mindspore_parity.py): GELU MLP, LayerNorm, learned or no
position embeddings, multi-head attention (as many query groups as heads), each as Megatron-Core's GPTModel keywords and as the trainer's flags; and the
recompute variants (selective, uniform groups, block), which keep the default model.

One torch harness process trains every variant in turn (each writes its own initial checkpoint)."""
from __future__ import annotations

import os

from tests_extend.distributed import mindspore_parity as mp

SHORT_STEPS = 3     # each piece alone: step 1 checks the forward, steps 2-3 the gradients' updates
RECOMPUTE_STEPS = 4     # recompute runs PyNative (slower than the traced graph)
COMBINED = "gelu_layernorm_learned"

BAND_FLAGS = ("--use-flash-attn", "--sparse-mode", "4", "--pre-tockens", "3", "--next-tockens", "0")

# name -> (build_torch_model keywords, trainer flags, steps)
MODEL_CASES = {
    "default": ({}, (), RECOMPUTE_STEPS),       # the recompute cases' model
    COMBINED: (dict(swiglu=False, normalization="LayerNorm", position_embedding_type="learned_absolute"),
               ("--no-swiglu", "--normalization", "LayerNorm", "--position-embedding-type", "learned_absolute"),
               mp.STEPS),
    "gelu": (dict(swiglu=False), ("--no-swiglu",), SHORT_STEPS),
    "layernorm": (dict(normalization="LayerNorm"), ("--normalization", "LayerNorm"), SHORT_STEPS),
    "learned_positions": (dict(position_embedding_type="learned_absolute"),
                          ("--position-embedding-type", "learned_absolute"), SHORT_STEPS),
    "no_positions": (dict(position_embedding_type="none"), ("--position-embedding-type", "none"), SHORT_STEPS),
    # one query head per group: q/k/v come out of one equal three-way split (model._attention)
    "multi_head": (dict(num_query_groups=mp.HEADS), ("--num-query-groups", str(mp.HEADS)), SHORT_STEPS),
    # flash attention's band: each query sees itself and the 3 keys before it (torch: the flash feature)
    "band": ({}, BAND_FLAGS, SHORT_STEPS),
    # --qk-layernorm by LayerNorm (weights and biases; test_mindspore_parity.py has RMSNorm's at TP=2)
    "qk_layernorm_layernorm": (dict(normalization="LayerNorm", qk_layernorm=True, kv_channels=16),
                               ("--normalization", "LayerNorm", "--qk-layernorm", "--kv-channels", "16"), SHORT_STEPS),
}
# cases whose torch side runs MindSpeed's feature too: the same flags, adapted on torch
TORCH_ADAPTED = {"band"}

RECOMPUTE_CASES = {
    "selective": ("--recompute-granularity", "selective"),
    "uniform2": ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"),
    "block1": ("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"),
}


def init_ckpt(root: str, case: str) -> str:
    return os.path.join(root, f"init_{case}")


def torch_all(rank, world_size, root):
    """Harness body (one process): every model case, from its own torch-initialised weights."""
    return {case: mp.torch_train(rank, world_size, 1, init_ckpt(root, case), True, model_kw=kw, steps=steps,
                                 adapt_argv=flags if case in TORCH_ADAPTED else ())
            for case, (kw, flags, steps) in MODEL_CASES.items()}


def combined_flags() -> tuple:
    return MODEL_CASES[COMBINED][1]


def ms_combined_tp2_sp(backend) -> dict:
    """For the parity msrun worker: the combined variant at TP=2 with sequence parallelism (the
    non-gated fc1 split by rows, norm biases and the position table replicated, their gradients
    summed over TP), from the trainer's own initialisation; compared with the same run at TP=1."""
    return mp.ms_train(backend, 2, True, None, steps=SHORT_STEPS, extra=combined_flags())


CP_SELECTIVE_STEPS = 3


def ms_cp2_selective_recompute(backend, init_ckpt: str) -> dict:
    """For the parity msrun worker: selective recompute around CP=2's ring attention (made of Cells
    with their own backward), counting the context-parallel attention's calls (the real function)."""
    from mindspeed.features.context_parallel import attention as cp_attention
    real, calls = cp_attention.context_parallel_attention, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    cp_attention.context_parallel_attention = counted      # what the feature hands the trainer at adapt
    try:
        run = mp.ms_train(backend, 1, False, init_ckpt, steps=CP_SELECTIVE_STEPS, cp=2, cp_algo="megatron_cp_algo",
                          extra=("--recompute-granularity", "selective"))
    finally:
        cp_attention.context_parallel_attention = real
    return dict(run, attention_calls=calls[0])


# --qk-layernorm (Qwen3): per-head q/k RMSNorms, a head size of its own (--kv-channels 16 with 4 heads of a
# 32-wide model), at TP=2 against Megatron-Core at TP=2 (its finalize_model_grads sums the norms' gradients)
QK_FLAGS = ("--qk-layernorm", "--kv-channels", "16")
QK_MODEL = dict(qk_layernorm=True, kv_channels=16)
QK_STEPS = 4


def write_qk_init(ckpt: str, seed: int = 7) -> None:
    """The q/k-norm model's initial weights, which both trainers load: Megatron's init (the MindSpore
    trainer's param_layout) with the q/k norms' weights drawn around 1, each head dim its own value,
    so that a norm over the wrong axis, or the wrong heads' share on a TP rank, shows."""
    import numpy as np
    from mindspeed.checkpoint import neutral as nf
    from mindspeed.training.mindspore.gpt_config import GPTConfig
    from mindspeed.training.mindspore.param_layout import init_full_weights
    cfg = GPTConfig(num_layers=mp.LAYERS, hidden_size=mp.HIDDEN, ffn_hidden_size=mp.FFN,
                    num_attention_heads=mp.HEADS, num_query_groups=mp.GROUPS, kv_channels=QK_MODEL["kv_channels"],
                    vocab_size=mp.VOCAB, seq_length=mp.SEQ, tied_embeddings=False, qk_layernorm=True)
    weights = init_full_weights(cfg, seed)
    rng = np.random.RandomState(seed)
    for name in weights:
        if "q_layernorm" in name or "k_layernorm" in name:
            weights[name] = (1.0 + 0.3 * rng.standard_normal(weights[name].shape)).astype(np.float32)
    nf.save(ckpt, 0, weights, meta={"backend": "numpy"})


def ms_qk_tp2(backend, init: str, save_dir: str | None, sp: bool = False) -> dict:
    """For the parity msrun worker: the q/k-norm model at TP=2 (the heads split, the norms replicated),
    PyNative (compiling a graph costs more than these few steps; the traced forward is the same code)."""
    before = os.environ.get("MINDSPEED_MS_PYNATIVE")
    os.environ["MINDSPEED_MS_PYNATIVE"] = "1"
    try:
        return mp.ms_train(backend, 2, sp, init, save_dir=save_dir, steps=QK_STEPS, extra=QK_FLAGS)
    finally:
        if before is None:
            os.environ.pop("MINDSPEED_MS_PYNATIVE")
        else:
            os.environ["MINDSPEED_MS_PYNATIVE"] = before


def torch_tp2_with_qk(rank, world_size, init: str, other: str, qk_init: str, qk_other: str) -> dict:
    """Harness body (2 processes, one launch): the default model's TP=2 run (MindSpore's checkpoint
    `other` evaluated after it), then the q/k-norm model's from qk_init (`qk_other` evaluated)."""
    return {"plain": mp.torch_train(rank, world_size, 2, init, False, other),
            "qk": mp.torch_train(rank, world_size, 2, qk_init, False, qk_other, model_kw=QK_MODEL, steps=QK_STEPS)}
