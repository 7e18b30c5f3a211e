"""msrun worker (2 processes, TP=2) for the conversion tests: the MindSpore trainer loads converted
checkpoints -- torch_dist converted for a TP2 x PP2 target, and a neutral copy with q/k/v biases --
and trains the biased one. Usage: msrun ... convert_ms_worker.py OUT_DIR TOKENS.npy LLAMA_MG QWEN_MG"""
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import end_worker, write_result  # noqa: E402


def main(out_dir, tokens_path, llama_mg, qwen_mg):
    import numpy as np
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from tests_extend.unit import convert_kit as kit
    backend = MindSporeBackend("cpu")
    rank = backend.comm.rank()
    try:
        tokens = np.load(tokens_path)
        # torch_dist without optimizer state, loaded with the optimizer wanted (no --no-load-optim)
        llama = kit.ms_load(llama_mg, backend, tp=2, world_size=2, train=True)
        qwen = kit.ms_load(qwen_mg, backend, tp=2, world_size=2, train=True)
        np.save(os.path.join(out_dir, f"llama_rank{rank}.npy"), kit.ms_logits(llama.model, tokens))
        np.save(os.path.join(out_dir, f"qwen_rank{rank}.npy"), kit.ms_logits(qwen.model, tokens))
        losses, bias = kit.ms_train_steps(qwen, tokens)
        np.save(os.path.join(out_dir, f"qwen_bias_rank{rank}.npy"), bias)
        write_result(out_dir, rank, {"ok": True, "losses": losses})
    except Exception:
        write_result(out_dir, rank, {"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
    main(*sys.argv[1:5])
    end_worker()
