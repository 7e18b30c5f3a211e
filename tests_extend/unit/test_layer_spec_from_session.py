"""The built-in trainer builds its layer spec from the session (training/layer_spec.py): the model has the
same module in every place as when the fused features patch Megatron-Core's spec providers (what
Megatron-LM's scripts get), and nothing patches those providers."""
import pytest

from tests_extend.distributed.harness import run_distributed

COMMON = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
          "--use-fused-rmsnorm", "--use-flash-attn"]
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2"]
CASES = {
    "dense": COMMON,
    "qk-norm-mtp": COMMON + ["--qk-layernorm", "--mtp-num-layers", "1", "--untie-embeddings-and-output-weights"],
    "moe-grouped-gemm": COMMON + MOE + ["--moe-grouped-gemm", "--bf16"],
    "mla": COMMON + ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
                     "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm"],
    "mixed-dense-moe-mtp": COMMON + MOE + ["--moe-grouped-gemm", "--bf16", "--first-k-dense-replace", "1",
                                           "--mtp-num-layers", "1", "--untie-embeddings-and-output-weights"],
}
SPEC_TARGETS = ("LocalSpecProvider.layer_norm", "LocalSpecProvider.core_attention",
                "LocalSpecProvider.grouped_mlp_modules", "gpt_layer_specs.LNImpl", "transformer_block.LayerNormImpl")


def _modules(rank, world_size, argv, from_session):
    """{module name: class name} of the model the trainer builds, and the spec patches in place."""
    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training import model as model_lib
    from mindspeed.training.layer_spec import SpecModules
    from tests_extend.megatron_tiny import init_parallel
    args = parse_args(argv, world_size=1)
    session = mindspeed.adapt(args, specs_from_session=from_session)
    try:
        init_parallel()
        args.padded_vocab_size = 128
        config = model_lib.transformer_config(args)
        modules = SpecModules.of(session) if from_session else None
        gpt = model_lib.build_model_chunks(args, config, modules)[0]
        patched = [t for t in SPEC_TARGETS if any(p.target.endswith(t) for p in session.patcher.applied())]
        return {name: type(m).__name__ for name, m in gpt.named_modules()}, patched
    finally:
        session.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_session_spec_builds_the_modules_the_patched_providers_give(case):
    (own, own_patches), = run_distributed(_modules, world_size=1, args=(CASES[case], True))
    (patched, patches), = run_distributed(_modules, world_size=1, args=(CASES[case], False))
    assert own == patched
    assert own_patches == [] and "LocalSpecProvider.layer_norm" in patches
    kinds = set(own.values())
    assert "FusedRMSNorm" in kinds and "DotProductAttention" not in kinds
    if case != "mla":      # MLA's core attention is the TE-less stand-in's (backends/torch/mla_standin.py)
        assert "FlashDotProductAttention" in kinds
    assert own["decoder.final_layernorm"] == "FusedRMSNorm"
    if "--moe-grouped-gemm" in CASES[case]:
        assert "GroupedMLP" in kinds and "SequentialMLP" not in kinds
    if "--mtp-num-layers" in CASES[case]:
        assert own["mtp.layers.0.enorm"] == own["mtp.layers.0.hnorm"] == "FusedRMSNorm"
