"""The MindSpore GPT's parameter layout (param_layout.py) over a grid of TP x PP ranks, without
MindSpore: the stages together hold every parameter, tied embeddings on the first and the last
stage; every element enters the gradient norm exactly once; whole tensors that do not fit are
refused naming each problem."""
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from mindspeed.flags.trainer_flags import parse_args
from mindspeed.training.mindspore import param_layout
from mindspeed.training.mindspore.gpt_config import GPTConfig
from mindspeed.training.mindspore.parallel import ParallelState

TP, PP = 2, 2
EMBEDDING = "embedding.word_embeddings.weight"


def _config(*flags):
    args = parse_args(["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "4",
                       "--seq-length", "8", "--pipeline-model-parallel-size", str(PP), "--tensor-model-parallel-size",
                       str(TP), "--normalization", "LayerNorm", "--add-bias-linear", *flags], world_size=TP * PP)
    return GPTConfig.from_args(args, 64)


def _rank(tp_rank, pp_rank):
    return ParallelState(TP, 1, tp_rank, 0, None, None, pp_size=PP, pp_rank=pp_rank)


@pytest.mark.parametrize("tied", [True, False])
def test_stages_hold_every_parameter_and_share_only_tied_embeddings(tied):
    cfg = _config(*(() if tied else ("--untie-embeddings-and-output-weights",)))
    first, last = (set(param_layout.stage_shapes(cfg, r, PP)) for r in range(PP))
    assert first | last == set(cfg.full_shapes())
    assert first & last == ({EMBEDDING} if tied else set())
    assert ("output_layer.weight" in last) != tied
    assert {n for n in first if n.startswith("decoder.layers.")} == \
        {n for n in cfg.full_shapes() if n.split(".")[2:3] in (["0"], ["1"])}


def test_every_element_enters_the_gradient_norm_once():
    """Summed over the TP x PP ranks holding it, each parameter's counted share is 1: a TP-sharded
    weight counts 1/TP on each TP rank, a replicated one on TP rank 0 only, the tied embedding on
    the first stage only (Megatron's count)."""
    cfg = _config()
    counted = {name: Fraction(0) for name in cfg.full_shapes()}
    for pp_rank in range(PP):
        for tp_rank in range(TP):
            ps = _rank(tp_rank, pp_rank)
            for name in param_layout.owned_shapes(cfg, ps):
                if param_layout.counted_in_grad_norm(cfg, ps, name):
                    counted[name] += Fraction(1, TP) if param_layout.is_tp_sharded(cfg, name) else 1
    assert counted == {name: 1 for name in counted}
    assert not param_layout.is_tp_sharded(cfg, "decoder.final_layernorm.bias")
    assert param_layout.is_tp_sharded(cfg, "decoder.layers.0.mlp.linear_fc1.bias")


def test_whole_tensors_that_do_not_fit_are_refused_naming_each():
    cfg = _config()
    ps = _rank(1, 0)
    full = param_layout.init_full_weights(cfg, 3)
    expected = param_layout.check_fits(cfg, ps, full)
    assert set(expected) == set(param_layout.stage_shapes(cfg, 0, PP))
    shard = param_layout.tp_shard(cfg, ps, EMBEDDING, full[EMBEDDING])
    np.testing.assert_array_equal(shard, full[EMBEDDING][32:])          # TP rank 1: the vocabulary's second half
    broken = {n: w for n, w in full.items() if n != "decoder.layers.1.input_layernorm.bias"}
    broken[EMBEDDING] = full[EMBEDDING][:10]
    with pytest.raises(ValueError) as refused:
        param_layout.check_fits(cfg, ps, broken)
    assert str(refused.value) == ("checkpoint does not fit this model: missing decoder.layers.1.input_layernorm.bias; "
                                  f"{EMBEDDING}: (10, 16) != (64, 16)")


def test_config_and_layout_import_no_mindspore():
    """The layout and the stage arithmetic are plain Python and numpy (so tools may read them anywhere)."""
    code = ("import sys\n"
            "import mindspeed.training.mindspore.gpt_config, mindspeed.training.mindspore.param_layout\n"
            "print('mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
