"""The converter and Megatron-LM's legacy per-rank checkpoints (--ckpt-format torch), GroupedMLP's fused
expert weights (--moe-grouped-gemm) and MindSpeed-LLM's --enable-hf2mg-convert, on tiny models built with
transformers (random weights):

- hf->mg --ckpt-format torch at TP2, PP2 and EP2: the trainer's own legacy loader takes each rank's file at
  those sizes (two gloo processes) and gives transformers' logits within 1e-4; what the trainer then saves
  in both formats converts back (mg->hf) to the same files, bit for bit, and to the original model.
- --moe-grouped-gemm (Qwen3-MoE, Mixtral; bf16): a legacy checkpoint with weight1/weight2 loads into
  Megatron-Core's GroupedMLP, whose own torch_dist save converts back bit for bit (its weights are the
  experts'), as does its legacy save; the experts run as separate MLPs in fp32 from that torch_dist
  give transformers' logits within 1e-4.
- one-line refusals: a legacy folder missing a rank's file, grouped weights converted without
  --moe-grouped-gemm and separate ones with it, and the flags' misuse.
- --enable-hf2mg-convert: a run that converts --load's Hugging Face model itself gives the losses of a
  run loading the same conversion made first (legacy format, trained 2 steps), and saves what converts back.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import shutil

import pytest
import torch

from tests_extend.distributed.harness import run_distributed
from tests_extend.unit import convert_kit as kit
from tests_extend.unit.test_convert_families import FAMILIES, TOKENS, _assert_same_hf, _close, _convert_hf_to_mg, \
    _mg_to_hf
from tests_extend.unit.test_convert_refusals import run_cli

pytest.importorskip("transformers")
TOL = 1e-4
# (model type, TP, PP, EP) the two processes load the legacy conversion at and save again
LAYOUTS = [("qwen3", 2, 1, 1), ("qwen3", 1, 2, 1), ("qwen3-moe", 1, 1, 2), ("qwen3-moe", 2, 1, 1)]
GROUPED = ["--moe-grouped-gemm", "--params-dtype", "bf16"]


def _hf(root, model_type: str, dtype=torch.float32) -> str:
    kind, tied, fields = FAMILIES[model_type]
    path = str(root / f"hf_{model_type}_{str(dtype)[6:]}")
    if not os.path.isdir(path):
        kit.make_hf_model(path, kind, tied=tied, dtype=dtype, **fields)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("legacy")
    out = {"root": root}
    for model_type in ("qwen3", "qwen3-moe"):
        hf = _hf(root, model_type)
        out[model_type] = {"hf": hf, "ref": kit.hf_logits(hf, TOKENS)}
    for layout in LAYOUTS:
        model_type, tp, pp, ep = layout
        mg = str(root / ("mg_" + "_".join(map(str, layout))))
        sizes = ["--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp)]
        if ep > 1:
            sizes += ["--target-expert-parallel-size", str(ep)]
        if tp == 1:     # the rows test_convert_families' _logits_at builds at TP1
            sizes += ["--make-vocab-size-divisible-by", "256"]
        _convert_hf_to_mg(out[model_type]["hf"], mg, model_type, "--ckpt-format", "torch", *sizes)
        out[layout] = mg
    return out


def _rank_body(rank, world_size, dirs, tokens, save_root):
    """Each layout: the trainer's model at these sizes loads the legacy conversion with the trainer's loader
    (its logits gathered), then saves itself as torch_dist and as legacy."""
    from megatron.core import parallel_state
    from mindspeed.checkpoint import legacy, torch_dist
    from mindspeed.convert.megatron_write import _NoScheduler, adapted
    from tests_extend.unit.test_convert_families import _logits_at
    multiprocessing.current_process().daemon = False     # dist_checkpointing's save starts processes
    out = {}
    for layout, mg in dirs.items():
        model_type, tp, pp, ep = layout
        args = kit.trainer_args(mg, tp=tp, pp=pp, world_size=world_size,
                                extra=["--expert-model-parallel-size", str(ep)])
        with adapted(args):
            model, logits = _logits_at(mg, tokens, tp, pp, ep, world_size)
            root = os.path.join(save_root, "_".join(map(str, layout)))
            torch_dist.save_checkpoint(root + "_torch_dist", 0, [model], None, _NoScheduler(), 0)
            legacy.save_checkpoint(root + "_legacy", 0, [model], None, _NoScheduler(), 0, args=args)
            parallel_state.destroy_model_parallel()
        out[layout] = logits
    return out


def test_legacy_conversion_loads_at_its_sizes_and_converts_back_as_torch_dist(models, tmp_path):
    """hf->mg --ckpt-format torch gives each rank's file for TP2 / PP2 / EP2, loaded by the trainer's legacy
    loader at those sizes: transformers' logits. The trainer's legacy and torch_dist saves of that model
    convert back to the same Hugging Face files, bit for bit, which are the original model's."""
    dirs = {layout: models[layout] for layout in LAYOUTS}
    legacy_dir = os.path.join(dirs[("qwen3-moe", 1, 1, 2)], "iter_0000000")
    assert sorted(os.listdir(legacy_dir)) == ["mp_rank_00_000", "mp_rank_00_001"]      # one file per EP rank
    results = run_distributed(_rank_body, world_size=2, args=(dirs, TOKENS, str(tmp_path)), timeout=400,
                              daemon=False)
    for layout in LAYOUTS:
        model_type, tp, pp, ep = layout
        for rank in ([1] if pp == 2 else [0, 1]):       # the last pipeline stage has the logits
            assert _close(results[rank][layout], models[model_type]["ref"]) <= TOL, (layout, rank)
        saved = str(tmp_path / "_".join(map(str, layout)))
        hf = models[model_type]["hf"]
        for fmt in ("legacy", "torch_dist"):
            _mg_to_hf(f"{saved}_{fmt}", f"{saved}_{fmt}_back", model_type, "--hf-config", hf)
            _assert_same_hf(hf, f"{saved}_{fmt}_back")
        # the direct way back from the converted legacy files too
        _mg_to_hf(models[layout], f"{saved}_converted_back", model_type)
        _assert_same_hf(hf, f"{saved}_converted_back")


