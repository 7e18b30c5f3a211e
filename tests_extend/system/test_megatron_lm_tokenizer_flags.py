"""MindSpeed-LLM's tokenizer flags under Megatron-LM's own pretrain_gpt.py (the one import line),
on each tested Megatron-LM version: --tokenizer-type PretrainedFromHF --tokenizer-name-or-path DIR
becomes Megatron's --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR before its checks (the
same arguments as that spelling, the same tokenizer), --padded-vocab-size N (Megatron-LM's own flag
from core_v0.16, added for core_v0.12) is the GPT model's embedding rows, and the bad inputs the
built-in trainers refuse are one `MindSpeed:` line here too. One process per successful
initialisation (MindSpeed's features apply once per process); refusals stop before that."""
import json
import os
import subprocess
import sys

import pytest

from tests_extend.system import megatron_lm_kit as kit
from tests_extend.unit import data_kit

pytest.importorskip("transformers")

CODE = """
import json, os, sys, torch
TOK, SPELLING = os.environ['TOK'], os.environ['SPELLING']
base = ['pretrain_gpt.py', '--num-layers', '2', '--hidden-size', '64', '--num-attention-heads', '4',
        '--seq-length', '8', '--max-position-embeddings', '8', '--micro-batch-size', '2', '--mock-data',
        '--train-iters', '1', '--lr', '1e-3', '--distributed-backend', 'gloo', '--transformer-impl', 'local']
llm = ['--tokenizer-type', 'PretrainedFromHF', '--tokenizer-name-or-path', TOK]
sys.argv = base
import mindspeed.megatron_adaptor
import megatron.training.arguments as margs
if SPELLING == 'refusals':
    def refused(*extra):
        sys.argv = base + list(extra)
        try:
            margs.validate_args(margs.parse_args())
        except SystemExit as exc:
            return str(exc)
        raise AssertionError(f'accepted: {extra}')
    empty = os.path.join(os.path.dirname(TOK), 'empty')
    os.makedirs(empty, exist_ok=True)
    for extra in (['--tokenizer-type', 'PretrainedFromHF'], llm[:3] + [os.path.join(TOK, 'missing')],
                  llm[:3] + [empty], llm + ['--tokenizer-model', empty],
                  llm + ['--padded-vocab-size', '64'], ['--tokenizer-name-or-path', TOK]):
        print('REFUSED', refused(*extra))
    sys.exit(0)
sys.argv = base + (llm if SPELLING == 'llm' else ['--tokenizer-type', 'HuggingFaceTokenizer', '--tokenizer-model',
                                                   TOK]) + ['--padded-vocab-size', '256']
import megatron.core.datasets.utils as dataset_utils
dataset_utils.compile_helpers = lambda: None    # the C++ index builder: no dataset is built here
from megatron.training.initialize import initialize_megatron
from megatron.training import get_args, get_tokenizer
initialize_megatron()
import pretrain_gpt
builder = getattr(pretrain_gpt, 'gpt_builder', None)     # core_v0.16: model_provider(builder, ...)
model = pretrain_gpt.model_provider(*([builder] if builder else []), True, True)
plain = {k: v for k, v in vars(get_args()).items() if isinstance(v, (str, int, float, bool, type(None)))}
print('RESULT', json.dumps({'args': plain, 'vocab': get_tokenizer().vocab_size,
                            'embedding': list(model.embedding.word_embeddings.weight.shape)}))
"""


@pytest.fixture(scope="module", params=kit.VERSIONS, ids=lambda v: f"core_v{v}")
def checkout(request, tmp_path_factory):
    return kit.checkout_or_skip(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return data_kit.make_tokenizer(str(tmp_path_factory.mktemp("mlm-tok") / "tok"),
                                   extra_texts=["the king loves the crown and the fool fears the sea"])


def _run(checkout: str, tokenizer: str, spelling: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([checkout, kit.ROOT]), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(kit.free_port()), TOK=tokenizer,
               SPELLING=spelling)
    return subprocess.run([sys.executable, "-c", CODE], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=240)


def test_bad_tokenizer_flags_are_one_line(checkout, tokenizer):
    result = _run(checkout, tokenizer, "refusals")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    lines = [line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith("REFUSED ")]
    expected = ["--tokenizer-type PretrainedFromHF needs --tokenizer-name-or-path DIR",
                "--tokenizer-name-or-path '" + os.path.join(tokenizer, "missing") + "' does not exist",
                "holds no tokenizer files", "name different tokenizers: give one",
                "--padded-vocab-size 64 is smaller than the tokenizer's vocabulary",
                "--tokenizer-name-or-path is read only by --tokenizer-type PretrainedFromHF"]
    assert len(lines) == len(expected), result.stdout[-3000:]
    for line, message in zip(lines, expected):
        assert line.startswith("MindSpeed: ") and message in line and "\n" not in line, (line, message)


def test_pretrained_from_hf_is_megatrons_hugging_face_tokenizer(checkout, tokenizer):
    results = {}
    for spelling in ("llm", "megatron"):
        result = _run(checkout, tokenizer, spelling)
        line = next((l for l in result.stdout.splitlines() if l.startswith("RESULT ")), None)
        assert result.returncode == 0 and line, (result.stdout + result.stderr)[-3000:]
        results[spelling] = json.loads(line.split(" ", 1)[1])
    ours, theirs = results["llm"]["args"], results["megatron"]["args"]
    assert (ours["tokenizer_type"], ours["tokenizer_model"], ours["padded_vocab_size"]) == \
        ("HuggingFaceTokenizer", tokenizer, 256)
    spelling_only = {"tokenizer_type_given", "tokenizer_name_or_path"}
    assert {k: v for k, v in ours.items() if k not in spelling_only} == \
        {k: v for k, v in theirs.items() if k not in spelling_only}
    assert results["llm"]["vocab"] == results["megatron"]["vocab"] < 256
    assert results["llm"]["embedding"] == results["megatron"]["embedding"] == [256, 64]
