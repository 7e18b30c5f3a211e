"""`python convert_ckpt.py ...` / `python -m mindspeed.convert ...`: Hugging Face <-> Megatron-Core
checkpoints of Llama-family models, with MindSpeed-LLM's / Megatron-LM's flag names.

Every usage error is one line on stderr and exit status 2 (an unknown flag with a did-you-mean);
every input the conversion cannot use is refused in one line, exit 1, before anything is written.
"""
from __future__ import annotations

import argparse
import difflib
import sys
import warnings

from mindspeed import deferred_compile
from mindspeed.convert.arch import HF_MODEL_TYPES
from mindspeed.errors import ConvertError, positive_int, report
from mindspeed.patching import GLOBAL_PATCHES


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")

    def parse_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        known = {s for action in self._actions for s in action.option_strings}
        # a misspelt flag is named first, before argparse's "required" complaint that it causes
        typo = next((a for a in args if a.startswith("--") and a.split("=", 1)[0] not in known), None)
        if typo:
            self.error(self._unknown(typo))
        ns, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(self._unknown(unknown[0]))
        return ns

    def _unknown(self, token: str) -> str:
        flag = token.split("=", 1)[0]
        if not flag.startswith("-"):
            return f"unexpected argument {token!r}"
        known = [s for action in self._actions for s in action.option_strings]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return f"unknown flag {flag}{hint}"


def _layer_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        # "11, 13, 19, 21" (as a guide writes it) reaches here as "11,": the shell split it at the spaces
        hint = " (write it without spaces, e.g. 11,13,19,21)" if text.endswith(",") else ""
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer counts{hint}") from None


def build_parser(prog: str = "convert_ckpt.py") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, allow_abbrev=False,
                      description="Convert Llama-family checkpoints (Llama, Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral) "
                                  "between Hugging Face and Megatron-Core")
    p.add_argument("--use-mcore-models", action="store_true",
                   help="accepted for Megatron-LM's command lines: Megatron-Core models are the only ones")
    p.add_argument("--model-type", default="GPT", choices=["GPT"])
    p.add_argument("--load-model-type", required=True, choices=["hf", "mg"])
    p.add_argument("--save-model-type", required=True, choices=["hf", "mg"])
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True,
                   help="must not exist yet (or be empty; missing parents are created); written atomically. "
                        "mg->hf into a Hugging Face model directory (the original model, as MindSpeed-LLM's "
                        "guides have it) writes its mg2hg/ subfolder and reads the config there")
    p.add_argument("--model-type-hf", default="llama2", choices=sorted(HF_MODEL_TYPES))
    p.add_argument("--target-tensor-parallel-size", type=positive_int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=positive_int, default=1)
    p.add_argument("--target-expert-parallel-size", type=positive_int, default=1,
                   help="MoE models: the trainer's --expert-model-parallel-size (checked against the experts and "
                        "given in the trainer flags; the torch_dist files keep every expert at any EP size)")
    p.add_argument("--num-layer-list", type=_layer_list, default=None,
                   help="layers per pipeline stage, e.g. 1,3: checked, and given to the trainer as "
                        "--decoder-first/last-pipeline-num-layers (the torch_dist files do not depend on it)")
    p.add_argument("--add-qkv-bias", action="store_true",
                   help="the model has q/k/v biases (Qwen2 as llama2/llama3/qwen2; qwen25 has them without it)")
    p.add_argument("--params-dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="dtype of the Megatron parameters (hf->mg; bf16 and fp16 work on CPU too); "
                        "mg->hf writes config.json's dtype")
    p.add_argument("--neutral-copy", action="store_true",
                   help="hf->mg: also write the framework-neutral safetensors copy (fp32) that the MindSpore "
                        "trainer (--backend mindspore) loads, in the same iteration directory")
    p.add_argument("--tokenizer-model", default=None,
                   help="hf->mg: the tokenizer.json the trainer will use: the embedding keeps its vocabulary's "
                        "rows, padded as the trainer pads it (default: config.json's vocab_size)")
    p.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128)
    p.add_argument("--padded-vocab-size", type=positive_int, default=None,
                   help="hf->mg: write this many embedding/output rows instead of the vocabulary padded to a "
                        "multiple of --make-vocab-size-divisible-by x TP; train with the same --padded-vocab-size "
                        "(it is in the printed trainer flags)")
    p.add_argument("--ckpt-format", default=None, choices=["torch_dist", "torch"],
                   help="hf->mg: the trainer's checkpoint format to write (Megatron's flag): torch_dist (default; loads at any "
                        "TP/PP/EP) or torch, Megatron-LM's legacy per-rank files for exactly the target sizes; "
                        "mg->hf reads either (and the MindSpore trainer's)")
    p.add_argument("--moe-grouped-gemm", action="store_true",
                   help="the trainer runs the experts as Megatron-Core's GroupedMLP: hf->mg adds the flag to the "
                        "trainer flags and, with --ckpt-format torch, writes its fused weights; mg->hf expects "
                        "them in a legacy checkpoint (torch_dist stores the experts alike either way)")
    p.add_argument("--spec", nargs=2, default=None, metavar=("MODULE", "NAME"),
                   help="MindSpeed-LLM's layer spec (its qwen3_spec / deepseek_spec, as its guides pass them): the "
                        "tensors follow --model-type-hf, so a known spec changes nothing (one line says so)")
    p.add_argument("--hf-config", default=None,
                   help="mg->hf: the Hugging Face model directory (or config.json) that describes the "
                        "checkpoint, when it has no hf_config/ of its own")
    _add_lora_args(p)
    return p


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    """mg->hf of a LoRA run: its adapters merged into the base model."""
    p.add_argument("--lora-load", default=None, metavar="DIR",
                   help="mg->hf: a LoRA run's adapter checkpoint (its --save) to merge into --load-dir's base "
                        "model (weight + alpha/r * B @ A)")
    p.add_argument("--lora-r", type=positive_int, default=None, help="with --lora-load: checked against the adapters")
    p.add_argument("--lora-alpha", type=float, default=None, help="with --lora-load: checked against the adapters")
    p.add_argument("--lora-target-modules", nargs="+", default=None, metavar="MODULE",
                   help="with --lora-load: checked against the adapters")