def _grouped_model(mg: str, grouped: bool):
    """The trainer's model for the converted checkpoint at TP1 (GroupedMLP in bf16 with `grouped`, else
    separate expert MLPs in fp32), loaded by the trainer's loader, in this process's world of one."""
    return kit.trainer_args(mg, fp32=not grouped, extra=["--expert-model-parallel-size", "1"],
                            drop=() if grouped else ("--moe-grouped-gemm",))


@pytest.mark.parametrize("model_type", ["qwen3-moe", "mixtral"])
def test_grouped_gemm_weights_both_ways(models, model_type, tmp_path):
    """--moe-grouped-gemm: legacy files with GroupedMLP's weight1/weight2 load into Megatron-Core's GroupedMLP,
    whose torch_dist save (Megatron-Core's own expert-by-expert view of those weights) converts back to the
    original model bit for bit, as does its legacy save; a grouped torch_dist conversion loads into it too.
    The same weights as separate experts in fp32: transformers' logits within 1e-4."""
    from mindspeed.checkpoint import legacy, torch_dist
    from mindspeed.convert.megatron_write import _NoScheduler, adapted, world_of_one
    hf = _hf(models["root"], model_type, torch.bfloat16)
    legacy_mg, dist_mg = str(tmp_path / "legacy"), str(tmp_path / "dist")
    # MindSpeed-LLM's Qwen3-MoE guide passes its layer spec both ways, and the target sizes 1 on the way back
    spec = ["--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec"] if model_type == "qwen3-moe" else []
    guide_back = ["--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1",
                  "--target-expert-parallel-size", "1", "--params-dtype", "bf16", *spec]
    _convert_hf_to_mg(hf, legacy_mg, model_type, "--ckpt-format", "torch", *GROUPED, *spec)
    _convert_hf_to_mg(hf, dist_mg, model_type, *GROUPED)
    from mindspeed.convert.sidecar import read_info
    assert "--moe-grouped-gemm" in read_info(legacy_mg)["trainer_flags"]
    for source, fmt in ((legacy_mg, "torch_dist"), (dist_mg, "legacy")):
        args = _grouped_model(source, grouped=True)
        with adapted(args), world_of_one():
            model = kit.load_trainer_model(args)
            experts = model.decoder.layers[1].mlp.experts
            assert type(experts).__name__ == "GroupedMLP" and experts.weight1.dtype == torch.bfloat16
            saved = str(tmp_path / f"saved_{fmt}")
            if fmt == "legacy":
                legacy.save_checkpoint(saved, 0, [model], None, _NoScheduler(), 0, args=args)
            else:
                torch_dist.save_checkpoint(saved, 0, [model], None, _NoScheduler(), 0)
        grouped_flag = ["--moe-grouped-gemm"] if fmt == "legacy" else []
        _mg_to_hf(saved, saved + "_back", model_type, "--hf-config", hf, *grouped_flag)
        _assert_same_hf(hf, saved + "_back")
    _mg_to_hf(legacy_mg, str(tmp_path / "converted_back"), model_type, "--moe-grouped-gemm", *guide_back)
    _assert_same_hf(hf, str(tmp_path / "converted_back"))
    shutil.copy(os.path.join(dist_mg, "convert_info.json"), str(tmp_path / "saved_torch_dist"))
    args = _grouped_model(str(tmp_path / "saved_torch_dist"), grouped=False)
    with adapted(args), world_of_one():
        model = kit.load_trainer_model(args)
        assert type(model.decoder.layers[1].mlp.experts).__name__ == "SequentialMLP"
        logits = kit.stage_forward(model, TOKENS)
    assert _close(logits, kit.hf_logits(hf, TOKENS)) <= TOL


