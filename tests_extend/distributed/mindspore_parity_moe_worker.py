"""msrun worker for the MoE parity test: EP=2 on 2 processes (DP=2, each rank its own batches),
from the initial checkpoint; the trained weights saved (experts gathered from both EP ranks); then
3 steps with the MoE communication features from the same checkpoint; then TP=2 with sequence
parallelism and --moe-tp-extend-ep (whole experts over the two TP ranks), saved to SAVE_DIR_TP,
and 3 steps of it with the MoE communication features; then TP=2 without it (every expert split over
TP) with the mixtral recipe's MoE flags for TP_SHARDED_STEPS steps, saved to OUT_DIR/TP_SHARDED_CKPT; then EP=2 with --bf16 for BF16_STEPS steps
from a bf16-representable checkpoint; then EP=2 with --use-distributed-optimizer, saved after
ZERO_STEPS steps and resumed from there for ZERO_STEPS more, and TP=2 extended with it; then EP=2 with
the allgather dispatcher for 3 steps; then PP=2
(each stage one MoE layer, shared experts) for PP_STEPS steps from the shared-experts checkpoint, saved
to SAVE_DIR_PP; then EP=2 with one MTP layer (an MoE layer) and DeepSeek-V3's router for MTP_EP2_STEPS
steps from MTP_INIT_CKPT.
Usage: msrun ... mindspore_parity_moe_worker.py OUT_DIR INIT_CKPT SAVE_DIR SAVE_DIR_TP BF16_INIT_CKPT
       SHARED_INIT_CKPT SAVE_DIR_PP MTP_INIT_CKPT"""
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import end_worker, write_result  # noqa: E402


# short (the dense bf16 test carries the 20-step claim), but long enough for bf16's effect on torch to
# stand above fp32 parity's 1e-4: measured 1.1e-4 over 6 steps, 5.7e-4 over 10
BF16_STEPS = 10
# the distributed optimizer at EP=2: ZERO_STEPS steps, saved, and ZERO_STEPS more resumed from that checkpoint
ZERO_STEPS = 3
# MoE at PP=2: the 1F1B stages carry the MoE layers and their load-balancing losses' gradients
PP_STEPS = 4
# MoE at TP=2 without --moe-tp-extend-ep (every expert split over TP, mixtral's layout): steps, and where it saves
TP_SHARDED_STEPS, TP_SHARDED_CKPT = 4, "ckpt_tp_sharded"
# MTP's MoE layer at EP=2 (issue 55): the emulated all-to-all carries its tokens as the decoder's
MTP_EP2_STEPS = 2


def zero_runs(backend, out_dir, init_ckpt) -> dict:
    """EP=2 with --use-distributed-optimizer: ZERO_STEPS steps from the initial weights, saved with
    the sharded state, then resumed from that checkpoint for ZERO_STEPS more; TP=2 with
    --moe-tp-extend-ep and the flag for ZERO_STEPS steps."""
    from tests_extend.distributed.mindspore_parity_moe import ms_train
    ckpt, zero = os.path.join(out_dir, "ckpt_zero"), ("--use-distributed-optimizer",)
    first = ms_train(backend, 2, False, init_ckpt, save_dir=ckpt, steps=ZERO_STEPS, extra=zero)
    return {"ep2_zero": first, "ep2_zero_resumed": ms_train(backend, 2, False, ckpt, steps=ZERO_STEPS, extra=zero,
                                                            resume=True),
            "tp2_extend_zero": ms_train(backend, 1, False, init_ckpt, steps=ZERO_STEPS, tp=2, extra=zero)}


def main(out_dir, init_ckpt, save_dir, save_dir_tp, bf16_init_ckpt, shared_init_ckpt, save_dir_pp, mtp_init_ckpt):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from tests_extend.distributed.mindspore_parity_moe import (COMM_FLAGS, MIXTRAL_FLAGS, MTP_FLAGS, ROUTER_FLAGS,
                                                               ms_train)
    backend = MindSporeBackend("cpu")
    rank = backend.comm.rank()
    try:
        write_result(out_dir, rank, {"ok": True, "ep2": ms_train(backend, 2, False, init_ckpt, save_dir=save_dir),
                                     "comm_features": ms_train(backend, 2, False, init_ckpt, steps=3,
                                                               extra=COMM_FLAGS),
                                     "tp2_extend": ms_train(backend, 1, False, init_ckpt, save_dir=save_dir_tp, tp=2),
                                     "tp2_extend_comm": ms_train(backend, 1, False, init_ckpt, steps=3, tp=2,
                                                                 extra=COMM_FLAGS),
                                     "tp2_sharded": ms_train(backend, 1, False, init_ckpt, steps=TP_SHARDED_STEPS,
                                                             tp=2, extend=False, extra=MIXTRAL_FLAGS,
                                                             save_dir=os.path.join(out_dir, TP_SHARDED_CKPT)),
                                     "ep2_allgather": ms_train(backend, 2, False, init_ckpt, steps=3,
                                                               extra=("--moe-token-dispatcher-type", "allgather")),
                                     "ep2_bf16": ms_train(backend, 2, False, bf16_init_ckpt, steps=BF16_STEPS,
                                                          extra=("--bf16",)),
                                     **zero_runs(backend, out_dir, init_ckpt),
                                     "pp2": ms_train(backend, 1, True, shared_init_ckpt, save_dir=save_dir_pp,
                                                     steps=PP_STEPS, pp=2),
                                     "ep2_mtp": ms_train(backend, 2, True, mtp_init_ckpt, steps=MTP_EP2_STEPS,
                                                         extra=ROUTER_FLAGS + MTP_FLAGS)})
    except Exception:
        write_result(out_dir, rank, {"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
    main(*sys.argv[1:9])
    end_worker()
