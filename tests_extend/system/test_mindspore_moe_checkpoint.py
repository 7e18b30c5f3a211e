"""MoE checkpoints cross between the trainers: the torch trainer's torch_dist checkpoint
of an MoE GPT with Qwen3-MoE's attention (router, every expert stacked [layer, expert, ...], shared
experts, per-head q/k norms with --kv-channels of their own, Adam's moments) loads into the MindSpore
trainer (with --use-distributed-optimizer: the moments through its flat slices), which saves it
again as a neutral checkpoint holding the same arrays under Megatron's
per-expert and per-layer names; that loads back into the torch trainer, whose torch_dist save then
holds the original arrays bit for bit."""
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("mindspore")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests_extend", "example", "pretrain_gpt.py")
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--eval-iters", "0",
        "--num-experts", "4", "--moe-ffn-hidden-size", "24", "--moe-aux-loss-coeff", "0.01",
        "--moe-shared-expert-intermediate-size", "16", "--train-iters", "2", "--save-interval", "2",
        "--qk-layernorm", "--kv-channels", "16"]


def _run(backend, *extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), WORLD_SIZE="1")
    out = subprocess.run([sys.executable, SCRIPT, *ARGV, "--backend", backend, *extra], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def _torch_dist(path):
    from mindspeed.checkpoint.megatron_read import TorchDistReader
    reader = TorchDistReader(os.path.join(path, "iter_0000002"))
    return {k: reader.get(k).float().numpy() for k in reader.meta
            if ("mlp." in k or "exp_avg" in k or "_layernorm." in k) and "_extra_state" not in k}


def test_moe_checkpoint_crosses_both_ways(tmp_path):
    from mindspeed.checkpoint import neutral as nf
    torch_ckpt, ms_ckpt, back = (str(tmp_path / n) for n in ("torch", "ms", "back"))
    _run("torch", "--save", torch_ckpt)
    # the MindSpore leg with its distributed optimizer: the moments go into its flat slices and back out
    out = _run("mindspore", "--load", torch_ckpt, "--save", ms_ckpt, "--use-distributed-optimizer")
    assert "loaded checkpoint" in out and "(MoE: 4 experts, top-2, EP 1)" in out
    assert "> distributed optimizer: rank 0 keeps" in out
    original = _torch_dist(torch_ckpt)
    model, moments, _ = nf.load(ms_ckpt)
    experts = original["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert experts.shape == (2, 4, 48, 32)
    for i in range(2):
        np.testing.assert_array_equal(model[f"decoder.layers.{i}.mlp.router.weight"],
                                      original["decoder.layers.mlp.router.weight"][i])
        np.testing.assert_array_equal(model[f"decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight"],
                                      original["decoder.layers.mlp.shared_experts.linear_fc2.weight"][i])
        for norm in ("q_layernorm", "k_layernorm"):      # trained: no longer ones
            stacked = original[f"decoder.layers.self_attention.{norm}.weight"]
            assert stacked.shape == (2, 16) and np.abs(stacked - 1).max() > 0
            np.testing.assert_array_equal(model[f"decoder.layers.{i}.self_attention.{norm}.weight"], stacked[i])
            np.testing.assert_array_equal(
                moments[f"exp_avg/decoder.layers.{i}.self_attention.{norm}.weight"],
                original[f"optimizer.state.exp_avg.decoder.layers.self_attention.{norm}.weight"][i])
        for e in range(4):
            np.testing.assert_array_equal(model[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight"],
                                          experts[i, e])
            np.testing.assert_array_equal(
                moments[f"exp_avg_sq/decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight"],
                original["optimizer.state.exp_avg_sq.decoder.layers.mlp.experts.experts.linear_fc2.weight"][i, e])
    _run("torch", "--load", ms_ckpt, "--save", back)
    again = _torch_dist(back)
    assert set(again) == set(original)
    for key, value in original.items():
        np.testing.assert_array_equal(again[key], value, err_msg=key)
