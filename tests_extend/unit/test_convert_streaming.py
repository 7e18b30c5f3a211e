"""hf->mg streams: a model converts with far less memory than its size (the trainer's model is
built on the meta device, each torch_dist chunk and neutral-copy array is made from one decoder
layer's Hugging Face tensors just before it is written, and those are read with plain file reads)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tests_extend.unit import convert_kit as kit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_hf_to_mg_peak_memory_is_a_fraction_of_the_model(tmp_path):
    """A 212 MiB fp32 model (hidden 512, 16 layers) converts to torch_dist plus the neutral copy in a
    fresh process whose peak RSS grows by less than half the model (measured: ~55 MiB; keeping every
    layer, or reading the Hugging Face file through a memory map: 435 / 260 MiB)."""
    hf, mg = str(tmp_path / "hf"), str(tmp_path / "mg")
    size = kit.write_plain_llama(hf, hidden=512, layers=16, ffn=1408, vocab=4096)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests_extend.unit.convert_memory_worker", hf, mg,
                           "--neutral-copy"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0
    assert result["growth"] < size / 2, (f"peak RSS grew by {result['growth'] / 2**20:.0f} MiB converting a "
                                         f"{size / 2**20:.0f} MiB model")
    # what was written is the model (tensor k of the Hugging Face file holds the value k)
    from mindspeed.convert.hf_io import HFReader
    from mindspeed.checkpoint.megatron_read import NeutralReader, TorchDistReader
    directory = os.path.join(mg, "iter_0000000")
    hf_reader = HFReader(hf)
    fc1 = torch.cat([hf_reader.get(f"model.layers.13.mlp.{x}_proj.weight") for x in ("gate", "up")])
    for reader in (TorchDistReader(directory), NeutralReader(directory)):
        assert torch.equal(reader.get_layer("mlp.linear_fc1.weight", 13), fc1)
        assert torch.equal(reader.get("output_layer.weight"), hf_reader.get("lm_head.weight"))
    hf_reader.close()