def _refused(argv, needle, out_dir):
    rc, err = run_cli(*argv)
    assert rc == 1 and err.count("\n") == 1 and needle in err, err
    assert not os.path.exists(out_dir)


def test_bad_legacy_and_grouped_input_is_one_line(models, tmp_path):
    root = models["root"]
    out = str(tmp_path / "out")
    back = ["--load-model-type", "mg", "--save-model-type", "hf", "--save-dir", out]
    # a legacy folder missing one rank's file
    broken = str(tmp_path / "broken")
    shutil.copytree(models[("qwen3", 2, 1, 1)], broken)
    os.remove(os.path.join(broken, "iter_0000000", "mp_rank_01", "model_optim_rng.pt"))
    _refused([*back, "--model-type-hf", "qwen3", "--load-dir", broken],
             f"{broken}/iter_0000000/mp_rank_01/model_optim_rng.pt is missing", out)
    shutil.rmtree(os.path.join(broken, "iter_0000000", "mp_rank_01"))
    _refused([*back, "--model-type-hf", "qwen3", "--load-dir", broken], "mp_rank_01 is missing", out)
    # grouped weights without --moe-grouped-gemm, separate experts with it
    hf = _hf(root, "mixtral", torch.bfloat16)
    grouped = str(tmp_path / "grouped")
    _convert_hf_to_mg(hf, grouped, "mixtral", "--ckpt-format", "torch", *GROUPED)
    _refused([*back, "--model-type-hf", "mixtral", "--load-dir", grouped],
             "holds GroupedMLP's fused expert weights (mlp.experts.weight1/weight2: trained with --moe-grouped-gemm): "
             "add --moe-grouped-gemm", out)
    _refused([*back, "--model-type-hf", "qwen3-moe", "--moe-grouped-gemm", "--load-dir", models[("qwen3-moe", 1, 1, 2)]],
             "holds no GroupedMLP weights (its experts are separate MLPs, or it has none): drop --moe-grouped-gemm", out)
    _refused([*back, "--model-type-hf", "mixtral", "--load-dir", grouped, "--spec", "my.spec", "layer_spec"],
             "--spec my.spec layer_spec: the converter knows MindSpeed-LLM's", out)
    forward = ["--load-model-type", "hf", "--save-model-type", "mg", "--save-dir", out]
    for argv, needle in (
            (["--model-type-hf", "qwen3", "--load-dir", models["qwen3"]["hf"], *GROUPED], "the model has no experts"),
            (["--model-type-hf", "mixtral", "--load-dir", hf, "--moe-grouped-gemm"], "add --params-dtype bf16"),
            (["--model-type-hf", "qwen3", "--load-dir", models["qwen3"]["hf"], "--ckpt-format", "torch",
              "--neutral-copy"], "--neutral-copy goes beside torch_dist files")):
        _refused([*forward, *argv], needle, out)


