"""Megatron's Transformer Engine layer spec without Transformer Engine: the stand-in builds a layer
from Megatron's local modules in TE's layout (the norm inside the QKV / FC1 projection, TE's
parameter names), computes what the local spec's separate norm + projection computes, and is
listed by the patcher and removed by unadapt()."""
import pytest
import torch
import torch.distributed as dist

import mindspeed
from megatron.core import parallel_state
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from mindspeed.backends.torch.te_spec_standin import GPT_LAYER_SPECS, LayerNormColumnParallelLinear, apply_te_spec_standin

pytestmark = pytest.mark.skipif(gpt_layer_specs.HAVE_TE, reason="Transformer Engine is installed: its own spec runs")


@pytest.fixture
def adapted():
    state = mindspeed.adapt([])
    dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(123)
    try:
        yield state
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        mindspeed.unadapt()


def _config(**overrides):
    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                             hidden_dropout=0.0, attention_dropout=0.0, **overrides)


def test_te_spec_builds_a_layer_in_te_layout_that_computes_what_the_local_spec_computes(adapted):
    assert apply_te_spec_standin(adapted.patcher)
    assert GPT_LAYER_SPECS + ".TESpecProvider" in adapted.patcher.describe()
    config = _config()
    te_layer = TransformerLayer(config, gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec().submodules)
    local_layer = TransformerLayer(config, gpt_layer_specs.get_gpt_layer_local_spec().submodules)

    te_names = {name for name, _ in te_layer.named_parameters()}
    assert {"self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
            "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias"} <= te_names
    assert not any(name.startswith(("input_layernorm.", "pre_mlp_layernorm.")) for name in te_names)
    assert sum(p.numel() for p in te_layer.parameters()) == sum(p.numel() for p in local_layer.parameters())
    assert isinstance(te_layer.self_attention.linear_qkv, LayerNormColumnParallelLinear)

    # the local layer's weights in TE's places: both layers compute the same output
    local = dict(local_layer.named_parameters())
    moved = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
             "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
    with torch.no_grad():
        for name, param in te_layer.named_parameters():
            local_param = local[moved.get(name, name)]
            local_param.normal_()          # not the ones / zeros a norm starts from
            param.copy_(local_param)
    hidden = torch.randn(8, 2, config.hidden_size)
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril().logical_not()
    te_out, _ = te_layer(hidden, attention_mask=mask)
    local_out, _ = local_layer(hidden, attention_mask=mask)
    torch.testing.assert_close(te_out, local_out)

    mindspeed.unadapt()
    assert not hasattr(gpt_layer_specs, "TESpecProvider")
    mindspeed.adapt([])        # the fixture's unadapt


@pytest.mark.parametrize("normalization,zero_centered", [("RMSNorm", False), ("LayerNorm", True)])
def test_the_fused_norm_follows_the_config(adapted, normalization, zero_centered):
    config = _config(normalization=normalization, layernorm_zero_centered_gamma=zero_centered)
    linear = LayerNormColumnParallelLinear(64, 32, config=config, init_method=torch.nn.init.normal_,
                                           bias=True, gather_output=False, skip_bias_add=False)
    assert (linear.layer_norm_bias is None) == (normalization == "RMSNorm")
    x = torch.randn(4, 2, 64)
    out, _ = linear(x)
    gamma = linear.layer_norm_weight + 1 if zero_centered else linear.layer_norm_weight
    if normalization == "RMSNorm":
        normed = torch.nn.functional.rms_norm(x, (64,), gamma, config.layernorm_epsilon)
    else:
        normed = torch.nn.functional.layer_norm(x, (64,), gamma, linear.layer_norm_bias, config.layernorm_epsilon)
    torch.testing.assert_close(out, normed @ linear.weight.t() + linear.bias)
    # a zero-centered gamma is stored as 0 and used as 1: the norm starts as the identity scale
    assert torch.equal(gamma, torch.ones(64))


def test_te_decoder_block_spec_gets_the_local_norm_and_mla_a_linear(adapted):
    """get_gpt_decoder_block_spec(use_transformer_engine=True) names TENorm (a NameError without TE),
    and the MLA layer spec asks the provider for TE's `linear`."""
    assert apply_te_spec_standin(adapted.patcher)
    config = _config(normalization="RMSNorm")
    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    norm = block.layer_norm(config, config.hidden_size, eps=config.layernorm_epsilon)
    assert isinstance(norm, torch.nn.RMSNorm)
    mla = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True)
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    assert mla.submodules.self_attention.submodules.linear_q_down_proj is ColumnParallelLinear


