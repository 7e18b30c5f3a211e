"""The checkpoint-conversion commands of a MindSpeed-LLM user guide for Qwen2.5, run as the guide
writes them (only its paths moved under a temporary directory) on tiny Qwen2.5-shaped models: bf16
safetensors with q/k/v biases, tied embeddings like Qwen2.5-0.5B, untied and GQA heads that TP4
divides like Qwen2.5-7B. hf->mg keeps the guide's `--model-type-hf llama2` (Qwen2 is the Llama layout
plus q/k/v biases); the way back writes into the original model's mg2hg/ and touches nothing else."""
from __future__ import annotations

import json
import os
import shlex
import shutil

import pytest
import torch

from tests_extend.unit import convert_kit as kit
from tests_extend.unit.test_convert_refusals import run_cli

TOL = 1e-4
TOKENS = torch.randint(0, kit.VOCAB, (2, 12), generator=torch.Generator().manual_seed(11))

# the guide's commands, character for character (its shell comment included)
GUIDE_HF_TO_MG = {
    "0.5b": r"""python convert_ckpt.py \
       --use-mcore-models \
       --model-type GPT \
       --load-model-type hf \
       --save-model-type mg \
       --target-tensor-parallel-size 2 \
       --target-pipeline-parallel-size 2 \
       --add-qkv-bias \
       --load-dir /root/llm_dataset/models/Qwen/Qwen2.5-0.5B \
       --save-dir /root/llm_dataset/models/mindspeed/qwen2.5_mcore/qwen2.5_0.5b/ \
       --tokenizer-model /root/llm_dataset/models/Qwen/Qwen2.5-0.5B/tokenizer.json \
       --model-type-hf llama2 \
       --params-dtype bf16 # --num-layer-list 11, 13, 19, 21 参数根据需要添加""",
    "7b": r"""python convert_ckpt.py \
       --use-mcore-models \
       --model-type GPT \
       --load-model-type hf \
       --save-model-type mg \
       --target-tensor-parallel-size 4 \
       --target-pipeline-parallel-size 2 \
       --add-qkv-bias \
       --load-dir /home/ma-user/work/models/Qwen/Qwen2.5-7B \
       --save-dir /home/ma-user/work/models/mindspeed/qwen2.5_mcore/qwen2.5_7b/ \
       --tokenizer-model /home/ma-user/work/models/Qwen/Qwen2.5-7B/tokenizer.json \
       --model-type-hf llama2 \
       --params-dtype bf16 # --num-layer-list 11, 13, 19, 21 参数根据需要添加""",
}
# mcore -> hf as the guide describes it: the flags above with TP and PP 1, mg -> hf, and --save-dir the
# original Hugging Face model (the weights land in its mg2hg/)
GUIDE_MG_TO_HF = {
    "0.5b": r"""python convert_ckpt.py --use-mcore-models --model-type GPT --load-model-type mg --save-model-type hf \
       --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1 --add-qkv-bias \
       --load-dir /root/llm_dataset/models/mindspeed/qwen2.5_mcore/qwen2.5_0.5b/ \
       --save-dir /root/llm_dataset/models/Qwen/Qwen2.5-0.5B \
       --tokenizer-model /root/llm_dataset/models/Qwen/Qwen2.5-0.5B/tokenizer.json \
       --model-type-hf llama2 --params-dtype bf16""",
    "7b": r"""python convert_ckpt.py --use-mcore-models --model-type GPT --load-model-type mg --save-model-type hf \
       --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1 --add-qkv-bias \
       --load-dir /home/ma-user/work/models/mindspeed/qwen2.5_mcore/qwen2.5_7b/ \
       --save-dir /home/ma-user/work/models/Qwen/Qwen2.5-7B \
       --model-type-hf llama2 --params-dtype bf16""",
}
# the guide's models, tiny: (its path prefix, name, tied embeddings, heads, key/value heads, the target TP)
MODELS = {"0.5b": ("/root/llm_dataset/models", "Qwen2.5-0.5B", True, 4, 2, 2),
          "7b": ("/home/ma-user/work/models", "Qwen2.5-7B", False, 8, 4, 4)}


def guide_argv(command: str, root) -> list[str]:
    """The converter's arguments of a guide command, as a shell splits it, its paths under `root`."""
    for prefix, *_ in MODELS.values():
        command = command.replace(prefix, str(root) + prefix)
    words = shlex.split(command.replace("\\\n", " "), comments=True)
    assert words[:2] == ["python", "convert_ckpt.py"], words
    return words[2:]


def hf_dir(root, model: str) -> str:
    prefix, name = MODELS[model][:2]
    return f"{root}{prefix}/Qwen/{name}"


