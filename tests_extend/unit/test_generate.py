"""python -m mindspeed.generate on converted Hugging Face models: greedy tokens equal to
transformers' generate for tiny Llama and Qwen2 models (built here, no download) at TP1 (one
process) and TP2 (torchrun, 2 processes); every bad input refused in one line before any work."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mindspeed.net import free_port
from tests_extend.unit import convert_kit as kit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOS = kit.VOCAB - 1                       # write_tokenizer_json's last token
NEW_TOKENS = 24
# prompts under which each random model's greedy continuation varies (not one token repeated)
PROMPTS = {"llama": [42, 93, 96, 47, 64, 21, 11, 76], "qwen2": [14, 31, 81, 84, 48, 94, 28, 91]}
LAUNCH_TIMEOUT = 300


def _model(root, kind: str) -> dict:
    hf, tok = str(root / "hf"), root / "tokenizer"
    kit.make_hf_model(hf, kind, tied=kind == "qwen2")
    tok.mkdir()       # beside no config.json: a plain fast tokenizer (a Qwen2 one would add a token)
    kit.write_tokenizer_json(str(tok / "tokenizer.json"), kit.VOCAB)
    with open(tok / "tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}, f)
    # the directory for one model, its tokenizer.json for the other: both ways of naming it
    dirs = {"hf": hf, "tok": str(tok) if kind == "llama" else str(tok / "tokenizer.json")}
    for tp in (1, 2):
        dirs[f"tp{tp}"] = str(root / f"mg_tp{tp}")
        kit.convert("--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf",
                    "qwen2" if kind == "qwen2" else "llama2", *(["--add-qkv-bias"] if kind == "qwen2" else []),
                    "--target-tensor-parallel-size", str(tp), "--load-dir", hf, "--save-dir", dirs[f"tp{tp}"])
    return dirs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {kind: _model(tmp_path_factory.mktemp(kind), kind) for kind in PROMPTS}


def _hf_greedy(hf_dir: str, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=EOS, pad_token_id=EOS)
    return out[0, len(prompt):].tolist()


def _generate(load: str, tokenizer: str, prompt: str, out_json: str, nproc: int = 1, extra=()):
    cmd = [sys.executable, "-m", "mindspeed.generate"]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port()), "-m", "mindspeed.generate"]
    cmd += ["--load", load, "--tokenizer-model", tokenizer, "--prompt", prompt,
            "--max-new-tokens", str(NEW_TOKENS), "--output-json", out_json, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_greedy_tokens_equal_transformers_at_tp1_and_tp2(kind, models, tmp_path):
    dirs, prompt = models[kind], PROMPTS[kind]
    expected = _hf_greedy(dirs["hf"], prompt)
    assert len(set(expected)) >= 8, expected        # a continuation that can tell two models apart
    text = " ".join(f"w{i}" for i in prompt)
    for tp in (1, 2):
        out = str(tmp_path / f"tp{tp}.json")
        result = _generate(dirs[f"tp{tp}"], dirs["tok"], text, out, nproc=tp)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "tokens/s (the lean decoder)" in result.stdout
        with open(out) as f:
            answer = json.load(f)
        assert answer["prompt"] == text
        assert answer["tokens"] == expected, f"TP{tp}"
        assert answer["text"] == " ".join(f"w{i}" for i in expected if i != EOS)


# --- refusals: one line, exit 2, before any process group ---------------------------------------

def _refusal(capsys, *argv) -> str:
    from mindspeed.generate.cli import main
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_bad_inputs_are_refused_in_one_line(models, tmp_path, capsys):
    llama = models["llama"]
    tok = llama["tok"]
    assert "does not exist" in _refusal(capsys, "--load", str(tmp_path / "nowhere"), "--tokenizer-model", tok,
                                        "--prompt", "w1")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "run_flags.json" in _refusal(capsys, "--load", str(empty), "--tokenizer-model", tok, "--prompt", "w1")
    odd = tmp_path / "vocab.txt"
    odd.write_text("w0 w1\n")
    assert "not a tokenizer file" in _refusal(capsys, "--load", llama["tp1"], "--tokenizer-model", str(odd),
                                              "--prompt", "w1")
    assert "does not exist" in _refusal(capsys, "--load", llama["tp1"], "--tokenizer-model",
                                        str(tmp_path / "tok.json"), "--prompt", "w1")
    long_prompt = " ".join(["w3"] * 64)          # the converted model's context is 64 positions
    assert "sequence length is 64" in _refusal(capsys, "--load", llama["tp1"], "--tokenizer-model", tok,
                                               "--prompt", long_prompt)
    assert "--task chat" in _refusal(capsys, "--load", llama["tp1"], "--tokenizer-model", tok, "--prompt", "w1",
                                     "--temperature", "0.5")
    assert "give one of them" in _refusal(capsys, "--load", llama["tp1"], "--tokenizer-model", tok, "--prompt", "w1",
                                          "--task", "chat", "--top-k", "5", "--top-p", "0.9")
    assert "--prompt" in _refusal(capsys, "--load", llama["tp1"], "--tokenizer-model", tok,
                                  "--output-json", str(tmp_path / "o.json"))
    assert "unrecognized arguments" in _refusal(capsys, "--load", llama["tp1"], "--tokenizer-model", tok,
                                                "--max-new-token", "3")
