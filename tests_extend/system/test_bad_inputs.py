"""Bad inputs get one line and change nothing: each case of bad_inputs.CASES runs through its entry
point (the trainer's pretrain_gpt.py, `python -m mindspeed.data`, `python -m mindspeed.convert`):
a non-zero exit, exactly the case's one line on stderr, no traceback, its input files unchanged.

The cases share one process that imports the entry points once and forks a child per case
(entry_runner.py: each child runs the entry point's main as `python <entry>` would). Beside it, each
entry point is also launched as a process of its own on one bad input, so what its imports print
is seen too, and the MindSpore trainer on its own checkpoint loader's case.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests_extend.system import bad_inputs
from tests_extend.system.bad_inputs import CASES, MODEL, ROOT, pattern, resolve

TRAINER = os.path.join(ROOT, "tests_extend", "example", "pretrain_gpt.py")
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def _job(entry, argv, out, inputs=()):
    return {"entry": entry, "argv": list(argv), "out": out, "inputs": list(inputs)}


def _jobs(ws: str) -> list:
    setup = [
        _job("data", ["--input", f"{ws}/corpus.jsonl", "--output-prefix", f"{ws}/good"], f"{ws}/runs/setup-data"),
        _job("data", ["--input", f"{ws}/one_doc.jsonl", "--output-prefix", f"{ws}/one_doc"], f"{ws}/runs/setup-one"),
        {"prepare": "tests_extend.system.bad_inputs:prepare_data", "args": [ws]},
        _job("trainer", [*MODEL, "--data-path", f"{ws}/good", "--save", f"{ws}/ckpt", "--save-interval", "2"],
             f"{ws}/runs/setup-ckpt"),
        {"prepare": "tests_extend.system.bad_inputs:prepare_checkpoints", "args": [ws]},
    ]
    cases = [_job(c.entry, [resolve(a, ws) for a in c.argv], f"{ws}/runs/{c.name}", [resolve(p, ws) for p in c.inputs])
             for c in CASES]
    return setup + cases


# launched on their own: (entry point's command, argv, expected line); their inputs need no setup
def _own_launches(ws: str) -> dict:
    return {
        "data": ([sys.executable, "-m", "mindspeed.data", "--input", f"{ws}/broken.jsonl", "--output-prefix",
                  f"{ws}/out/own"], f"error: {ws}/broken.jsonl:2: not valid JSON (…)"),
        "trainer": ([sys.executable, TRAINER, *MODEL, "--data-path", f"{ws}/own_bad"],
                    f"error: dataset index '{ws}/own_bad.idx' is corrupt or not a Megatron index (bad header)"),
        "convert": ([sys.executable, "-m", "mindspeed.convert", "--load-model-type", "hf", "--save-model-type", "mg",
                     "--load-dir", f"{ws}/own_hf", "--save-dir", f"{ws}/out/own_hf"],
                    f"python -m mindspeed.convert: error: {ws}/own_hf/config.json is not a Hugging Face config "
                    "(not a JSON object)"),
        "mindspore": ([sys.executable, TRAINER, "--backend", "mindspore", *MODEL, "--load", f"{ws}/own_plain"],
                      f"error: --load path '{ws}/own_plain' holds …"),
    }


def _own_inputs(ws: str) -> None:
    for ext, data in ((".bin", b"\0" * 8), (".idx", b"not an index at all, not at all"),
                      (".tokenizer.json", b"{}")):
        with open(f"{ws}/own_bad{ext}", "wb") as f:
            f.write(data)
    os.makedirs(f"{ws}/own_hf")
    with open(f"{ws}/own_hf/config.json", "w") as f:
        json.dump([{"model_type": "llama"}], f)
    os.makedirs(f"{ws}/own_plain")
    with open(f"{ws}/own_plain/notes.txt", "w") as f:
        f.write("not a checkpoint\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ws = str(tmp_path_factory.mktemp("bad_inputs"))
    bad_inputs.write_inputs(ws)
    _own_inputs(ws)
    with open(f"{ws}/jobs.json", "w") as f:
        json.dump(_jobs(ws), f)
    want = {name: launch for name, launch in _own_launches(ws).items()
            if name != "mindspore" or _mindspore_installed()}
    own = {name: subprocess.Popen(argv, cwd=ws, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for name, (argv, _line) in want.items()}
    runner = subprocess.run([sys.executable, "-m", "tests_extend.system.entry_runner", f"{ws}/jobs.json"], cwd=ROOT,
                            env=ENV, capture_output=True, text=True, timeout=600)
    assert runner.returncode == 0, runner.stderr[-4000:]
    launched = {}
    for name, proc in own.items():
        out, err = proc.communicate(timeout=600)
        launched[name] = (proc.returncode, out, err, want[name][1])
    return ws, launched


def _mindspore_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("mindspore") is not None


def _read(ws, name, what):
    with open(f"{ws}/runs/{name}/{what}") as f:
        return f.read()


def _assert_one_line(status, stdout, stderr, expected, noise=()):
    assert status not in (0, None), stderr[-3000:]
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if not any(re.fullmatch(n, line) for n in noise)]
    assert len(lines) == 1, stderr[-3000:]
    assert expected.fullmatch(lines[0]), f"\n{lines[0]}\ndoes not match\n{expected.pattern}"


def test_setup_ran(runs):
    ws, _ = runs
    for name in ("setup-data", "setup-one", "setup-ckpt"):
        assert _read(ws, name, "status") == "0", _read(ws, name, "stderr")[-3000:]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_one_line_and_changes_nothing(runs, case):
    ws, _ = runs
    _assert_one_line(int(_read(ws, case.name, "status")), _read(ws, case.name, "stdout"),
                     _read(ws, case.name, "stderr"), pattern(case.message, ws), case.noise)
    assert _read(ws, case.name, "changed") == "", "inputs changed"
    for flag, made in (("--save-dir", ("",)), ("--output-prefix", (".bin", ".idx", ".tokenizer.json"))):
        if flag in case.argv:       # nothing written where the output would go
            out = resolve(case.argv[case.argv.index(flag) + 1], ws)
            assert not [out + ext for ext in made if os.path.exists(out + ext)], f"{flag} {out} was written"


@pytest.mark.parametrize("entry", ["data", "trainer", "convert", "mindspore"])
def test_an_entry_point_launched_on_its_own(runs, entry):
    _ws, launched = runs
    if entry not in launched:
        pytest.skip("MindSpore is not installed")
    status, stdout, stderr, line = launched[entry]
    _assert_one_line(status, stdout, stderr, pattern(line, ""))


def test_payload_never_ran(runs):
    ws, _ = runs
    assert "the payload ran" not in _read(ws, "common-pt-foreign-global", "stdout")


def test_docs_table_is_the_case_list():
    with open(bad_inputs.DOC) as f:
        text = f.read()
    assert bad_inputs.rendered_doc(text) == text, \
        "docs/bad-inputs.md differs from bad_inputs.CASES: run `python -m tests_extend.system.bad_inputs`"
