"""--reuse-fp32-param with --use-distributed-optimizer (reuse_fp32_param_distrib.py): the two layouts of
one bucket in process, then DP=2 training in one 2-process spawn (swap_workers.reuse_fp32_param_distributed):
losses against --bf16 alone, bytes per parameter, the borrowed shards repaired by the all-gather, a
model-only load, checkpoints across the flag; with --overlap-param-gather (the all-gather deferred to
the next forward) the same losses, masters, saved tensors, evaluation loss and weights norm bit for bit,
and checkpoints across that flag. A file of its own so CI's workers run it beside test_swap_memory.py."""
import pytest

from tests_extend.unit import swap_workers
from tests_extend.unit.bf16_rounding import largest_gap, losses_before_a_differing_tie

pytestmark = pytest.mark.cpu_numerics      # bf16 training: CI runs it with torch's AVX2 kernels too


# --reuse-fp32-param with --use-distributed-optimizer: the layouts of one bucket (in process) ...

@pytest.mark.parametrize("dp, rank", [(2, 0), (2, 1), (3, 2)])
def test_bucket_shard_layouts_round_trip_and_touch_only_the_borrowed_shard(dp, rank):
    import torch
    from mindspeed.features.memory.reuse_fp32_param_distrib import BucketShard
    n = 10                                  # chunk 3: several chunks, one partial, in both directions
    data = torch.randn(dp * n, dtype=torch.bfloat16)
    shard = BucketShard(data, dp, rank, chunk=3)
    masters = torch.randn(n) * 3
    shard.write(0, n, masters)
    assert torch.equal(shard.read(0, n), masters)                         # exact through the bf16 layout
    assert torch.equal(data[rank * n:(rank + 1) * n], masters.bfloat16())  # no ties in randn: as torch rounds
    before = data.clone()
    shard.to_fp32()
    assert torch.equal(shard.fp32, masters)                                # the optimizer's view
    borrowed = rank + 1 if rank == 0 else rank - 1
    outside = torch.ones(dp * n, dtype=torch.bool)
    outside[min(rank, borrowed) * n:(max(rank, borrowed) + 1) * n] = False
    assert torch.equal(data[outside], before[outside])                    # other shards untouched
    shard.fp32.add_(1.0)                                                   # an update
    shard.to_bf16()
    assert torch.equal(shard.read(0, n), masters + 1.0)
    assert torch.equal(data[rank * n:(rank + 1) * n], shard.own)
    assert torch.equal(data[outside], before[outside])


# ... and DP=2 training (one 2-process spawn: swap_workers.reuse_fp32_param_distributed)

@pytest.fixture(scope="module")
def dist_report(tmp_path_factory):
    from tests_extend.distributed.harness import run_distributed
    root = str(tmp_path_factory.mktemp("reuse_dist"))
    return run_distributed(swap_workers.reuse_fp32_param_distributed, world_size=2, args=(root,), timeout=600,
                           daemon=False)


def test_distributed_reuse_fp32_param_trains_as_megatron_rounding_ties_away_from_zero(dist_report):
    for rank in dist_report:
        assert rank["on"]["attached"] and not rank["off"]["attached"] and not rank["reference"]["attached"]
        assert len(rank["on"]["losses"]) == 20 and rank["on"]["losses"] == rank["reference"]["losses"]
        assert rank["masters_bitwise_after_first_update"]


def test_distributed_reuse_fp32_param_keeps_the_losses_within_bf16_rounding(dist_report):
    # each rank counts the ties its own master shard holds: the model's are the sum
    ties = [sum(counts) for counts in zip(*(rank["off"]["differing_ties"] for rank in dist_report))]
    same = losses_before_a_differing_tie(ties)
    for rank in dist_report:
        off, on, fp32 = rank["off"]["losses"], rank["on"]["losses"], rank["fp32"]["losses"]
        # the same updates until one leaves a master where ties-away and to-even rounding differ (when
        # depends on the CPU's kernels: bf16_rounding.py) ...
        assert same >= 1 and on[:same] == off[:same]
        # ... then a few bf16 parameters one step apart: less than bf16 itself moves the losses off fp32
        assert largest_gap(on, off) <= largest_gap(off, fp32)
        assert off[-1] < off[0] - 1.5