def mg_dir(root, model: str) -> str:
    argv = guide_argv(GUIDE_HF_TO_MG[model], root)
    return argv[argv.index("--save-dir") + 1]


def snapshot(directory: str) -> dict[str, bytes]:
    """Every file under `directory` (relative path -> content)."""
    files = {}
    for base, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, directory)] = f.read()
    return files


def make_guide_model(directory: str, tied: bool, heads: int, kv_heads: int) -> None:
    """A tiny Qwen2.5 as the Hub ships it: bf16 safetensors, q/k/v biases, its tokenizer.json."""
    kit.make_hf_model(directory, "qwen2", tied=tied, dtype=torch.bfloat16, num_attention_heads=heads,
                      num_key_value_heads=kv_heads)
    kit.write_tokenizer_json(os.path.join(directory, "tokenizer.json"), kit.VOCAB)


@pytest.fixture(scope="module")
def guide(tmp_path_factory):
    """Both models converted by the guide's hf->mg commands, and their Hugging Face logits."""
    root = tmp_path_factory.mktemp("guide")
    refs = {}
    for model, (_, _, tied, heads, kv_heads, _) in MODELS.items():
        make_guide_model(hf_dir(root, model), tied, heads, kv_heads)
        rc, err = run_cli(*guide_argv(GUIDE_HF_TO_MG[model], root))
        assert rc == 0, err
        refs[model] = kit.hf_logits(hf_dir(root, model), TOKENS)
    return root, refs


@pytest.mark.parametrize("model", sorted(MODELS))
def test_guide_hf_to_mg_gives_hugging_face_logits(guide, model):
    """The trainer's model, loaded from the converted bf16 checkpoint by the trainer's loader (at TP1:
    torch_dist holds global tensors), computing in fp32, gives Hugging Face's fp32 logits."""
    from mindspeed.checkpoint.megatron_read import open_checkpoint
    from mindspeed.convert.sidecar import read_info
    root, refs = guide
    tied, tp = MODELS[model][2], MODELS[model][5]
    info = read_info(mg_dir(root, model))
    assert (info["target_tensor_parallel_size"], info["target_pipeline_parallel_size"]) == (tp, 2)
    assert info["params_dtype"] == "bf16" and "--bf16" in info["trainer_flags"]
    assert ("--untie-embeddings-and-output-weights" in info["trainer_flags"]) == (not tied)
    reader = open_checkpoint(mg_dir(root, model))
    assert reader.get("embedding.word_embeddings.weight").dtype == torch.bfloat16
    assert reader.shape("embedding.word_embeddings.weight")[0] == 128 * tp   # padded for the target TP
    assert reader.has("output_layer.weight") == (not tied)
    logits = kit.tp1_logits(mg_dir(root, model), TOKENS, extra=("--make-vocab-size-divisible-by", str(128 * tp)),
                            fp32=True)
    assert (logits[..., :kit.VOCAB] - refs[model]).abs().max() <= TOL


@pytest.mark.parametrize("model", sorted(MODELS))
def test_guide_mg_to_hf_writes_mg2hg_and_leaves_the_model_alone(guide, model, tmp_path):
    """The way back into the original model's mg2hg/: every tensor bit for bit, Hugging Face's logits,
    the model's own files byte for byte; run again, it refuses and changes nothing. For 7B the
    checkpoint has no hf_config/ (as one the trainer saved): the config is read from --save-dir."""
    root, refs = guide
    hf = hf_dir(root, model)
    argv = guide_argv(GUIDE_MG_TO_HF[model], root)
    if model == "7b":
        trained = str(tmp_path / "trained")
        shutil.copytree(mg_dir(root, model), trained, ignore=shutil.ignore_patterns("hf_config"))
        argv[argv.index("--load-dir") + 1] = trained
    before = snapshot(hf)
    rc, err = run_cli(*argv)
    assert rc == 0, err
    after = snapshot(hf)
    assert {k: v for k, v in after.items() if not k.startswith("mg2hg" + os.sep)} == before
    back = os.path.join(hf, "mg2hg")
    want, got = kit.read_safetensors(hf), kit.read_safetensors(back)
    assert sorted(want) == sorted(got) and all(torch.equal(got[n], t) and got[n].dtype == t.dtype
                                               for n, t in want.items())
    for name in ("config.json", "tokenizer.json"):
        assert after[os.path.join("mg2hg", name)] == before[name]
    assert (kit.hf_logits(back, TOKENS) - refs[model]).abs().max() <= TOL
    # again: mg2hg/ is there and not empty, so nothing is written
    rc, err = run_cli(*argv)
    assert rc == 1 and err.count("\n") == 1 and "mg2hg already exists and is not an empty directory" in err, err
    assert snapshot(hf) == after