def test_bert_and_t5_te_specs_build_from_local_modules_and_the_projection_checkpoints_without_metadata(adapted):
    """BERT's (and T5's) TE spec names TE's modules itself and raises without TE (its test modules build it at
    import); the stand-in runs Megatron's function with the stand-ins bound. The fused projection fills
    in the data-parallel group a caller's checkpoint metadata lacks, as TE's does."""
    from megatron.core.models.bert import bert_layer_specs
    from mindspeed.backends.torch.te_spec_standin import TelessDotProductAttention, apply_te_spec_function_standins
    assert apply_te_spec_function_standins(adapted.patcher) == 7      # BERT's, T5's two, the heterogeneous 4
    spec = bert_layer_specs.get_bert_layer_with_transformer_engine_spec()
    assert not bert_layer_specs.HAVE_TE        # Megatron still finds TE absent
    layer = TransformerLayer(_config(), spec.submodules)
    assert isinstance(layer.self_attention.linear_qkv, LayerNormColumnParallelLinear)
    assert isinstance(layer.mlp.linear_fc1, LayerNormColumnParallelLinear)
    assert isinstance(layer.self_attention.core_attention, TelessDotProductAttention)
    from megatron.core.models.T5 import t5_spec
    decoder = TransformerLayer(_config(), t5_spec.decoder_model_with_transformer_engine_default_spec().submodules)
    assert isinstance(decoder.pre_cross_attn_layernorm, torch.nn.LayerNorm)      # TENorm: the local norm
    assert isinstance(decoder.cross_attention.core_attention, TelessDotProductAttention)
    sharded = layer.mlp.linear_fc1.sharded_state_dict(prefix="fc1.", metadata={})
    assert {"fc1.weight", "fc1.layer_norm_weight"} <= set(sharded)
    mindspeed.unadapt()
    with pytest.raises(ImportError, match="Transformer Engine is not installed"):
        bert_layer_specs.get_bert_layer_with_transformer_engine_spec()
    mindspeed.adapt([])        # the fixture's unadapt


def test_heterogeneous_gpt_te_spec_builds_from_local_modules(adapted, tmp_path):
    """The heterogeneous GPT's TE spec reads TE's names from its module (None without TE: `not_none`
    raised); with the stand-ins it builds TE's layout, and its linear replacement of a whole block is
    the fused norm + projection with the output gathered over tensor-parallel ranks."""
    import json
    from megatron.core.models.gpt.heterogeneous import heterogeneous_layer_specs as specs
    from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig
    from megatron.core.transformer.identity_op import IdentityOp
    from mindspeed.backends.torch.te_spec_standin import (LayerNormColumnParallelLinearGathered,
                                                          TelessDotProductAttention, apply_te_spec_function_standins)
    blocks = [{"attention": {"no_op": False, "replace_with_linear": False, "num_query_groups": 2},
               "mlp": {"no_op": False, "replace_with_linear": False, "ffn_hidden_size": 128}},
              {"attention": {"no_op": False, "replace_with_linear": True, "num_query_groups": None},
               "mlp": {"no_op": True, "replace_with_linear": False, "ffn_hidden_size": None}}]
    path = tmp_path / "blocks.json"
    path.write_text(json.dumps({"block_configs": blocks}))
    config = HeterogeneousTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm",
                                            use_cpu_initialization=True, heterogeneous_layers_config_path=str(path))
    with pytest.raises(ValueError, match="Expected value to be not None"):
        specs.get_gpt_heterogeneous_layer_spec(config, use_te=True)        # Megatron's own, TE absent
    apply_te_spec_function_standins(adapted.patcher)
    block = specs.get_gpt_heterogeneous_layer_spec(config, use_te=True)
    full, linear = (TransformerLayer(config, spec.submodules, layer_number=i + 1)
                    for i, spec in enumerate(block.layer_specs))
    assert isinstance(full.self_attention.linear_qkv, LayerNormColumnParallelLinear)
    assert isinstance(full.self_attention.core_attention, TelessDotProductAttention)
    assert isinstance(full.input_layernorm, IdentityOp)        # the norm is inside the projection, as TE's
    assert isinstance(linear.self_attention, LayerNormColumnParallelLinearGathered)
    x = torch.randn(3, 2, 64)
    out, bias = linear.self_attention(x)
    qkv = linear.self_attention
    expected = torch.nn.functional.linear(torch.nn.functional.rms_norm(x, (64,), qkv.layer_norm_weight, qkv.eps),
                                          qkv.weight, qkv.bias)
    assert bias is None and torch.allclose(out, expected, atol=1e-6)
