"""The converter refuses unusable input in one line, before anything is written, and never leaves
a half-written --save-dir."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from tests_extend.unit import convert_kit as kit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    kit.make_hf_model(str(root / "llama"), "llama", num_hidden_layers=2)
    kit.make_hf_model(str(root / "qwen"), "qwen2", tied=True, num_hidden_layers=2)
    return root


def run_cli(*argv: str) -> tuple[int, str]:
    """(exit status, stderr) of the converter's command line run in this process."""
    from mindspeed.convert.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(list(argv))
        except SystemExit as exc:
            rc = exc.code
    return rc, err.getvalue()


def hf_to_mg(models, model: str, save: str, *extra: str) -> list[str]:
    return ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(models / model),
            "--save-dir", save, *extra]


def assert_refused(models, tmp_path, argv, needle, status=1):
    rc, err = run_cli(*argv)
    assert rc == status, err
    assert err.count("\n") == 1 and needle in err, err
    assert os.listdir(tmp_path) == [], "something was written"


CASES = {
    "missing load dir": (lambda m, s: ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                                       str(m / "nope"), "--save-dir", s], "does not exist"),
    "qkv bias flag on llama": (lambda m, s: hf_to_mg(m, "llama", s, "--add-qkv-bias"), "has no q/k/v biases"),
    "qwen without qkv bias flag": (lambda m, s: hf_to_mg(m, "qwen", s, "--model-type-hf", "qwen2"),
                                   "add --add-qkv-bias"),
    "model type mismatch": (lambda m, s: hf_to_mg(m, "llama", s, "--model-type-hf", "qwen2"),
                            "model_type 'llama' (LlamaForCausalLM) does not match: --model-type-hf qwen2"),
    "heads not divisible by TP": (lambda m, s: hf_to_mg(m, "llama", s, "--target-tensor-parallel-size", "3"),
                                  "not divisible by --target-tensor-parallel-size 3"),
    "layer list sum": (lambda m, s: hf_to_mg(m, "llama", s, "--target-pipeline-parallel-size", "2",
                                             "--num-layer-list", "1,3"), "does not split the model's 2 layers"),
    "layer list length": (lambda m, s: hf_to_mg(m, "llama", s, "--num-layer-list", "1,1"), "has 2 entries"),
    "save dir under a file": (lambda m, s: hf_to_mg(m, "llama", str(m / "llama" / "config.json" / "mg")),
                              "config.json is not a directory"),
    "mg->hf of a directory that is no checkpoint": (
        lambda m, s: ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(m / "llama"),
                      "--save-dir", s, "--hf-config", str(m / "llama")], "latest_checkpointed_iteration.txt"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_in_one_line(models, tmp_path, case):
    argv, needle = CASES[case]
    assert_refused(models, tmp_path, argv(models, str(tmp_path / "out")), needle)


def test_config_not_matching_the_weights(models, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(models / "llama"):
        os.symlink(models / "llama" / name, bad / name)
    config = json.loads((models / "llama" / "config.json").read_text())
    config["intermediate_size"] = 128
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    out.mkdir()
    rc, err = run_cli("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(bad),
                      "--save-dir", str(out / "mg"))
    assert rc == 1 and err.count("\n") == 1 and "config.json implies" in err, err
    assert os.listdir(out) == []


def test_truncated_safetensors_file(models, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((models / "llama" / "config.json").read_bytes())
    data = (models / "llama" / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:len(data) // 2])
    out = tmp_path / "out"
    out.mkdir()
    rc, err = run_cli("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(bad),
                      "--save-dir", str(out / "mg"))
    assert rc == 1 and err.count("\n") == 1 and "not a readable safetensors file" in err, err
    assert os.listdir(out) == []


def test_existing_save_dir_is_not_overwritten(models, tmp_path):
    (tmp_path / "mg").mkdir()
    (tmp_path / "mg" / "keep.txt").write_text("mine")
    rc, err = run_cli(*hf_to_mg(models, "llama", str(tmp_path / "mg")))
    assert rc == 1 and "already exists" in err and err.count("\n") == 1, err
    assert os.listdir(tmp_path / "mg") == ["keep.txt"]


@pytest.mark.parametrize("save_dir", ["mg", "new/parents/mg"])
def test_failure_while_writing_leaves_no_save_dir(models, tmp_path, monkeypatch, save_dir):
    """Nothing is left: no partial --save-dir, no temporary directory, no parent created for it."""
    from mindspeed.convert import megatron_write

    def broken(root, *args, **kwargs):
        open(os.path.join(root, "half-written"), "w").close()
        raise OSError("disk full")
    monkeypatch.setattr(megatron_write, "write_megatron", broken)
    with pytest.raises(OSError):
        run_cli(*hf_to_mg(models, "llama", str(tmp_path / save_dir)))
    assert os.listdir(tmp_path) == [], "a partial --save-dir (or its temporary directory) was left"


def test_unknown_flag_suggests_the_known_one(tmp_path):
    # the real entry point, as a user types it
    proc = subprocess.run([sys.executable, os.path.join(REPO, "convert_ckpt.py"), "--load-model-type", "hf",
                           "--save-model-type", "mg", "--load-dir", "x", "--save-dir", str(tmp_path / "o"),
                           "--target-tensor-paralel-size", "2"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "unknown flag --target-tensor-paralel-size (did you mean --target-tensor-parallel-size?)" in proc.stderr
    assert os.listdir(tmp_path) == []


def test_misspelt_required_flag_is_named_as_unknown():
    rc, err = run_cli("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", "x", "--save-dirr", "y")
    assert rc == 2 and err.count("\n") == 1 and "unknown flag --save-dirr (did you mean --save-dir?)" in err, err


def test_missing_required_flag_is_one_line():
    rc, err = run_cli("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", "x")
    assert rc == 2 and err.count("\n") == 1 and "--save-dir" in err, err
