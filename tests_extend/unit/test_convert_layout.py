"""The tensor layouts of the conversion, on hand-made tensors (no model, no Megatron)."""
from __future__ import annotations

import pytest
import torch

from mindspeed.convert import layout
from mindspeed.convert.arch import Arch, arch_from_config, check_parallel, pipeline_split_flags
from mindspeed.errors import ConvertError

ARCH = Arch(num_layers=1, hidden_size=2, ffn_hidden_size=4, num_heads=4, num_kv_heads=2, head_dim=1,
            vocab_size=8, norm_epsilon=1e-5, rope_theta=1e4, rope_scaling_factor=None, tied_embeddings=True, qkv_bias=True,
            max_position_embeddings=16)


def test_qkv_rows_are_grouped_by_query_group():
    q = torch.tensor([10., 11., 12., 13.])   # heads q0..q3 (head_dim 1); groups {q0,q1}, {q2,q3}
    k, v = torch.tensor([20., 21.]), torch.tensor([30., 31.])
    fused = layout.fuse_qkv(ARCH, q, k, v)
    assert fused.tolist() == [10., 11., 20., 30., 12., 13., 21., 31.]
    assert [t.tolist() for t in layout.split_qkv(ARCH, fused)] == [q.tolist(), k.tolist(), v.tolist()]


def test_qkv_weights_round_trip():
    arch = Arch(**{**ARCH.__dict__, "head_dim": 3, "hidden_size": 12})
    q, k, v = torch.randn(12, 12), torch.randn(6, 12), torch.randn(6, 12)
    fused = layout.fuse_qkv(arch, q, k, v)
    assert fused.shape == (24, 12)
    assert all(torch.equal(a, b) for a, b in zip(layout.split_qkv(arch, fused), (q, k, v)))


def test_fc1_is_gate_then_up():
    hf = {name: torch.randn(*shape) for name, shape in layout.hf_shapes(ARCH).items()
          if name.startswith("model.layers.0.")}
    mg = layout.hf_to_mg_layer(ARCH, 0, hf)
    assert torch.equal(mg["mlp.linear_fc1.weight"][:4], hf["model.layers.0.mlp.gate_proj.weight"])
    back = layout.mg_to_hf_layer(ARCH, 0, mg)
    assert sorted(back) == sorted(hf) and all(torch.equal(back[n], hf[n]) for n in hf)


def test_vocab_rows_are_cut_then_padded_with_zeros():
    padded = layout.fit_vocab(torch.ones(3, 2), 3, 5)
    assert padded.shape == (5, 2) and padded[3:].abs().sum() == 0 and padded[:3].sum() == 6
    cut = layout.fit_vocab(torch.arange(10.).reshape(5, 2), 2, 4)
    assert cut.tolist() == [[0., 1.], [2., 3.], [0., 0.], [0., 0.]]


def test_tokenizer_vocab_counts_added_tokens(tmp_path):
    from mindspeed.data.tokenizer_vocab import tokenizer_vocab_size
    from tests_extend.unit.convert_kit import write_tokenizer_json
    write_tokenizer_json(str(tmp_path / "tokenizer.json"), 10)
    assert tokenizer_vocab_size(str(tmp_path)) == 10
    with pytest.raises(ConvertError, match="not a Hugging Face tokenizer.json"):
        (tmp_path / "bad.json").write_text("{}")
        tokenizer_vocab_size(str(tmp_path / "bad.json"))


LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16,
         "num_attention_heads": 2, "vocab_size": 10, "rope_theta": 10000.0}


@pytest.mark.parametrize("change, needle", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, "RoPE scaling 'dynamic'"),
    # YaRN converts (--rope-scaling-type yarn), but not an attention factor Megatron-Core computes otherwise
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.5}}, "attention_factor 1.5"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "mscale": 0.7}}, "mscale 0.7 without mscale_all_dim"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}}, "RoPE scaling 'llama3'"),
    ({"hidden_act": "gelu"}, "only SwiGLU"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_theta": 10000.5}, "not an integer"),
    ({"num_key_value_heads": 3, "num_attention_heads": 4}, "not a multiple"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"num_hidden_layers": None}, "wrong type"),
    ({"model_type": "llama", "vocab_size": "many"}, "wrong type"),
])
def test_configs_the_trainer_cannot_build_are_refused(change, needle):
    with pytest.raises(ConvertError, match=needle):
        arch_from_config({**LLAMA, **change}, "llama2", False)


def test_rope_theta_from_transformers_5_rope_parameters():
    config = {**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    del config["rope_theta"]
    assert arch_from_config(config, "llama3", False).rope_theta == 500000.0


def test_layer_lists_the_trainer_can_run():
    arch = Arch(**{**ARCH.__dict__, "num_layers": 6})
    check_parallel(arch, 1, 4, [1, 2, 2, 1])
    assert pipeline_split_flags([1, 2, 2, 1]) == ["--decoder-first-pipeline-num-layers", "1",
                                                  "--decoder-last-pipeline-num-layers", "1"]
    assert pipeline_split_flags([3, 3]) == []
    with pytest.raises(ConvertError, match="others must be equal"):
        check_parallel(arch, 1, 4, [1, 3, 1, 1])


def test_llama31_rope_scaling_is_read():
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    arch = arch_from_config({**LLAMA, "rope_scaling": scaling}, "llama3", False)
    assert arch.rope_scaling_factor == 32.0
    flags = arch.trainer_flags()
    at = flags.index("--use-rope-scaling")
    assert flags[at:at + 3] == ["--use-rope-scaling", "--rope-scaling-factor", "32.0"]


def test_config_without_a_field():
    config = dict(LLAMA)
    del config["intermediate_size"]
    with pytest.raises(ConvertError, match="no 'intermediate_size'"):
        arch_from_config(config, "llama2", False)
