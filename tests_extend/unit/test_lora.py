"""LoRA on the torch trainer (--lora-target-modules, --lora-r, --lora-alpha, --lora-load) at TP 1, at
TP 2 and at TP 2 with --sequence-parallel, in real gloo processes: only the adapters train,
checkpoints hold only them, a resume continues exactly, merged weights give the unmerged model's
logits, and mg->hf with --lora-load gives a Hugging Face model with the same logits. Refusals are
checked without a process group."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests_extend.distributed.harness import run_distributed
from tests_extend.unit import convert_kit as kit
from tests_extend.unit import lora_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_base")
    hf, mg = str(root / "hf"), str(root / "mg")
    kit.make_hf_model(hf)
    kit.convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf, "--save-dir", mg,
                "--model-type-hf", "llama2")
    return hf, mg


@pytest.fixture(scope="module", params=[(1, ()), (2, ()), (2, ("--sequence-parallel",))],
                ids=["tp1", "tp2", "tp2-sp"])
def lora_run(request, base_model, tmp_path_factory):
    world, extra = request.param
    root = tmp_path_factory.mktemp(f"lora_tp{world}")
    lora_dir, logits_file = str(root / "lora"), str(root / "logits.pt")
    reports = run_distributed(lora_workers.lora_report, world_size=world,
                              args=(base_model[1], lora_dir, logits_file, extra), timeout=600, daemon=False)
    return {"report": reports[0], "reports": reports, "lora_dir": lora_dir, "logits": torch.load(logits_file),
            "root": root}


def test_only_the_adapters_train(lora_run):
    for r in lora_run["reports"]:
        assert r["adapters"] == 2 * 4 * len(TARGETS)          # A and B, 4 layers, every target
        assert r["trainable"] == r["adapter_names"]
        assert r["optimizer_holds_only_adapters"] and r["optimizer_params"] == r["adapters"]
        assert r["base_changed"] == []                         # bit-identical after the steps
        assert r["adapters_unchanged"] == []
        assert r["losses"][-1] < r["losses"][0]


def test_the_checkpoint_holds_only_the_adapters(lora_run):
    from mindspeed.checkpoint import torch_dist
    from mindspeed.checkpoint.scan import iteration_dir
    keys = set(torch_dist.read_index(iteration_dir(lora_run["lora_dir"], lora_workers.STEPS)).state_dict_metadata)
    model_keys = {k for k in keys if not k.startswith("optimizer.")}
    assert model_keys == {f"decoder.layers.{t}.lora.{m}" for t in TARGETS for m in "AB"}
    assert all(".lora." in k for k in keys)
    assert torch_dist.read_common(lora_run["lora_dir"])["lora"] == {
        "r": 4, "alpha": 8.0, "target_modules": ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]}


def test_lora_load_resumes_exactly(lora_run):
    r = lora_run["report"]
    assert tuple(r["resumed_at"]) == (lora_workers.STEPS, 2 * lora_workers.STEPS)
    assert r["resumed_logits_diff"] == 0.0
    assert r["resumed_next_loss"] == r["next_loss"]


def test_merged_weights_give_the_unmerged_logits(lora_run):
    r = lora_run["report"]
    assert r["merged"] == 4 * len(TARGETS)
    assert r["merge_diff"] <= 1e-5 * max(1.0, r["merge_scale"])


def test_merged_checkpoint_converts_to_hugging_face(lora_run, base_model):
    out = str(lora_run["root"] / "merged_hf")
    kit.convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", base_model[1],
                "--lora-load", lora_run["lora_dir"], "--lora-r", "4", "--save-dir", out, "--model-type-hf", "llama2")
    logits = lora_run["logits"]
    assert lora_run["report"]["lora_moved_logits"] > 0.1      # the adapters matter to what is compared
    hf = kit.hf_logits(out, logits["tokens"])
    assert torch.allclose(hf, logits["trained"][..., :hf.shape[-1]], atol=1e-4, rtol=0)
    base_hf = kit.hf_logits(base_model[0], logits["tokens"])
    assert torch.allclose(base_hf, logits["base"][..., :hf.shape[-1]], atol=1e-4, rtol=0)


def _convert_error(*argv: str) -> str:
    from mindspeed.convert.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(list(argv)) == 1
    return err.getvalue()


def test_wrong_checkpoints_and_settings_are_refused_in_one_line(lora_run, base_model, tmp_path):
    from mindspeed.errors import CheckpointError
    from mindspeed.training.pretrain import check_lora_checkpoints
    lora_dir, mg = lora_run["lora_dir"], base_model[1]
    args = lora_workers.trainer_args(mg, 1)
    part = type("Part", (), {"settings": {"r": 4, "alpha": 8.0, "target_modules": sorted(
        ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])}})
    check_lora_checkpoints(args, part)                            # as the worker ran: accepted
    args.lora_load = lora_dir
    check_lora_checkpoints(args, part)
    for load, lora_load, message in ((lora_dir, None, "holds only LoRA adapters: give it as --lora-load"),
                                     (mg, mg, "holds no LoRA adapters")):
        args.load, args.lora_load = load, lora_load
        with pytest.raises(CheckpointError, match=re.escape(message)):
            check_lora_checkpoints(args, part)
    args.save = args.lora_load = str(tmp_path / "first_run")     # --save X --lora-load X, X still empty
    check_lora_checkpoints(args, part)
    assert args.lora_load is None and "no adapters yet" in args.load_note
    args.load, args.lora_load = mg, lora_dir
    part.settings = dict(part.settings, r=8)
    with pytest.raises(CheckpointError, match="holds adapters with r 4, alpha 8 on linear_fc1"):
        check_lora_checkpoints(args, part)

    common = ("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg, "--model-type-hf", "llama2")
    assert "--lora-r does not match the adapters" in _convert_error(
        *common, "--lora-load", lora_dir, "--lora-r", "8", "--save-dir", str(tmp_path / "a"))
    assert "--lora-target-modules does not match" in _convert_error(
        *common, "--lora-load", lora_dir, "--lora-target-modules", "linear_qkv", "--save-dir", str(tmp_path / "b"))
    assert "give them with --lora-load" in _convert_error(*common, "--lora-alpha", "8", "--save-dir", str(tmp_path / "c"))
    assert "holds no LoRA adapters" in _convert_error(*common, "--lora-load", mg, "--save-dir", str(tmp_path / "d"))


@pytest.mark.parametrize("argv, message", [
    (["--lora-fusion"], "--lora-fusion (CCLoRA"),
    (["--lora-r", "0"], "--lora-r must be >= 1"),
    (["--lora-alpha", "0"], "--lora-alpha must be > 0"),
    (["--num-experts", "4"], "adapters on MoE experts are not implemented"),
    (["--backend", "mindspore"], "MindSpore trainer's GPT has no adapter layers"),
    (["--use-ascend-coc", "--tensor-model-parallel-size", "2", "--coc-parallel-num", "2"], "ascend-coc"),
])
def test_flags_lora_cannot_honour_are_refused(argv, message):
    from mindspeed.adaptor_core import MindSpeedConfigError, plan
    with pytest.raises(MindSpeedConfigError, match=re.escape(message)):
        plan(["--lora-target-modules", "linear_fc1", *argv])
    with pytest.raises(MindSpeedConfigError, match="no effect without"):
        plan(["--lora-r", "8"])
    assert "lora" in [f.id for f in plan(["--lora-target-modules", "linear_qkv"]).features]


def test_megatron_lm_scripts_refuse_lora_in_one_line():
    """Megatron-LM's validate_args hook refuses it: its checkpointing would save the whole model."""
    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.megatron_lm import MegatronLMHooks
    state = mindspeed.adapt(["--device", "cpu"])
    try:
        hooks = MegatronLMHooks(state, msadapter=False)
        with pytest.raises(SystemExit, match=re.escape("MindSpeed: --lora-target-modules linear_qkv: LoRA runs "
                                                       "on the built-in torch trainer")):
            hooks._after_megatron(parse_args(["--lora-target-modules", "linear_qkv", "--mock-data"], world_size=1))
    finally:
        mindspeed.unadapt()