def main(argv=None, prog: str = "convert_ckpt.py") -> int:
    parser = build_parser(prog)
    opts = parser.parse_args(sys.argv[1:] if argv is None else argv)
    deferred_compile.install(GLOBAL_PATCHES)   # before either direction imports Megatron-Core: ~4 s of the start
    with warnings.catch_warnings():
        # Megatron warns on import about Apex/Transformer Engine and CUDA settings that a
        # conversion never uses; a refusal must stay one line
        for category in (UserWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category, module=r"(megatron|torch|mindspeed)\.")
        return _run(parser, opts)


def _spec_note(opts) -> str | None:
    """The one line for MindSpeed-LLM's --spec (None without it); a spec the converter does not know is refused."""
    if opts.spec is None:
        return None
    from mindspeed.flags.family_flags import KNOWN_SPECS
    if opts.spec[0] not in KNOWN_SPECS:
        raise ConvertError(f"--spec {' '.join(opts.spec)}: the converter knows MindSpeed-LLM's "
                           f"{' and '.join(sorted(KNOWN_SPECS))} (the tensors follow --model-type-hf); drop it")
    return f"> --spec {' '.join(opts.spec)} has no effect here: the tensors follow --model-type-hf {opts.model_type_hf}"


def _run(parser: argparse.ArgumentParser, opts) -> int:
    direction = (opts.load_model_type, opts.save_model_type)
    try:
        note = _spec_note(opts)
        if note:
            print(note)
        lora_flags = [name for name in ("lora_r", "lora_alpha", "lora_target_modules") if getattr(opts, name)]
        if lora_flags and not opts.lora_load:
            raise ConvertError(f"--{lora_flags[0].replace('_', '-')} describes adapters to merge: give them "
                               "with --lora-load")
        if direction == ("hf", "mg") and opts.lora_load:
            raise ConvertError("--lora-load merges adapters into a Megatron checkpoint on its way to Hugging "
                               "Face: use it with --load-model-type mg --save-model-type hf")
        if direction == ("hf", "mg"):
            from mindspeed.convert import hf_to_mg  # imports torch: usage errors come first, in one line
            hf_to_mg.convert(opts)
        elif direction == ("mg", "hf"):
            if opts.target_tensor_parallel_size != 1 or opts.target_pipeline_parallel_size != 1 \
                    or opts.target_expert_parallel_size != 1 or opts.num_layer_list:
                raise ConvertError("mg->hf writes one unsharded Hugging Face model: leave out "
                                   "--target-*-parallel-size and --num-layer-list")
            if opts.padded_vocab_size is not None:
                raise ConvertError("--padded-vocab-size sets the rows hf->mg writes; mg->hf reads the checkpoint's "
                                   "rows and writes config.json's vocab_size: drop it")
            from mindspeed.convert import mg_to_hf  # imports torch (as hf_to_mg)
            mg_to_hf.convert(opts)
        else:
            parser.error(f"--load-model-type {opts.load_model_type} --save-model-type {opts.save_model_type}: "
                         "only hf->mg and mg->hf convert")
    except ConvertError as err:
        report(err, prefix=f"{parser.prog}: error: ")
        return 1
    return 0