def _variant(root, model: str, tmp_path, **config) -> list[str]:
    """The guide's hf->mg command for a copy of `model` whose config.json has `config` changed."""
    copy = tmp_path / "models" / "Qwen" / MODELS[model][1]
    shutil.copytree(hf_dir(root, model), copy, ignore=shutil.ignore_patterns("mg2hg"))
    data = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**data, **config}))
    argv = guide_argv(GUIDE_HF_TO_MG[model], root)
    argv[argv.index("--load-dir") + 1] = str(copy)
    argv[argv.index("--save-dir") + 1] = str(tmp_path / "out" / "mg")
    return argv


def _assert_refused(argv, needle, out, status=1):
    rc, err = run_cli(*argv)
    assert rc == status and err.count("\n") == 1 and needle in err, err
    assert not os.path.exists(out), "something was written"


def _without_qkv_bias(argv):
    return [a for a in argv if a != "--add-qkv-bias"]


def _layer_list_with_spaces(argv):
    # the guide's commented-out "--num-layer-list 11, 13, 19, 21", as the shell splits it
    return argv + ["--num-layer-list", "11,", "13,", "19,", "21"]


# case -> (model, config.json changes, command change, what the one line says, exit status)
REFUSALS = {
    "no --add-qkv-bias for a model with biases": (
        "7b", {}, _without_qkv_bias, "has q/k/v biases (Qwen2-style): add --add-qkv-bias", 1),
    "a config whose architecture is not the Llama layout": (
        "7b", {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, None,
        "config.json model_type 'qwen3' (Qwen3ForCausalLM) does not match: --model-type-hf llama2 converts "
        "model_type 'llama' or 'qwen2' (convert it with --model-type-hf qwen3)", 1),
    "untied config, tied weights": ("0.5b", {"tie_word_embeddings": False}, None,
                                    "tie_word_embeddings false (untied) but", 1),
    "tied config, untied weights": ("7b", {"tie_word_embeddings": True}, None,
                                    "has an lm_head.weight that differs from model.embed_tokens.weight", 1),
    "the guide's layer list with spaces": ("7b", {}, _layer_list_with_spaces, "write it without spaces", 2),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_guide_command_refusals(guide, tmp_path, case):
    model, config, edit, needle, status = REFUSALS[case]
    argv = _variant(guide[0], model, tmp_path, **config)
    _assert_refused(edit(argv) if edit else argv, needle, tmp_path / "out", status)


def test_tied_config_with_a_copy_of_the_embedding_as_lm_head(guide, tmp_path):
    """Some exports of a tied model also write lm_head.weight, a copy of the embedding: that converts.
    The copy is compared a few rows at a time, to its last element."""
    from safetensors.torch import save_file
    from mindspeed.checkpoint.megatron_read import open_checkpoint
    from mindspeed.convert.arch import arch_from_config, read_config
    from mindspeed.convert.hf_io import HFReader
    from mindspeed.convert.hf_to_mg import check_tied_embeddings
    from mindspeed.errors import ConvertError
    argv = _variant(guide[0], "7b", tmp_path, tie_word_embeddings=True)
    copy = argv[argv.index("--load-dir") + 1]
    arch = arch_from_config(read_config(copy), "llama2", True)
    tensors = kit.read_safetensors(copy)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["lm_head.weight"][-1, -1] += 1
    save_file(tensors, os.path.join(copy, "model.safetensors"))
    reader = HFReader(copy)
    with pytest.raises(ConvertError, match="differs from"):
        check_tied_embeddings(reader, arch, rows_at_once=7)
    reader.close()
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, os.path.join(copy, "model.safetensors"))
    rc, err = run_cli(*argv)
    assert rc == 0, err
    assert not open_checkpoint(str(tmp_path / "out" / "mg")).has("output_layer.weight")


def test_mg_to_hf_refuses_a_tied_config_for_an_untied_checkpoint(guide, tmp_path):
    """The 7B checkpoint has its own output layer: a config that ties the embeddings would drop it."""
    root = guide[0]
    copy = tmp_path / "Qwen2.5-7B"
    shutil.copytree(hf_dir(root, "7b"), copy, ignore=shutil.ignore_patterns("mg2hg"))
    data = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**data, "tie_word_embeddings": True}))
    argv = guide_argv(GUIDE_MG_TO_HF["7b"], root)
    argv[argv.index("--save-dir") + 1] = str(copy)
    before = snapshot(str(copy))
    rc, err = run_cli(*argv)
    assert rc == 1 and err.count("\n") == 1 and "has its own output_layer" in err, err
    assert snapshot(str(copy)) == before