def test_grouped_flag_has_no_effect_on_torch_dist_and_says_so(models, tmp_path):
    """torch_dist stores the experts alike whichever MLP the trainer built: mg->hf --moe-grouped-gemm converts
    it and logs one line saying the flag changed nothing."""
    import contextlib
    import io
    from mindspeed.convert.cli import main
    mg = str(tmp_path / "mg")
    _convert_hf_to_mg(models["qwen3-moe"]["hf"], mg, "qwen3-moe")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["--load-model-type", "mg", "--save-model-type", "hf", "--model-type-hf", "qwen3-moe",
                     "--load-dir", mg, "--save-dir", str(tmp_path / "back"), "--moe-grouped-gemm"]) == 0
    notes = [line for line in printed.getvalue().splitlines() if "--moe-grouped-gemm" in line]
    assert len(notes) == 1 and "has no effect here" in notes[0], printed.getvalue()
    _assert_same_hf(models["qwen3-moe"]["hf"], str(tmp_path / "back"))


def _losses(path: str) -> list[float]:
    with open(path) as f:
        return [json.loads(line)["lm_loss"] for line in f]


def test_enable_hf2mg_convert_trains_as_converting_first(models, tmp_path):
    """MindSpeed-LLM's --enable-hf2mg-convert: the run converts --load's Hugging Face model (legacy files for
    its sizes, into <load>/megatron_cache_tp1pp1ep1) and trains from it; its losses are those of a run that
    loads the same conversion made beforehand with --finetune. What it saves converts back to a model whose
    weights moved; with MINDSPEED_SLOW_TESTS=1 its iteration-1 legacy checkpoint resumes to its iteration-2 loss."""
    from mindspeed.convert.sidecar import read_info
    from tests_extend.system.one_process_run import run_pretrain_gpt
    hf = str(tmp_path / "hf")
    shutil.copytree(models["qwen3"]["hf"], hf)
    first = str(tmp_path / "first")
    _convert_hf_to_mg(hf, first, "qwen3", "--ckpt-format", "torch")
    common = read_info(first)["trainer_flags"] + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(kit.VOCAB - 1),
                            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
                            "--train-iters", "2", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0"]
    runs = {}
    for name, load in (("converting", ["--load", hf, "--enable-hf2mg-convert"]),
                       ("converted", ["--load", first, "--finetune"])):
        losses, save = str(tmp_path / f"{name}.jsonl"), str(tmp_path / f"save_{name}")
        result = run_pretrain_gpt(*common, *load, "--save", save, "--save-interval", "1", "--log-loss-file", losses)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        runs[name] = (_losses(losses), result.stdout, save)
    assert runs["converting"][0] == runs["converted"][0] and len(runs["converting"][0]) == 2
    cache = os.path.join(hf, "megatron_cache_tp1pp1ep1")
    assert f"> --enable-hf2mg-convert: loading {cache}, converted from {hf}" in runs["converting"][1]
    assert sorted(os.listdir(os.path.join(cache, "iter_0000000"))) == ["mp_rank_00"]
    back = str(tmp_path / "back")
    _mg_to_hf(runs["converting"][2], back, "qwen3", "--hf-config", hf)
    if os.environ.get("MINDSPEED_SLOW_TESTS"):      # a third launch (~30 s here): resuming its iteration 1
        resumed = str(tmp_path / "resumed.jsonl")
        result = run_pretrain_gpt(*common, "--load", runs["converting"][2], "--ckpt-step", "1", "--log-loss-file",
                                  resumed)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert _losses(resumed) == runs["converting"][0][1:]
    before, after = kit.read_safetensors(hf), kit.read_safetensors(back)
    assert sorted(before) == sorted(after)
    assert not torch.equal(before["model.layers.0.mlp.down_proj.weight"], after["model.layers.0.mlp.down_proj.weight"])


