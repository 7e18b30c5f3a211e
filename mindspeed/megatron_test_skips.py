"""Megatron-Core unit tests (core_v0.16.1, `tests/unit_tests`) that MindSpeed skips on a device
without CUDA, each with its reason: what the test needs and what a user loses there.

Keys are test names as pytest writes them from a Megatron-LM checkout's root, without the
parameters in brackets. A listed test still runs, so Megatron's own skip conditions (its skipif
marks and the skips inside its tests) keep the last word; it is reported skipped with its reason
only when it fails with the failure its reason names (`Reason.signature`), and any other failure
stays a failure. A test that needs Transformer Engine is listed only while Megatron itself reports
TE absent (`HAVE_TE` in megatron.core.models.gpt.gpt_layer_specs). Tests that need more processes
than the run has are skipped apart from this list (more_ranks_needed, RANKS), saying how to run them;
tests too large for a CPU unit-test run (TOO_LARGE) are not run.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Reason:
    text: str                   # what the test needs and what a user loses without it
    signature: tuple            # the failure it shows without that (any of these in the error)
    needs_te: bool = True       # listed only while Megatron reports Transformer Engine absent

UNIT = "tests/unit_tests/"
ATTENTION = UNIT + "transformer/test_attention.py::TestParallelAttention::"
NO_ROPE = UNIT + "transformer/test_attention_no_rope.py::TestParallelAttentionWithNoRope::"
PACKED = UNIT + "transformer/test_attention_packed_seq.py::TestParallelAttentionWithPackedSequence::"
PACKED_PADDED = UNIT + "transformer/test_attention_packed_seq.py::TestParallelAttentionWithPackedPaddedSequence::"
DSA = UNIT + "transformer/test_attention_variant_dsa.py::"
BLOCK = UNIT + "transformer/test_transformer_block.py::TestParallelTransformerBlock::"
LAYER = UNIT + "transformer/test_transformer_layer.py::TestParallelTransformerLayer::"
CUSTOM_PGS = UNIT + "transformer/test_transformer_block_custom_pgs.py::TestTransformerBlockWithProcessGroups::"

CP_ATTENTION = Reason("builds the TE layer spec with context parallelism; without Transformer Engine its "
                      "attention is Megatron's DotProductAttention, which refuses context parallelism, so on "
                      "CPU a user loses Megatron's TE context-parallel attention (MindSpeed's own: "
                      "--context-parallel-size with --context-parallel-algo)",
                      ("Context parallelism is only supported by TEDotProductAttention",))
PACKED_ATTENTION = Reason("runs packed sequences (packed_seq_params) through the TE layer spec's attention; "
                          "without Transformer Engine that is Megatron's DotProductAttention, which refuses "
                          "them, so on CPU a user loses Megatron's packed-sequence attention (MindSpeed's own "
                          "packed documents: --reset-attention-mask)",
                          ("Packed sequence is not supported by DotProductAttention",))
TE_FP8_CHECKPOINT = Reason("recomputes an FP8 block with Transformer Engine's checkpoint (te_checkpoint, None "
                           "without TE); on CPU a user loses FP8 training, which needs TE on a GPU with FP8",
                           ("'NoneType' object is not callable",))
TE_MODULES = Reason("builds Transformer Engine modules (TELinear, TENorm, TELayerNormColumnParallelLinear) "
                    "directly, which are stand-ins without TE; on CPU a user loses those CUDA-only layers",
                    ("Mock object has no attribute", "not enough values to unpack (expected 2, got 0)"))
TE_FP8 = Reason("reads Transformer Engine's FP8 state (FP8GlobalStateManager); on CPU a user loses FP8 "
                "training, which needs TE on a GPU with FP8 support", ("FP8GlobalStateManager",))
CUDA_GRAPHS = Reason("needs torch's CUDA-graph-safe RNG (cudagraphs); on CPU a user loses CUDA graphs, "
                     "which exist only on CUDA", ("cudagraphs with RNG",), needs_te=False)
CUDA_TENSOR = Reason("asserts that its output is a CUDA tensor; the same forward on CPU is checked by the "
                     "file's test_cpu_forward, so a user loses nothing", ("== 'cuda'",), needs_te=False)
PHILOX_OFFSETS = Reason("asserts that the grouped experts' second weight (drawn after all experts' first) equals "
                        "the first expert's second weight (drawn after that expert's first alone): on CUDA each "
                        "normal_ call advances the Philox offset by the same amount for both sizes, the CPU "
                        "generator draws sequentially; a user loses nothing (both inits draw from the same "
                        "distribution, and the first weights match)", ("<built-in method equal",), needs_te=False)
NO_TRITON = Reason("calls one of Megatron's Triton kernels, which without triton installed Megatron's no-op "
                   "decorator leaves uncallable; `pip install triton` (its CPU interpreter runs the kernel, "
                   "MindSpeed sets TRITON_INTERPRET=1 on a CPU), without it a user loses that fused kernel",
                   ("'_GeneratorContextManager' object is not subscriptable",), needs_te=False)
TE_VERSION_ERROR = Reason("asserts the error Transformer Engine 1.7-1.10 itself raises when Megatron passes it "
                          "rng_tracker_name (TE's Linear does not take it; the test mocks TE's version); without "
                          "TE nothing raises, so a user on CPU loses nothing", ("DID NOT RAISE",))
NCCL_ALLOCATOR = Reason("builds Megatron's NCCL memory-pool allocator, a CUDA C++ extension (CUDA_HOME); on CPU a "
                        "user loses NCCL user-buffer registration, which exists only with NCCL on a GPU",
                        ("CUDA_HOME environment variable is not set",), needs_te=False)

TE_LAYERS_BATCH_INVARIANT = Reason(
    "checks Transformer Engine's own layers (TEColumnParallelLinear, TERowParallelLinear, TENorm, "
    "TELayerNormColumnParallelLinear) and TE's GEMM in Megatron's batch-invariant mode; they exist only with TE "
    "on a GPU, so on CPU a user loses TE's batch-invariant layers (Megatron's own ColumnParallelLinear case in "
    "the same file runs)", ("Mock object has no attribute", "No module named 'transformer_engine'",
                            "Transformer Engine is not installed", "StopIteration"))
TE_RADIO_NORM = Reason("builds the RADIO-g vision encoder, whose final norm Megatron's LLaVA takes from Transformer "
                       "Engine by name (TENorm); on CPU a user loses that encoder (CLIP's and the other encoders "
                       "build and run)", ("when instantiating TENorm",))
CUDA_STATE = Reason("moves the optimizer's state to CUDA and asserts that it is on CUDA (the state is a reference to "
                    "the inner optimizers', which the file's other checks see on CPU); a user loses nothing",
                    (".is_cuda",), needs_te=False)
LLAVA = UNIT + "models/test_llava_model.py::"
TE_BATCH_INVARIANT = UNIT + "transformer/test_te_layers_batch_invariant.py::"

SKIPS: dict[str, Reason] = {
    **{TE_BATCH_INVARIANT + name: TE_LAYERS_BATCH_INVARIANT for name in (
        "test_te_column_parallel_linear_batch_invariant_randomized",
        "test_te_row_parallel_linear_batch_invariant_randomized",
        "test_te_layernorm_column_parallel_linear_batch_invariant_randomized",
        "test_te_norm_batch_invariant_randomized", "test_te_column_parallel_linear_parity",
        "test_te_rmsnorm_parity", "test_te_layernorm_linear_parity")},
    LLAVA + "TestLLaVAModel::test_forward": PACKED_ATTENTION,
    LLAVA + "TestLLaVAModelVisionEncoders::test_constructor": TE_RADIO_NORM,
    LLAVA + "TestLLaVAModelVisionEncoders::test_set_input_tensor": TE_RADIO_NORM,
    UNIT + "test_optimizer.py::test_chained_optimizer": CUDA_STATE,
    **{cls + name: PACKED_ATTENTION for cls in (PACKED, PACKED_PADDED) for name in (
        "test_gpu_forward", "test_checkpointed_gpu_forward")},
    BLOCK + "test_gpu_forward_full_checkpoint_fp8": TE_FP8_CHECKPOINT,
    CUSTOM_PGS + "test_fwd_bwd_pass_non_uniform_transformer_block": TE_MODULES,
    CUSTOM_PGS + "test_mlp_with_custom_pgs": TE_MODULES,
    DSA + "TestDSAIndexer::test_dsa_indexer_constructor": TE_MODULES,
    DSA + "TestDSAttention::test_dsa_constructor": TE_MODULES,
    UNIT + "tensor_parallel/test_random.py::test_checkpoint_without_output": TE_FP8,
    UNIT + "tensor_parallel/test_random.py::test_double_fork_cuda_rng_states_tracker": CUDA_GRAPHS,
    UNIT + "tensor_parallel/test_random.py::test_convert_cuda_rng_state": CUDA_GRAPHS,
    UNIT + "transformer/test_multi_token_prediction.py::TestMultiTokenPredictionLayer::test_constructor_ues_te":
        CP_ATTENTION,
    UNIT + "models/test_base_embedding.py::TestBaseEmbedding::test_gpu_forward": CUDA_TENSOR,
    UNIT + "transformer/moe/test_multihot_indices_converter.py::TestIndicesToMultihot::test_indices_to_multihot":
        NO_TRITON,
    UNIT + "transformer/moe/test_grouped_mlp.py::TestParallelGroupedMLP::test_weight_init_value_the_same":
        PHILOX_OFFSETS,
    UNIT + "models/test_bert_model.py::TestBertModelAttentionDimensions::"
           "test_transformer_engine_version_1_7_to_1_10_rng_error": TE_VERSION_ERROR,
    UNIT + "test_nccl_allocator.py::TestNCCLAllocator::test_nccl_allocator_init_sets_env_vars": NCCL_ALLOCATOR,
}

#: tests that need at least this many processes, where the need does not show as parallel_state's
#: "world_size (1) is not divisible by N" (the test itself expects a failure only a larger world gives)
RANKS: dict[str, int] = {
    UNIT + "test_parallel_state.py::test_initialize_and_destroy_model_parallel": 8,
    UNIT + "test_parallel_state.py::test_different_initialize_order_unconsistency": 8,
    # asserts that rank 0's changed parameters disagree with the other data-parallel replicas'
    UNIT + "test_utils.py::test_cross_check_param_hashes_across_dp_replicas": 2,
    # assert that a bf16 reduce-scatter differs from one accumulated in fp32: a sum of two bf16 values
    # rounds once either way (Megatron's CI runs 8 ranks); keys with parameters name those cases only
    **{UNIT + "distributed/test_reduce_scatter_with_fp32_accumulation.py::TestReduceScatterWithFP32Accumulation::"
       f"test_reduce_scatter_with_fp32_accumulation[False-{async_op}]": 4 for async_op in ("True", "False")},
}

#: tests a CPU runs, but not in the time a unit test has: not run, with what they need. Keys carry
#: the parameters (the other parametrizations need more devices, which Megatron's test skips itself)
_TWO_BLOCKS = ("builds two 4096-wide 3-layer transformer blocks (about 1.2 B bf16 parameters) and runs both "
               "forward and backward: more than the 300 s a test has on a CPU, and at 2 processes (where the "
               "plugin's device count lets its 2-rank cases run) about 11 GB of memory per rank, more than a "
               "24 GB machine holds for two; the check it makes (a block on custom process groups matches one "
               "on Megatron's own) is not run there")
TOO_LARGE: dict[str, str] = {
    CUSTOM_PGS + f"test_params_and_grads_match_transformer_block[{case}]": _TWO_BLOCKS
    for case in ("1-1-1-1", "2-1-2-1", "2-2-1-1")
}

#: tests that cannot pass without CUDA and, failing on one rank, would leave the others waiting in a
#: collective: not run, with what they need
CUDA_ONLY: dict[str, str] = {
    UNIT + "test_utils.py::test_straggler_detector":
        "asks Megatron's straggler detector's HTTP controller on rank 0 to switch it on (the other ranks then "
        "wait in its report's collective); Megatron configures the detector off without CUDA (it times with "
        "CUDA events), so on CPU a user loses --log-straggler",
}

# "Data parallel size ..." and "Expert data parallel size should be divisible by partial DistOpt shard factor"
_SHARD_FACTOR = "ata parallel size should be divisible by partial DistOpt shard factor"
# HyperCommGrid's "Grid shape [2, 1, 1, 4] is over sized with world size 1 and rank offset 0"
_GRID = re.compile(r"Grid shape \[([\d, ]+)\] is over sized with world size (\d+)")
# torch's DeviceMesh: "Mesh should not be bigger than default world size 1, but found 8 ranks!"
_MESH = re.compile(r"Mesh should not be bigger than default world size (\d+), but found (\d+) ranks")
# gloo's "ProcessGroupGloo::broadcast: invalid root rank: 6" (a test's source rank, for 8 GPUs)
_ROOT = re.compile(r"ProcessGroupGloo::\w+: invalid root rank: (\d+)")
# parallel_state's "world_size (1) is not divisible by 8" and "... by <name> size (8)"; the hybrid
# (Mamba) models' "world size (1) is not divisible by total_model_size (total_model_size=2)"
_DIVISIBLE = re.compile(r"world[_ ]size \((\d+)\) is not divisible by "
                        r"(?:[\w-]+ size \(|total_model_size \(total_model_size=)?(\d+)")


def base_name(nodeid: str) -> str:
    """A pytest node id as written from the checkout's root, without its parameters."""
    name = nodeid.split("[", 1)[0]
    start = name.find(UNIT)
    return name[start:] if start >= 0 else name


