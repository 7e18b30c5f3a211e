"""Every bad input the entry points are tested with, and the one line each gets (test_bad_inputs.py
runs them; docs/bad-inputs.md is rendered from this list: `python -m tests_extend.system.bad_inputs`
rewrites its table).

Paths are written relative to a workspace, `{ws}`; a message may hold `…` where the text depends on
the machine or on a library's wording (it matches anything on the line).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "bad-inputs.md")
BEGIN, END = "<!-- cases: begin -->", "<!-- cases: end -->"

MODEL = ("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--train-iters", "2", "--eval-iters", "1", "--eval-interval", "2", "--log-interval", "1",
         "--split", "80,10,10")
# what the torch trainer prints on every run once it builds the model (Megatron-Core's and torch's
# deprecation warnings, Megatron's rerun state machine): before a checkpoint's refusal too
MODEL_BUILD_NOISE = (r".*UserWarning: full scope is deprecated.*", r".*FutureWarning: Please use DTensor instead.*",
                     r".*FutureWarning: `load_state_dict` is deprecated.*",
                     r"  (warnings\.warn\(|return func\(\*args, \*\*kwargs\)|checkpoint\.load_state_dict\()",
                     r"Implicit initialization of Rerun State Machine!",
                     r"RerunStateMachine initialized in mode RerunMode\.DISABLED")
BIGGER = tuple("64" if prev == "--hidden-size" else a for prev, a in zip(("",) + MODEL, MODEL))
ENTRY_COMMANDS = {"trainer": "pretrain_gpt.py", "mindspore": "pretrain_gpt.py --backend mindspore",
                  "data": "python -m mindspeed.data", "convert": "python convert_ckpt.py"}


@dataclass(frozen=True)
class Case:
    name: str
    entry: str              # a key of ENTRY_COMMANDS
    bad_input: str          # what is wrong, in the docs' words
    argv: tuple
    inputs: tuple           # files and folders that must be left as they were
    message: str            # the one stderr line
    noise: tuple = ()       # other stderr lines the run prints before it (regexes): Megatron's, on every run


def trainer(name, bad_input, data="good", extra=(), inputs=None, message="", model=MODEL, noise=()):
    return Case(name, "trainer", bad_input, (*model, "--data-path", f"{{ws}}/{data}", *extra),
                tuple(inputs or (f"{{ws}}/{data}.bin", f"{{ws}}/{data}.idx", f"{{ws}}/{data}.tokenizer.json")),
                message, noise)


def hf_to_mg(name, bad_input, model_dir, message):
    return Case(name, "convert", bad_input, ("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                                             f"{{ws}}/{model_dir}", "--save-dir", f"{{ws}}/out/{name}"),
                (f"{{ws}}/{model_dir}",), message)


CASES = [
    trainer("truncated-bin", "`.bin` shorter than its `.idx` says", "trunc_bin",
            message="error: dataset '{ws}/trunc_bin.bin' has 2000 bytes but its index describes 12602 (uint16 tokens): "
                    "the files are truncated or do not belong together; rebuild them"),
    trainer("truncated-idx", "`.idx` cut short", "trunc_idx",
            message="error: dataset index '{ws}/trunc_idx.idx' is truncated: it is 40 bytes, its header describes 642; "
                    "rebuild the dataset"),
    trainer("corrupt-idx", "`.idx` that is not a Megatron index (bad header)", "corrupt_idx",
            message="error: dataset index '{ws}/corrupt_idx.idx' is corrupt or not a Megatron index (bad header)"),
    trainer("idx-other-dtype", "`.idx` of another token dtype (int32) next to a uint16 `.bin`", "dtype_idx",
            message="error: dataset '{ws}/dtype_idx.bin' has 12602 bytes but its index describes 25204 (int32 tokens): "
                    "the files are truncated or do not belong together; rebuild them"),
    trainer("tokenizer-not-json", "the dataset's `.tokenizer.json` does not parse", "bad_tok",
            message="error: tokenizer file '{ws}/bad_tok.tokenizer.json' is unreadable or corrupt: Expecting value: "
                    "line 1 column 42 (char 41)"),
    trainer("split-without-documents", "a dataset too small for `--split` (one document)", "one_doc",
            message="error: dataset '{ws}/one_doc' has 1 document(s): its valid split (--split 80,10,10) gets none; "
                    "add documents or change --split"),
    trainer("load-neither-format", "`--load` folder holding neither trainer's checkpoint", extra=("--load", "{ws}/plain"),
            inputs=("{ws}/plain",), message="error: --load path '{ws}/plain' holds no latest_checkpointed_iteration.txt: "
                                       "not a checkpoint directory written by --save"),
    trainer("load-other-model-size", "a checkpoint of another model size (hidden 32, model hidden 64)",
            extra=("--load", "{ws}/ckpt"), inputs=("{ws}/ckpt",), model=BIGGER,
            message="error: cannot load checkpoint {ws}/ckpt/iter_0000002: CheckpointingException: Global shape "
                    "mismatch for loaded (torch.Size([2, 32])) and expected ((2, 64)) tensor for key "
                    "decoder.layers.self_attention.linear_qkv.layer_norm_weight (rank 0)",
            noise=MODEL_BUILD_NOISE),
    trainer("common-pt-foreign-global", "`common.pt` that names a function (a pickle that would run code)",
            extra=("--load", "{ws}/evil"), inputs=("{ws}/evil",),
            message="error: checkpoint iteration 2 in {ws}/evil cannot be read: {ws}/evil/iter_0000002/common.pt "
                    "names posix.system, which a checkpoint's common state never holds (not loaded: it could run "
                    "code); no readable checkpoint is left in {ws}/evil (nothing was changed)"),
    Case("jsonl-not-json", "data", "a JSONL line that is not JSON",
         ("--input", "{ws}/broken.jsonl", "--output-prefix", "{ws}/out/broken"), ("{ws}/broken.jsonl",),
         "error: {ws}/broken.jsonl:2: not valid JSON (Expecting value)"),
    Case("empty-corpus", "data", "an empty corpus (an empty text file)",
         ("--input", "{ws}/empty.txt", "--output-prefix", "{ws}/out/empty"), ("{ws}/empty.txt",),
         "error: no documents for '{ws}/out/empty': every input record was empty or dropped"),
    hf_to_mg("truncated-safetensors", "a truncated `model.safetensors`", "hf_truncated",
             "convert_ckpt.py: error: {ws}/hf_truncated/model.safetensors is not a readable safetensors file (Error "
             "while deserializing header: incomplete metadata, file not fully covered)"),
    hf_to_mg("config-other-shape", "a `config.json` whose sizes do not match the weights", "hf_config_shape",
             "convert_ckpt.py: error: model.layers.0.mlp.gate_proj.weight has shape (96, 64), config.json implies "
             "(192, 64)"),
    hf_to_mg("config-not-object", "a `config.json` that is a JSON list", "hf_config_list",
             "convert_ckpt.py: error: {ws}/hf_config_list/config.json is not a Hugging Face config "
             "(not a JSON object)"),
]


def resolve(text: str, ws: str) -> str:
    return text.replace("{ws}", ws)


def pattern(message: str, ws: str) -> re.Pattern:
    """The message as a regex: `…` matches anything, the rest is literal."""
    return re.compile(".*".join(re.escape(resolve(part, ws)) for part in message.split("…")))


# -- the workspace ----------------------------------------------------------------------------------
def _copy_dataset(ws: str, name: str) -> str:
    for ext in (".bin", ".idx", ".tokenizer.json"):
        shutil.copy(f"{ws}/good{ext}", f"{ws}/{name}{ext}")
    return f"{ws}/{name}"


def prepare_data(ws: str) -> None:
    """The bad datasets, from the good one (`good`, built by the data CLI before this runs)."""
    os.truncate(_copy_dataset(ws, "trunc_bin") + ".bin", 2000)
    os.truncate(_copy_dataset(ws, "trunc_idx") + ".idx", 40)
    with open(_copy_dataset(ws, "corrupt_idx") + ".idx", "r+b") as f:
        f.write(b"NOTANIDX!")
    with open(_copy_dataset(ws, "dtype_idx") + ".idx", "r+b") as f:
        f.seek(17)                  # MMIDIDX header (9) + version (8): the dtype code
        f.write(bytes([4]))         # int32
    with open(_copy_dataset(ws, "bad_tok") + ".tokenizer.json", "w") as f:
        f.write('{"class": "CharLevelTokenizer", "chars": ')
    os.makedirs(f"{ws}/plain", exist_ok=True)
    with open(f"{ws}/plain/notes.txt", "w") as f:
        f.write("not a checkpoint\n")


def write_inputs(ws: str) -> None:
    """The inputs that need no entry point to make."""
    os.makedirs(f"{ws}/out", exist_ok=True)
    with open(f"{ws}/corpus.jsonl", "w") as f:
        words = "the king queen castle sword lord lady night day love war peace".split()
        for i in range(30):
            f.write(json.dumps({"text": " ".join(words[(i * 7 + k) % len(words)] for k in range(40))}) + "\n")
    with open(f"{ws}/one_doc.jsonl", "w") as f:
        f.write(json.dumps({"text": "a single document " * 20}) + "\n")
    with open(f"{ws}/broken.jsonl", "w") as f:
        f.write('{"text": "fine"}\n{"text": broken\n')
    open(f"{ws}/empty.txt", "w").close()


def prepare_checkpoints(ws: str) -> None:
    """A checkpoint whose common.pt names os.system, from the good one (`ckpt`, saved by the trainer);
    Hugging Face models with a truncated weights file and with configs that do not fit."""
    import torch
    from tests_extend.unit import convert_kit
    shutil.copytree(f"{ws}/ckpt", f"{ws}/evil")
    common = f"{ws}/evil/iter_0000002/common.pt"
    state = torch.load(common, weights_only=True)
    state["iteration"] = _Payload()
    torch.save(state, common)
    convert_kit.make_hf_model(f"{ws}/hf", "llama", num_hidden_layers=1)
    shutil.copytree(f"{ws}/hf", f"{ws}/hf_truncated")
    path = f"{ws}/hf_truncated/model.safetensors"
    os.truncate(path, os.path.getsize(path) // 2)
    for name, change in (("hf_config_shape", lambda c: dict(c, intermediate_size=c["intermediate_size"] * 2)),
                         ("hf_config_list", lambda c: [c])):
        shutil.copytree(f"{ws}/hf", f"{ws}/{name}")
        with open(f"{ws}/{name}/config.json") as f:
            config = json.load(f)
        with open(f"{ws}/{name}/config.json", "w") as f:
            json.dump(change(config), f)


class _Payload:
    """Unpickled, it would run a shell command."""

    def __reduce__(self):
        return os.system, ("echo the payload ran",)


# -- the docs table ----------------------------------------------------------------------------------
def table() -> str:
    rows = ["| entry point | bad input | what the user gets (stderr, exit code 2; the converter: 1) |",
            "|---|---|---|"]
    for case in CASES:
        message = case.message.replace("{ws}", "ws").replace("|", "\\|")
        rows.append(f"| `{ENTRY_COMMANDS[case.entry]}` | {case.bad_input} | `{message}` |")
    return "\n".join(rows)


def rendered_doc(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


if __name__ == "__main__":
    with open(DOC) as f:
        current = f.read()
    with open(DOC, "w") as f:
        f.write(rendered_doc(current))
    sys.exit(0)
