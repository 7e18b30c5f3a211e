"""msrun worker for the parity test: TP=2, TP=2 with sequence parallelism, CP=2 (Ulysses, ring
attention and the KV all-gather, through the context-parallel feature), TP=2 with --use-ascend-coc with and
without sequence parallelism, TP=2 with full recompute, CP=2 with selective recompute, from the same
initial checkpoint; CP=2 with the documents' mask as the general mask; GELU + LayerNorm + learned positions at TP=2
with SP from the trainer's init; and --qk-layernorm at TP=2, with and without SP, from QK_INIT (its checkpoint
saved to OUT_DIR/ms_qk).
Usage: msrun ... mindspore_parity_worker.py OUT_DIR INIT_CKPT QK_INIT"""
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import end_worker, write_result  # noqa: E402

SHORT_STEPS = 4   # SP on top of TP=2, and CP=2: shorter runs keep CI time down
COC_STEPS = 3     # CoC runs PyNative (slower than the traced graph); 3 steps: 2 updates checked
# 16 rows in 2 chunks without SP; 8 rows per rank in 4 chunks with SP (interleaved gathers)
COC = {"tp2_coc": (False, "2"), "tp2_sp_coc": (True, "4")}


def main(out_dir, init_ckpt, qk_init):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from tests_extend.distributed.mindspore_parity import ms_train
    backend = MindSporeBackend("cpu")
    rank = backend.comm.rank()
    try:
        result = {"tp2": ms_train(backend, 2, False, init_ckpt),
                  "tp2_sp": ms_train(backend, 2, True, init_ckpt, steps=SHORT_STEPS)}
        for algo in ("ulysses_cp_algo", "megatron_cp_algo", "kvallgather_cp_algo"):
            result[f"cp2_{algo}"] = ms_train(backend, 1, False, init_ckpt, steps=SHORT_STEPS, cp=2, cp_algo=algo)
        from mindspeed.features.parallel import coc_mindspore
        for name, (sp, chunks) in COC.items():
            coc_mindspore.CALLS.update(column=0, row=0)
            result[name] = ms_train(backend, 2, sp, init_ckpt, steps=COC_STEPS,
                                    extra=("--use-ascend-coc", "--coc-parallel-num", chunks))
            result[name]["calls"] = dict(coc_mindspore.CALLS)
        # full recompute at TP=2 (PyNative): MindSpore's early stop used to break on the TP taps
        result["tp2_recompute_full"] = ms_train(backend, 2, False, init_ckpt, steps=COC_STEPS, extra=(
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"))
        from tests_extend.distributed.mindspore_parity_model import ms_combined_tp2_sp, ms_cp2_selective_recompute
        result["tp2_sp_gelu_layernorm_learned"] = ms_combined_tp2_sp(backend)      # the model variants
        result["cp2_selective_recompute"] = ms_cp2_selective_recompute(backend, init_ckpt)
        from tests_extend.distributed.mindspore_parity_eod import ms_documents
        result["cp2_general_documents"] = ms_documents(backend, init_ckpt, cp=2)
        from tests_extend.distributed.mindspore_parity_model import ms_qk_tp2
        result["tp2_qk"] = ms_qk_tp2(backend, qk_init, os.path.join(out_dir, "ms_qk"))
        result["tp2_sp_qk"] = ms_qk_tp2(backend, qk_init, None, sp=True)
        write_result(out_dir, rank, {"ok": True, **result})
    except Exception:
        write_result(out_dir, rank, {"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
    end_worker()
