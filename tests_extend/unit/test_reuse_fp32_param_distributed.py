"""--reuse-fp32-param with --use-distributed-optimizer (reuse_fp32_param_distrib.py): the two layouts of
one bucket in process, then DP=2 training in one 2-process spawn (swap_workers.reuse_fp32_param_distributed):
losses against --bf16 alone, bytes per parameter, the borrowed shards repaired by the all-gather, a
model-only load, checkpoints across the flag; with --overlap-param-gather (the all-gather deferred to
the next forward) the same losses, masters, saved tensors, evaluation loss and weights norm bit for bit,
and checkpoints across that flag. Then a shard that is a whole buffer (data-parallel size 1: the
buffer's storage grown to [bf16 params | residual], folded in place for the update): the in-place
fold in process, and 2-process training at PP 2 (DP 1, Qwen3's recipe) and at MoE EP 2 (the experts'
EDP 1 beside the dense DP 2), swap_workers.reuse_fp32_param_size_one. A file of its own so CI's workers
run it beside test_swap_memory.py."""
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


def test_masters_read_as_megatron_lm_params_norm_reads_them(dist_report):
    # calc_params_l2_norm (--log-params-norm) reads `param.main_param`, the master shard, between updates a
    # view of (own, borrowed) halves: through the wrapper it reads fp32 values, those of Megatron's optimizer
    # rounding ties away (it read the neighbour's weights as fp32 bits before: 27.271 for 27.213 under
    # Megatron-LM 0.16.1's pretrain_gpt.py at DP=2)
    for rank in dist_report:
        assert rank["on"]["masters_norm"] == rank["overlap"]["masters_norm"] == rank["reference"]["masters_norm"]


def test_overlap_param_gather_readers_after_an_update_see_the_weights(dist_report):
    # the built-in trainer's evaluation (forward only, through the pre-hooks) and Megatron-LM's
    # --log-params-norm (calc_params_l2_norm, as wrapped), each right after an update
    for rank in dist_report:
        on, overlap = rank["on"], rank["overlap"]
        assert overlap["forward_only_loss"] == on["forward_only_loss"]
        assert overlap["weights_norm"] == on["weights_norm"]


# --reuse-fp32-param with --use-distributed-optimizer at data-parallel size 1: the fold (in process) ...

@pytest.mark.parametrize("n", [1, 2, 3, 7, 12, 13, 64, 101])
@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 1000])
def test_fold_interleaves_the_halves_in_place_and_unfold_undoes_it(n, chunk):
    import torch
    from mindspeed.features.memory.reuse_fp32_param_megatron import fold, unfold
    high, low = torch.randn(n).bfloat16(), torch.randn(n).bfloat16()
    buffer = torch.cat((high, low))
    storage = buffer.untyped_storage().data_ptr()
    fold(buffer, chunk)                     # above `chunk` pairs: swapped quarters, odd sizes peeled
    assert torch.equal(buffer, torch.stack((low, high), dim=1).view(-1)) and buffer.data_ptr() == storage
    unfold(buffer, chunk)
    assert torch.equal(buffer, torch.cat((high, low)))


class _Bucket:
    def __init__(self, data, offset):
        self.param_data, self.offset = data[offset:offset + 6], offset


class _Buffer:
    """What WholeBuffer reads of a DDP buffer: its bf16 param_data (owning its storage), its buckets."""
    def __init__(self, m=12):
        import torch
        self.param_data = torch.randn(m).bfloat16()
        self.buckets = [_Bucket(self.param_data, 0), _Bucket(self.param_data, 6)]


