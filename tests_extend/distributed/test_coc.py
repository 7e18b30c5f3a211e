"""--use-ascend-coc at TP=2 (2 gloo processes, one spawn for every check, CI time):

* Megatron-Core's ColumnParallelLinear -> RowParallelLinear, with and without --sequence-parallel,
  chunked in 2 and 4 (4 pieces of 6 local rows are uneven: 2, 2, 1, 1) and in mode 1 (one chunk):
  outputs and every gradient equal the non-overlapped layers' within 1e-6 (fp32). Each rank's
  input rows differ, so a chunk written to the wrong offset or reduced in the wrong order shows.
* the layers really went through the CoC path (call counts), and not without the flag;
* unadapt() gives Megatron its own layer methods back;
* the built-in trainer at TP=2 with sequence parallelism: 3 steps give the same losses.
"""
import time

import pytest

from tests_extend.distributed.harness import run_distributed
from tests_extend.distributed.trainer_run import train

S, B, H, F = 12, 2, 16, 32          # sequence (6 rows per rank under SP), batch, hidden, ffn
# chunking changes how a GEMM's sums are grouped (the weight gradients' sums over the S x B rows, the
# row layer's over F): fp32's worst case for a sum of K terms regrouped is about K units in the last
# place (2^-24 each) of the largest value, twice that for the two layers in turn
LAYER_TOL = 2 * max(S * B, F, H) * 2.0 ** -24
TP2 = ["--tensor-model-parallel-size", "2"]
COC = {"chunks2": ["--use-ascend-coc", "--coc-parallel-num", "2"],
       "chunks4": ["--use-ascend-coc", "--coc-parallel-num", "4"],
       "mode1": ["--use-ascend-coc", "--coc-mode", "1"]}
TINY = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "3", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
        "--lr", "3e-3", "--mock-data", "--seed", "7", "--sequence-parallel"] + TP2


def _mlp_pass(rank, sp):
    """Column -> Row at TP=2 on fixed weights and inputs: (output, grads) as this rank sees them."""
    import torch
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests_extend.megatron_tiny import init_parallel
    init_parallel(tp=2)
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True,
                            tensor_model_parallel_size=2, sequence_parallel=sp)
    init = torch.nn.init.zeros_
    col = ColumnParallelLinear(H, F, config=cfg, init_method=init, bias=True, gather_output=False)
    row = RowParallelLinear(F, H, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                            skip_bias_add=False)
    g = torch.Generator().manual_seed(5)
    w1, b1 = torch.randn(F, H, generator=g), torch.randn(F, generator=g)
    w2, b2 = torch.randn(H, F, generator=g), torch.randn(H, generator=g)
    x_full, dy_full = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    half, rows = F // 2, S // 2
    with torch.no_grad():
        col.weight.copy_(w1[rank * half:(rank + 1) * half])
        col.bias.copy_(b1[rank * half:(rank + 1) * half])
        row.weight.copy_(w2[:, rank * half:(rank + 1) * half])
        row.bias.copy_(b2)
    shard = slice(rank * rows, (rank + 1) * rows) if sp else slice(None)
    x = x_full[shard].clone().requires_grad_(True)
    y, _ = row(col(x)[0])
    (y * dy_full[shard]).sum().backward()
    return [t.detach().clone() for t in (y, x.grad, col.weight.grad, col.bias.grad, row.weight.grad,
                                          row.bias.grad)]


def _body(rank, world_size, tmp):
    import torch

    import mindspeed
    from mindspeed.features.parallel import coc_megatron
    from mindspeed.flags.trainer_flags import parse_args
    out, t0 = {}, time.monotonic()
    from megatron.core.tensor_parallel import layers
    originals = (layers.ColumnParallelLinear.__dict__["_forward_impl"], layers.RowParallelLinear.__dict__["forward"])
    for sp in (False, True):
        coc_megatron.CALLS.update(column=0, row=0)
        mindspeed.adapt(parse_args(TP2 + ["--mock-data"]))
        try:
            ref = _mlp_pass(rank, sp)
        finally:
            mindspeed.unadapt()
        out[f"sp{sp}/calls-without"] = dict(coc_megatron.CALLS)
        for name, flags in COC.items():
            coc_megatron.CALLS.update(column=0, row=0)
            mindspeed.adapt(parse_args(TP2 + flags + ["--mock-data"] + (["--sequence-parallel"] if sp else [])))
            try:
                got = _mlp_pass(rank, sp)
            finally:
                mindspeed.unadapt()
            out[f"sp{sp}/{name}/calls"] = dict(coc_megatron.CALLS)
            out[f"sp{sp}/{name}/restored"] = (layers.ColumnParallelLinear.__dict__["_forward_impl"],
                                              layers.RowParallelLinear.__dict__["forward"]) == originals
            out[f"sp{sp}/{name}/diff"] = [float((a - b).abs().max() / (b.abs().max() + 1e-30)) for a, b in zip(got, ref)]
            out[f"sp{sp}/{name}/shapes"] = [tuple(a.shape) == tuple(b.shape) for a, b in zip(got, ref)]
    out["layer-seconds"] = time.monotonic() - t0
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()         # the trainer builds its own groups
    for name, flags in (("off", []), ("coc", COC["chunks4"])):
        coc_megatron.CALLS.update(column=0, row=0)
        out[f"train-{name}"] = train(rank, TINY + flags, tmp, name)
        out[f"train-{name}/calls"] = dict(coc_megatron.CALLS)
    out["total-seconds"] = time.monotonic() - t0
    del torch
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_body, world_size=2, args=(str(tmp_path_factory.mktemp("coc")),), timeout=300)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("mode", sorted(COC))
def test_overlapped_layers_equal_megatrons(runs, sp, mode):
    for rank in (0, 1):
        assert all(runs[rank][f"sp{sp}/{mode}/shapes"])
        diffs = runs[rank][f"sp{sp}/{mode}/diff"]
        assert max(diffs) <= LAYER_TOL, f"rank {rank}: relative max diffs (y, dx, dw1, db1, dw2, db2) {diffs}"


@pytest.mark.parametrize("sp", [False, True])
def test_layers_go_through_coc_only_with_the_flag(runs, sp):
    assert runs[0][f"sp{sp}/calls-without"] == {"column": 0, "row": 0}
    for mode in COC:
        assert runs[0][f"sp{sp}/{mode}/calls"] == {"column": 1, "row": 1}


def test_unadapt_restores_megatrons_layers(runs):
    assert all(runs[0][f"sp{sp}/{mode}/restored"] for sp in (False, True) for mode in COC)


def test_training_losses_equal_without_overlap(runs):
    off, coc = runs[0]["train-off"], runs[0]["train-coc"]
    assert len(off) == 3 and len(coc) == 3
    assert runs[0]["train-coc/calls"]["column"] > 0 and runs[0]["train-coc/calls"]["row"] > 0
    assert runs[0]["train-off/calls"] == {"column": 0, "row": 0}
    for a, b in zip(off, coc):
        assert abs(a - b) <= 1e-6 * abs(a), (off, coc)