def test_enable_hf2mg_convert_follows_the_run_and_guards_its_cache(models, tmp_path, monkeypatch):
    """The conversion a run asks for: its sizes, format, dtype and grouped experts on convert_ckpt.py's command
    line, MindSpeed-LLM's cache name, --model-type-hf from config.json; a second start converts again over its
    own cache; a cache directory the converter did not write, or a --load without a Hugging Face model, is one
    line; a Hugging Face model at --load converts without the flag (MindSpeed-LLM's detection), said once."""
    from mindspeed.convert import at_training
    from mindspeed.errors import ConvertError
    from mindspeed.flags.trainer_flags import parse_args
    monkeypatch.delenv("RANK", raising=False)
    hf = str(tmp_path / "hf")
    shutil.copytree(models["qwen3-moe"]["hf"], hf)
    moe = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "4",
           "--seq-length", "16", "--max-position-embeddings", "64", "--mock-data", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", "127", "--load", hf, "--enable-hf2mg-convert"]
    args = parse_args(moe + ["--expert-model-parallel-size", "2", "--bf16", "--moe-grouped-gemm", "--ckpt-format",
                             "torch"], world_size=2)
    argv = at_training.converter_argv(args, at_training.cache_dir(args))
    assert at_training.cache_dir(args) == os.path.join(hf, "megatron_cache_tp1pp1ep2")
    for flag, value in (("--model-type-hf", "qwen3-moe"), ("--params-dtype", "bf16"), ("--ckpt-format", "torch"),
                        ("--target-expert-parallel-size", "2"), ("--load-dir", hf)):
        assert argv[argv.index(flag) + 1] == value, (flag, argv)
    assert "--moe-grouped-gemm" in argv
    uneven = parse_args(moe + ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"],
                        world_size=2)
    argv = at_training.converter_argv(uneven, at_training.cache_dir(uneven))
    assert argv[argv.index("--num-layer-list") + 1] == "1,3"
    assert "--num-layer-list" not in at_training.converter_argv(args, "x")      # an even split
    # MindSpeed-LLM's detection: a config.json beside safetensors at --load converts without the flag, said once
    auto = parse_args([a for a in moe if a != "--enable-hf2mg-convert"], world_size=1)
    assert auto.enable_hf2mg_convert and \
        [n for n in auto.flag_notes if "holds a Hugging Face model" in n] == [
            f"> --load {hf} holds a Hugging Face model (config.json, *.safetensors): converted before loading, as "
            "with --enable-hf2mg-convert (MindSpeed-LLM does the same)"], auto.flag_notes
    args = parse_args(moe, world_size=1)
    lines = []
    for _ in range(2):        # the second start converts again, over its own cache
        args.load = hf
        at_training.convert_load(args, log=lines.append)
        assert args.load == os.path.join(hf, "megatron_cache_tp1pp1ep1") and args.finetune
    assert os.path.isfile(os.path.join(args.load, "iter_0000000", "__0_0.distcp"))      # the run's torch_dist
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    args.load, args.mg_save_dir = hf, str(foreign)
    with pytest.raises(ConvertError, match="holds something other than this converter's output"):
        at_training.convert_load(args, log=lines.append)
    assert (foreign / "notes.txt").read_text() == "mine"
    args.load, args.mg_save_dir = str(foreign), None
    with pytest.raises(ConvertError, match="is not a Hugging Face model"):
        at_training.convert_load(args, log=lines.append)
