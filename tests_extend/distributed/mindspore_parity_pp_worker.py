"""msrun worker for test_mindspore_parity_pp.py: PP=2 (1F1B over 4 micro-batches) from the torch
initial checkpoint, saving the trained model, untied and tied; the interleaved schedule (4 layers, 2 chunks
per stage, tied), saved; the unaligned pipeline's matrix on the same 4 layers, saved; 2 steps with --optimizer sgd, saved; 3 steps with each
recompute method; 4 steps of micro-batches of 4 lengths with --variable-seq-lengths; EOD_STEPS steps
of packed documents with --reset-attention-mask. Usage: msrun ... mindspore_parity_pp_worker.py OUT_DIR INIT_CKPT SAVE_DIR"""
import contextlib
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import end_worker, write_result  # noqa: E402

RECOMPUTE = {"pp2_selective": ("--recompute-granularity", "selective"),
             "pp2_block1": ("--recompute-granularity", "full", "--recompute-method", "block",
                            "--recompute-num-layers", "1")}


@contextlib.contextmanager
def counted_recompute():
    """The backend's recompute (the real one), its calls counted."""
    from mindspeed.backends.mindspore.memory import MsMemory
    real, calls = MsMemory.recompute, []

    def recompute(self, fn, *args):
        calls.append(1)
        return real(self, fn, *args)

    MsMemory.recompute = recompute
    try:
        yield calls
    finally:
        MsMemory.recompute = real


def main(out_dir, init_ckpt, save_dir):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from tests_extend.distributed import mindspore_parity_eod as pe
    from tests_extend.distributed import mindspore_parity_pp as mpp
    from tests_extend.distributed.mindspore_parity_pp import ms_train_pp
    backend = MindSporeBackend("cpu")
    rank = backend.comm.rank()
    try:
        result = {"pp2": ms_train_pp(backend, 2, init_ckpt, save_dir)}
        # tied embeddings (Megatron's default): the last stage's output layer is a copy of the first's
        result["pp2_tied"] = ms_train_pp(backend, 2, init_ckpt + "_tied", save_dir + "_tied", tied=True)
        # the interleaved schedule: 4 layers, 2 model chunks of 1 layer per stage, tied embeddings
        result["pp2_vpp"] = ms_train_pp(backend, 2, init_ckpt + "_vpp", save_dir + "_vpp", tied=True,
                                        extra=mpp.VPP_FLAGS, layers=mpp.VPP_LAYERS)
        # the unaligned pipeline: the same 4 layers as upstream's matrix [[0,2],[1,1]] (E|t|tt|tL)
        result["pp2_unaligned"] = ms_train_pp(backend, 2, init_ckpt + "_vpp", save_dir + "_unaligned", tied=True,
                                              steps=mpp.UNALIGNED_STEPS, extra=mpp.UNALIGNED_FLAGS, layers=mpp.VPP_LAYERS)
        # SGD's state (a momentum buffer) saved from both stages too: 2 steps are enough to check
        result["pp2_sgd"] = ms_train_pp(backend, 2, init_ckpt, save_dir + "_sgd", steps=2,
                                        extra=("--optimizer", "sgd"))
        # micro-batches of 4 lengths: the stages exchange each activation's length first
        result["pp2_variable"] = ms_train_pp(backend, 2, init_ckpt + "_variable", steps=mpp.VARIABLE_STEPS,
                                             extra=("--variable-seq-lengths",), batches=mpp.variable_micro_batches)
        # packed documents: each stage builds its layers' document mask from the micro-batch
        result["pp2_eod"] = ms_train_pp(backend, 2, init_ckpt + "_eod", steps=mpp.EOD_STEPS,
                                        extra=pe.DOCUMENT_FLAGS, batches=mpp.eod_micro_batches,
                                        held_out=lambda: mpp.eod_micro_batches(0)[:1])
        for name, flags in RECOMPUTE.items():      # recompute within each stage, 3 steps
            with counted_recompute() as calls:
                result[name] = dict(ms_train_pp(backend, 2, init_ckpt, steps=3, extra=flags), recompute_calls=calls)
        write_result(out_dir, rank, {"ok": True, **result})
    except Exception:
        write_result(out_dir, rank, {"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
    main(*sys.argv[1:4])
    end_worker()