def test_unadapt_restores_megatron_linears():
    import mindspeed
    from megatron.core.tensor_parallel import layers
    names = [(cls, m) for cls in (layers.ColumnParallelLinear, layers.RowParallelLinear)
             for m in ("forward", "sharded_state_dict")]
    before = [vars(cls)[m] for cls, m in names]
    mindspeed.adapt(["--device", "cpu", "--lora-target-modules", "linear_qkv"])
    try:
        assert all(vars(cls)[m] is not b for (cls, m), b in zip(names, before))
    finally:
        mindspeed.unadapt()
    assert all(vars(cls)[m] is b for (cls, m), b in zip(names, before))


# --- generation and evaluation with --lora-load (python -m mindspeed.generate / evaluate) -------------

PROMPT = "w42 w93 w96 w47 w64 w21 w11 w76"     # the base model's greedy continuation varies (test_generate)


@pytest.fixture(scope="module")
def served(lora_run, base_model, tmp_path_factory):
    """At TP 1 (one TP size is enough: the adapters' resharding is tested above): a tokenizer, a
    dataset in its words, and the model that mg->hf with --lora-load merges, converted back (hf->mg)."""
    if len(lora_run["reports"]) != 1:
        pytest.skip("generation and evaluation with adapters are checked on the TP 1 run")
    from mindspeed.data.__main__ import main as preprocess
    root = tmp_path_factory.mktemp("lora_served")
    tok = root / "tokenizer"
    tok.mkdir()
    kit.write_tokenizer_json(str(tok / "tokenizer.json"), kit.VOCAB)
    (tok / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}')
    # 1000 documents: the default --split 949,50,1 gives each split some
    words = torch.randint(0, kit.VOCAB - 1, (1000, 24), generator=torch.Generator().manual_seed(3))
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": " ".join(f"w{i}" for i in doc)}) + "\n"
                                             for doc in words.tolist()))
    with contextlib.redirect_stdout(io.StringIO()):
        assert preprocess(["--input", str(root / "docs.jsonl"), "--tokenizer-name-or-path", str(tok),
                           "--output-prefix", str(root / "data")]) == 0
    merged_hf, merged_mg = str(root / "merged_hf"), str(root / "merged_mg")
    kit.convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", base_model[1],
                "--lora-load", lora_run["lora_dir"], "--save-dir", merged_hf, "--model-type-hf", "llama2")
    kit.convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", merged_hf,
                "--save-dir", merged_mg, "--model-type-hf", "llama2")
    return {"tok": str(tok), "data": str(root / "data_text_document"), "merged": merged_mg,
            "base": base_model[1], "lora": lora_run["lora_dir"]}