def ranks_advice(need: int, world_size: int) -> str:
    return (f"needs {need} processes (a multiple of {need}), the run has {world_size}: "
            f"torchrun --nproc_per_node {need} -m pytest -p mindspeed.pytest_plugin ...")


def more_ranks_needed(message: str, world_size: int) -> str | None:
    """The skip reason for a test that failed asking for more processes than the run has, else None."""
    match = _DIVISIBLE.search(message)
    if match is not None and int(match.group(1)) == world_size:
        return ranks_advice(int(match.group(2)), world_size)
    if _SHARD_FACTOR in message:          # --num-distributed-optimizer-instances > the data-parallel size
        return (f"needs a data-parallel size (the experts' with expert parallelism) that is a multiple of its "
                f"distributed-optimizer instances, more processes than the run's {world_size}: torchrun "
                f"--nproc_per_node {2 * world_size} (or a multiple of the instances times the expert-parallel "
                f"size) -m pytest -p mindspeed.pytest_plugin ...")
    root = _ROOT.search(message)          # a collective from a rank this world lacks
    if root is not None and int(root.group(1)) >= world_size:
        need = int(root.group(1)) + 1
        return (f"needs at least {need} processes (a collective from rank {need - 1}), the run has {world_size}: "
                f"torchrun --nproc_per_node {need} (or more) -m pytest -p mindspeed.pytest_plugin ...")
    grid = _GRID.search(message)          # HyperCommGrid: its shape's product is the ranks it spans
    if grid is not None and int(grid.group(2)) == world_size:
        return ranks_advice(math.prod(int(n) for n in grid.group(1).split(",")), world_size)
    mesh = _MESH.search(message)          # a DeviceMesh over more ranks (Megatron-FSDP's fully_shard tests)
    if mesh is not None and int(mesh.group(1)) == world_size:
        return ranks_advice(int(mesh.group(2)), world_size)
    return None