def test_distributed_reuse_fp32_param_stores_the_master_shard_in_the_bf16_buffer(dist_report):
    for rank in dist_report:
        off, on = rank["off"], rank["on"]
        # per bf16 parameter, on each of DP=2 ranks: 2 (buffer) + 4/2 (fp32 shard) -> 2 + 2/2 (residual)
        for run, per_param in ((off, 4), (on, 3)):
            assert run["bf16_buffer_bytes"] == 2 * run["bf16_params"]
            assert (run["bytes"] - run["other_buffer_bytes"]) / run["bf16_params"] == per_param
        assert off["bytes"] - on["bytes"] == 4 * off["master_elements"] - off["bf16_buffer_bytes"] // 2


def test_distributed_reuse_fp32_param_all_gather_rewrites_the_borrowed_shards(dist_report):
    for rank in dist_report:
        assert rank["on"]["buffers_agree_across_ranks"] and rank["off"]["buffers_agree_across_ranks"]


def test_distributed_reuse_fp32_param_model_only_load_sets_the_masters(dist_report):
    for rank in dist_report:
        assert all(rank[name]["reloaded_masters_equal_params"] for name in ("off", "reference", "on"))


@pytest.mark.parametrize("direction", ["on_to_off", "off_to_on", "overlap_to_on", "on_to_overlap"])
def test_distributed_reuse_fp32_param_checkpoints_cross_the_flag(dist_report, direction):
    for rank in dist_report:
        run = rank["checkpoint"][direction]
        assert run["iteration"] == 2 and run["resumed"] == run["continued"]


# ... with --overlap-param-gather: the all-gather that rewrites the borrowed halves runs in the next
# forward's pre-hooks; whatever reads whole weights before it gathers first

def test_overlap_param_gather_trains_bit_for_bit_as_without_it(dist_report):
    for rank in dist_report:
        on, overlap = rank["on"], rank["overlap"]
        assert overlap["attached"] and len(overlap["losses"]) == 20 and overlap["losses"] == on["losses"]
        assert rank["overlap_masters_bitwise"] == {"after_first_update": True, "at_the_end": True}
        assert overlap["bytes"] == on["bytes"]                     # the same 3 bytes per bf16 parameter


def test_overlap_param_gather_really_defers_the_gather(dist_report):
    # right after an update the borrowed halves still hold fp32 bits (the ranks' buffers differ) until a
    # reader gathers: without the overlap they never differ
    for rank in dist_report:
        on, overlap = rank["on"], rank["overlap"]
        for when in ("before_save", "after_update", "before_forward"):
            assert on[f"buffers_agree_{when}"] and not overlap[f"buffers_agree_{when}"], when
        for when in ("after_save", "after_norm", "across_ranks"):
            assert on[f"buffers_agree_{when}"] and overlap[f"buffers_agree_{when}"], when


def test_overlap_param_gather_save_right_after_an_update_holds_the_weights(dist_report):
    # every tensor of the checkpoint saved right after update 2 (before any forward gathered) is bit for
    # bit the one saved without the overlap (the optimizer's at the parameters' places: the padding between
    # them is saved unwritten): no fp32 bits in a bf16 weight (5 bf16 weight tensors: embedding, 4 stacked
    # per-layer ones; masters and Adam's moments of the bf16 and the fp32 buffer)
    for rank in dist_report:
        saved = rank["overlap_saved_tensors"]
        assert saved["same_keys"] and saved["bf16_weights"] == 5 and saved["optimizer_tensors"] == 6
        assert saved["differ"] == [], saved["differ"]


def test_overlap_param_gather_readers_after_an_update_see_the_weights(dist_report):
    # the built-in trainer's evaluation (forward only, through the pre-hooks) and Megatron-LM's
    # --log-params-norm (calc_params_l2_norm, as wrapped), each right after an update
    for rank in dist_report:
        on, overlap = rank["on"], rank["overlap"]
        assert overlap["forward_only_loss"] == on["forward_only_loss"]
        assert overlap["weights_norm"] == on["weights_norm"]