@pytest.mark.parametrize("chunk", [2, 3, None])
def test_whole_buffer_grows_the_storage_under_every_view_and_folds_the_masters_in(chunk):
    import torch
    from mindspeed.features.memory.reuse_fp32_param_distrib import WholeBuffer
    from tests_extend.unit.bf16_rounding import round_ties_away
    buffer = _Buffer()
    weight = buffer.param_data[6:12].view(2, 3)           # a parameter's view, as DDP makes them
    before = buffer.param_data.clone()
    whole = WholeBuffer(buffer, chunk)
    assert buffer.param_data.untyped_storage().nbytes() == 4 * 12 and torch.equal(buffer.param_data, before)
    assert weight.data_ptr() == whole.high[6:].data_ptr()  # the views follow the grown storage
    views = [whole.bucket(b) for b in buffer.buckets]
    masters = torch.randn(12) * 3
    masters.view(torch.int32)[:3] = masters.view(torch.int32)[:3] & -0x10000 | 0x8000       # ties
    views[0].write(0, 6, masters[:6])
    views[1].write(0, 6, masters[6:])
    assert torch.equal(torch.cat([v.read(0, 6) for v in views]), masters)           # exact in the bf16 layout
    assert torch.equal(buffer.param_data, round_ties_away(masters))                  # the bf16 params
    whole.to_fp32()
    assert torch.equal(views[1].fp32, masters[6:]) and torch.equal(whole.fp32, masters)   # the optimizer's view
    whole.fp32.add_(1.0)                                                                  # an update
    whole.to_bf16()
    assert torch.equal(torch.cat([v.read(0, 6) for v in views]), masters + 1.0)
    assert torch.equal(weight.reshape(-1), round_ties_away(masters + 1.0)[6:])


def test_whole_buffer_refuses_parameters_that_do_not_own_their_storage():
    import torch
    from mindspeed.features.memory.reuse_fp32_param_distrib import WholeBuffer
    buffer = _Buffer()
    buffer.param_data = torch.zeros(24, dtype=torch.bfloat16)[:12]        # a view of a larger storage
    with pytest.raises(RuntimeError, match="do not own their storage"):
        WholeBuffer(buffer)


# ... and training where a shard is a whole buffer, 2 processes each (swap_workers.reuse_fp32_param_size_one):
# "pp2": PP 2, data-parallel size 1 (Qwen3's recipe on 2 processes); "moe_ep2": MoE at EP 2, the experts'
# optimizer at expert-data-parallel size 1 chained with the dense one at data-parallel size 2

UNITS = {"pp2": [["WholeBuffer"]], "moe_ep2": [["BucketShard"], ["WholeBuffer"]]}      # per chained optimizer
DATA_PARALLEL_SIZES = {"pp2": [1], "moe_ep2": [2, 1]}


@pytest.fixture(scope="module", params=sorted(swap_workers.SIZE_ONE))
def size_one(request, tmp_path_factory):
    from tests_extend.distributed.harness import run_distributed
    root = str(tmp_path_factory.mktemp("reuse_size_one"))
    return run_distributed(swap_workers.reuse_fp32_param_size_one, world_size=2, args=(root, request.param),
                           timeout=600, daemon=False)


def test_size_one_trains_as_megatron_rounding_ties_away_from_zero(size_one):
    for rank in size_one:
        layout = rank["layout"]
        units = [o["units"] for o in rank["on"]["optimizers"]]
        assert units == UNITS[layout] and [o["units"] for o in rank["recipe"]["optimizers"]] == units
        assert [o["data_parallel_size"] for o in rank["on"]["optimizers"]] == DATA_PARALLEL_SIZES[layout]
        assert all(rank["on"]["attached"]) and not any(rank["off"]["attached"] + rank["reference"]["attached"])
        assert len(rank["on"]["losses"]) == 20 and rank["on"]["losses"] == rank["reference"]["losses"]
        # with Qwen3's --overlap-grad-reduce --overlap-param-gather, folding 100 pairs at a time (the fold's
        # recursive path: the buffers hold over 12,000 elements)
        recipe = rank["recipe"]
        assert recipe["losses"] == rank["on"]["losses"]
        assert [o["fold_chunks"] for o in recipe["optimizers"] if o["data_parallel_size"] == 1] == [[100]]
        assert all(o["bf16_elements"] > 100 * 64 for o in recipe["optimizers"])
        assert rank["masters_bitwise_after_first_update"] == {"reference": True, "on": True, "recipe": True}