def skip_before_running(nodeid: str, world_size: int) -> str | None:
    """Why this test is not run at all in this run (too few processes, too large), or None."""
    need = RANKS.get(base_name(nodeid)) or RANKS.get(nodeid[max(nodeid.find(UNIT), 0):])
    if need and world_size < need:
        return ranks_advice(need, world_size)
    if base_name(nodeid) in CUDA_ONLY:
        return f"MindSpeed skip list: {CUDA_ONLY[base_name(nodeid)]}"
    too_large = TOO_LARGE.get(nodeid[max(nodeid.find(UNIT), 0):])
    return f"MindSpeed skip list: {too_large}" if too_large else None


def listed_failure(nodeid: str, message: str, te_present: bool) -> str | None:
    """The skip reason when a listed test failed the way its reason says, else None (a failure)."""
    reason = SKIPS.get(base_name(nodeid))
    if reason is None or (reason.needs_te and te_present):
        return None
    if not any(signature in message for signature in reason.signature):
        return None
    return f"MindSpeed skip list: {reason.text}"


def te_name_used(exception_type: str, message: str) -> str | None:
    """The skip reason for a test that used a Transformer Engine name its module imported at its top
    (the plugin's stand-in, mindspeed/backends/torch/te_import_standin.py, raises), else None."""
    if exception_type != "TransformerEngineAbsent":
        return None
    return (f"MindSpeed: needs Transformer Engine ({message.split(':', 1)[0]}), which is not installed; "
            f"on CPU a user loses TE's CUDA layers and FP8")


#: failures that say a package this Python cannot install is missing, whichever test shows them
UNINSTALLABLE = {
    "Emerging Optimizers is not installed": (
        "needs emerging-optimizers (Megatron-Core's Muon and layer-wise optimizers), whose one release "
        "requires Python >= 3.12 (this is Python 3.11): a user here loses --optimizer muon / dist_muon, "
        "which MindSpeed refuses in one line"),
    # Megatron's "fused_topk_with_score_function is not available. Please install TE >= 2.6.0." and its kin
    "is not available. Please install TE": (
        "needs one of Transformer Engine's fused kernels (the MoE router's fused top-k, --moe-router-fusion, "
        "and its kin), which exist only with TE on a GPU: a user here loses that fusion"),
    "MambaSSM is not installed": (
        "needs mamba-ssm (Megatron-Core's Mamba layers), whose selective-scan kernels are CUDA-only (it "
        "builds only against CUDA): a user here loses Megatron's Mamba and hybrid models"),
}


def uninstallable_package(message: str) -> str | None:
    """The skip reason for a test that failed on a package this Python cannot install, else None."""
    for signature, reason in UNINSTALLABLE.items():
        if signature in message:
            return f"MindSpeed skip list: {reason}"
    return None