def _entry(tmp_path, module: str, name: str, *argv: str) -> dict:
    """`python -m mindspeed.<module> ARGV --output-json ...`: what it wrote."""
    out = tmp_path / f"{name}.json"
    result = subprocess.run([sys.executable, "-m", f"mindspeed.{module}", *argv, "--output-json", str(out)],
                            cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_generate_with_lora_load_answers_as_the_merged_model(served, tmp_path):
    """The adapters applied on load (--load BASE --lora-load LORA) give the merged model's tokens,
    not the base model's."""
    def tokens(name, *load):
        return _entry(tmp_path, "generate", name, *load, "--tokenizer-model", served["tok"], "--prompt", PROMPT,
                      "--max-new-tokens", "16")["tokens"]
    adapted = tokens("adapted", "--load", served["base"], "--lora-load", served["lora"], "--lora-r", "4")
    assert adapted == tokens("merged", "--load", served["merged"])
    assert adapted != tokens("base", "--load", served["base"])


def test_evaluate_with_lora_load_gives_the_merged_models_loss(served, tmp_path):
    def loss(name, *load):
        return _entry(tmp_path, "evaluate", name, *load, "--data-path", served["data"], "--eval-iters", "2")["loss"]
    adapted = loss("adapted", "--load", served["base"], "--lora-load", served["lora"])
    assert adapted == pytest.approx(loss("merged", "--load", served["merged"]), rel=1e-5)
    assert abs(adapted - loss("base", "--load", served["base"])) > 1e-3


def test_generate_refuses_lora_mixups_in_one_line(served, tmp_path, capsys):
    from mindspeed.checkpoint import run_flags
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.generate.cli import main
    base, lora = served["base"], served["lora"]
    # what a LoRA run writes beside its adapters
    run_flags.write(str(tmp_path / "lora_save"), parse_args([*lora_workers.LORA, "--load", base]), "torch")
    for argv, words in [
            (["--load", str(tmp_path / "lora_save")],
             f"holds a LoRA run's adapters only: give the base model as --load ({base})"),
            (["--load", base, "--lora-load", lora, "--lora-r", "8"],
             f"--lora-r does not match the adapters in {lora}, which have 4"),
            (["--load", base, "--lora-load", base], "holds no LoRA adapters"),
            (["--load", base, "--lora-alpha", "8"],
             "--lora-alpha describes LoRA adapters: give them with --lora-load")]:
        assert main([*argv, "--tokenizer-model", served["tok"], "--prompt", "w1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err