def test_size_one_keeps_the_losses_within_bf16_rounding(size_one):
    ties = [sum(counts) for counts in zip(*(rank["off"]["differing_ties"] for rank in size_one))]
    same = losses_before_a_differing_tie(ties)
    for rank in size_one:
        off, on, fp32 = rank["off"]["losses"], rank["on"]["losses"], rank["fp32"]["losses"]
        assert same >= 1 and on[:same] == off[:same]
        assert largest_gap(on, off) <= largest_gap(off, fp32)
        assert off[-1] < off[0] - 1.5


def test_size_one_holds_the_masters_in_4_bytes_per_bf16_parameter(size_one):
    for rank in size_one:
        saved = 0
        for off, on in zip(rank["off"]["optimizers"], rank["on"]["optimizers"], strict=True):
            dp, elements = on["data_parallel_size"], on["bf16_elements"]
            assert off["master_elements"] == on["master_elements"] == elements // dp     # no padding here
            # bf16 buffer + fp32 master shard (2 + 4/DP bytes per bf16 parameter) -> the buffer + the residual
            # (2 + 2/DP); at DP 1 one storage, grown to 4 bytes per element, holds parameters, masters, residual
            assert off["bytes"] == 2 * elements + 4 * elements // dp
            assert on["bytes"] == 2 * elements + 2 * elements // dp
            saved += 2 * elements // dp
        if rank["layout"] == "pp2":
            assert rank["off"]["optimizers"][0]["bytes"] == 6 * rank["off"]["optimizers"][0]["bf16_elements"]
            assert rank["on"]["optimizers"][0]["bytes"] == 4 * rank["on"]["optimizers"][0]["bf16_elements"]
        # every live tensor of the process, each storage once (trainer built, before any update), against
        # the same run without the flag: the master bytes less the residual's (no old master or buffer
        # storage left alive: that would be 4 or 2 bytes per bf16 parameter, tens of KiB here); within
        # 256 bytes: a few small tensors created lazily come and go between runs (seen: 100 bytes once in
        # ten runs; usually exact); "reference" rather than "off", the first run, which also builds what
        # every later run shares
        live = {name: rank[name]["live_bytes_after_build"] for name in ("off", "reference", "on", "recipe")}
        assert abs(live["reference"] - live["on"] - saved) <= 256 and abs(live["recipe"] - live["on"]) <= 256, \
            (saved, live)
        assert saved > 16 * 1024


def test_size_one_masters_read_as_megatron_lm_params_norm_reads_them(size_one):
    # calc_params_l2_norm (--log-params-norm) reads `param.main_param`, here a view of the folded storage:
    # through the wrapper the masters are fp32 values, those of Megatron's optimizer rounding ties away
    for rank in size_one:
        assert rank["on"]["masters_norm"] == rank["recipe"]["masters_norm"] == rank["reference"]["masters_norm"]


def test_size_one_model_only_load_sets_the_masters(size_one):
    for rank in size_one:
        assert all(rank[name]["reloaded_masters_equal_params"] for name in ("off", "reference", "on", "recipe"))


def test_size_one_dummy_step_before_a_load_leaves_masters_and_weights(size_one):
    for rank in size_one:
        assert all(rank[name]["dummy_step_keeps_masters_and_weights"] for name in ("on", "recipe"))


@pytest.mark.parametrize("direction", ["on_to_off", "off_to_on", "recipe_to_off", "off_to_recipe"])
def test_size_one_checkpoints_cross_the_flag(size_one, direction):
    for rank in size_one:
        run = rank["checkpoint"][direction]
        assert run["iteration"] == 2 and run["resumed"] == run["continued"]
