"""msrun worker for the parity test: TP=2, TP=2 with sequence parallelism, and CP=2 (Ulysses and
ring attention, through the context-parallel feature), from the same initial checkpoint. Usage: msrun ... mindspore_parity_worker.py OUT_DIR INIT_CKPT"""
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import write_result  # noqa: E402

SHORT_STEPS = 4   # SP on top of TP=2, and CP=2: shorter runs keep CI time down


def main(out_dir, init_ckpt):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from tests_extend.distributed.mindspore_parity import ms_train
    backend = MindSporeBackend("cpu")
    rank = backend.comm.rank()
    try:
        result = {"tp2": ms_train(backend, 2, False, init_ckpt),
                  "tp2_sp": ms_train(backend, 2, True, init_ckpt, steps=SHORT_STEPS)}
        for algo in ("ulysses_cp_algo", "megatron_cp_algo"):
            result[f"cp2_{algo}"] = ms_train(backend, 1, False, init_ckpt, steps=SHORT_STEPS, cp=2, cp_algo=algo)
        write_result(out_dir, rank, {"ok": True, **result})
    except Exception:
        write_result(out_dir, rank, {"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
