"""The support matrix is the one gate: for every feature x backend cell this machine can run
(torch/cpu, mindspore/cpu), `python -m mindspeed check` and a real start of the trainer with the
same flags agree. Refused: the trainer exits 2 with the very line `check` printed, before any
backend exists. Accepted: the trainer trains 2 iterations on 2 processes with finite losses.
Inert (a feature on where the layout leaves it nothing to do, Feature.inert): `check` accepts it
with one line saying so, and the trainer prints that line once (rank 0) and trains the very losses
of the same command line without the feature's flags.

Refusals start in this process (they stop before any backend); the accepted and the inert cells
start in one 2-process launch per backend that runs them in turn, the inert cells of one layout
sharing their run without the flags, to keep CI time down."""
import json
import os

import pytest

from mindspeed.backends.base import Level
from mindspeed.features.base import Feature
from mindspeed.features.registry import all_features
from mindspeed.support_matrix import feature_level
from tests_extend.system import matrix_walk as walk

CELLS = [(f, b, d) for f in all_features() for b, d in walk.COLUMNS]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("walk"))
    from mindspeed.data.preprocess import PreprocessConfig, preprocess
    text = os.path.join(tmp, "docs.jsonl")         # one document per line
    with open(text, "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"the quick brown fox {i} jumps over the lazy dog. " * 8}) + "\n")
    prefix = os.path.join(tmp, "data")
    preprocess(PreprocessConfig(inputs=[text], output_prefix=prefix), log=lambda *_: None)
    return tmp, prefix


def _argv(feature, backend, workdir):
    tmp, prefix = workdir
    return walk.cell_argv(feature, backend, tmp, prefix)


def _expected(feature, backend, device):
    return feature_level(feature, backend, device)[0] is not Level.ABSENT


def test_every_cell_is_walked():
    """Every feature has an example command line, so no cell is left out of the walk."""
    assert all(f.example for f in all_features())
    counts = {col: sum(1 for f in all_features() if _expected(f, *col)) for col in walk.COLUMNS}
    print(f"\ncells: {len(CELLS)}; accepted: {counts}; not started: {walk.NOT_STARTED}")
    assert len(CELLS) >= 2 * 60


REFUSED = [c for c in CELLS if not _expected(*c)]


@pytest.mark.parametrize("cell", REFUSED, ids=[f"{f.id}-{b}" for f, b, _ in REFUSED])
def test_refused_cell_check_and_trainer_agree(cell, workdir, monkeypatch, tmp_path):
    from mindspeed import backends
    feature, backend, _ = cell
    monkeypatch.setenv("WORLD_SIZE", str(walk.WORLD))
    argv = _argv(feature, backend, workdir)
    rc, line = walk.check_answer(argv)
    assert rc == 2 and line.startswith("MindSpeed: ") and feature.id in line, line
    backends.reset_backend()
    result = walk.start(argv, str(tmp_path / "loss.jsonl"))
    assert result["rc"] == 2 and result["line"] == f"error: {line}", result
    assert backends._active is None and not result["losses"]       # refused before any work


def _start_all(rank, world_size, cells):
    """Each cell in turn on this process group's ranks (a fresh rendezvous per cell)."""
    from tests_extend.distributed.harness import next_rendezvous
    results = {}
    for name, argv, loss_file in cells:
        next_rendezvous(rank, loss_file + ".port")
        results[name] = walk.start(argv, loss_file + f".{rank}")
    return results


def _accepted(backend):
    return [f for f in all_features() if _expected(f, backend, "cpu") and f.id not in walk.NOT_STARTED]


def _inert_cells(backend, workdir):
    """(feature, argv, argv without its flags) for each feature that can be on with no effect, where
    the rest of its command line runs on `backend` (which features can: test_inert_flags.py)."""
    from mindspeed.adaptor_core import MindSpeedConfigError, plan
    tmp, prefix = workdir
    cells = []
    for f in all_features():
        if type(f).inert is Feature.inert:
            continue
        argv = walk.inert_cell_argv(f, backend, tmp, prefix)
        try:
            inert = f.id in {g.id for g, *_ in plan(argv, unknown_flags="trainer").inert}
        except MindSpeedConfigError:
            inert = False
        if inert and walk.check_notes(walk.without_flags(f, argv))[0] == 0:
            cells.append((f, argv, walk.without_flags(f, argv)))
    return cells


def _walk_runs(backend, workdir) -> tuple[list, list, dict]:
    """One launch's runs for `backend`: every accepted cell (named by its feature), every inert cell
    ("inert/<id>") and each distinct command line those give without their flags ("without/<n>": the
    inert cells of one layout share it). Returns (runs [(name, argv)], inert cells, inert id -> the name
    of its run without the flags)."""
    runs = [(f.id, _argv(f, backend, workdir)) for f in _accepted(backend)]
    inert = _inert_cells(backend, workdir)
    without_names = {}
    for f, argv, without in inert:
        runs.append((f"inert/{f.id}", argv))
        key = tuple(without)
        if key not in without_names:
            without_names[key] = f"without/{len(without_names)}"
            runs.append((without_names[key], without))
    return runs, inert, {f.id: without_names[tuple(without)] for f, _, without in inert}


def _distinct(runs: list) -> tuple[list, dict]:
    """(the runs with distinct command lines, name -> the name of the run that trains its command line):
    a cell whose command line another cell has (a feature both accepted and inert with one example, a
    layout's plain run) shares that run."""
    first, kept, alias = {}, [], {}
    for name, argv in runs:
        alias[name] = first.setdefault(tuple(argv), name)
        if alias[name] == name:
            kept.append((name, argv))
    return kept, alias


def _with_aliases(per_rank: list, alias: dict) -> list:
    return [{name: results[ran] for name, ran in alias.items()} for results in per_rank]


@pytest.fixture(scope="module")
def torch_walk(workdir, tmp_path_factory):
    """Every torch/cpu run of the walk in one 2-process spawn (per rank: name -> walk.start's result)."""
    from tests_extend.distributed.harness import run_distributed
    tmp = tmp_path_factory.mktemp("torch_walk")
    runs, inert, without = _walk_runs("torch", workdir)
    runs, alias = _distinct(runs)
    launch = [(name, argv, str(tmp / f"{name.replace('/', '-')}.jsonl")) for name, argv in runs]
    per_rank = run_distributed(_start_all, world_size=walk.WORLD, args=(launch,), timeout=900)
    return _with_aliases(per_rank, alias), inert, without


@pytest.fixture(scope="module")
def mindspore_walk(workdir, tmp_path_factory):
    """Every mindspore/cpu run of the walk in one msrun launch: each process trains every run in turn (a
    native crash there fails the tests)."""
    pytest.importorskip("mindspore")
    from tests_extend.distributed.msrun_helper import run_msrun
    tmp = tmp_path_factory.mktemp("mindspore_walk")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WORLD_SIZE", str(walk.WORLD))     # as train_distributed_ms.sh exports it for msrun
        runs, inert, without = _walk_runs("mindspore", workdir)
        runs, alias = _distinct(runs)
        worker = os.path.join(walk.ROOT, "tests_extend", "system", "matrix_walk_ms_worker.py")
        (tmp / "cells.json").write_text(json.dumps(runs))
        per_rank = run_msrun(worker, [str(tmp / "cells.json"), str(tmp)], str(tmp), timeout=900)
    if any("worker" in results for results in per_rank):      # the worker's own failure, as it reported it
        return per_rank, inert, without
    return _with_aliases(per_rank, alias), inert, without


def _checked_accepted(backend, workdir):
    cells = [(f.id, _argv(f, backend, workdir)) for f in _accepted(backend)]
    for name, argv in cells:
        rc, line = walk.check_answer(argv)
        assert rc == 0, f"{name}: check refused a cell the matrix accepts: {line}"
    return [name for name, _ in cells]


def test_accepted_torch_cells_train(workdir, torch_walk, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(walk.WORLD))
    names = _checked_accepted("torch", workdir)
    results = torch_walk[0]
    failed = {name: results[0][name] for name in names if not results[0][name]["trained"]}
    assert not failed, failed
    # --profile-ranks 1: the rank is known only once the trainer has its process group
    assert os.listdir(os.path.join(workdir[0], "profile")) == ["rank1"]
    print(f"\ntorch/cpu: {len(names)} accepted cells trained 2 iterations on 2 processes")


@pytest.mark.timeout(960)      # the launch's own limit (900 s) reports the workers' logs first
def test_accepted_mindspore_cells_train(workdir, mindspore_walk, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(walk.WORLD))
    names = _checked_accepted("mindspore", workdir)
    trained = mindspore_walk[0][0]
    assert set(names) <= set(trained)
    failed = {name: trained[name] for name in names if not trained[name]["trained"]}
    assert not failed, "\n".join(f"{name}: {r}" for name, r in failed.items())
    slowest = sorted(((n, trained[n]) for n in names), key=lambda kv: -kv[1]["seconds"])[:8]
    print(f"\nmindspore/cpu: {len(names)} accepted cells trained 2 iterations on 2 processes in "
          f"{sum(trained[n]['seconds'] for n in names):.0f} s; slowest: "
          + ", ".join(f"{name} {r['seconds']:.1f} s" for name, r in slowest))


@pytest.mark.parametrize("backend", [b for b, _ in walk.COLUMNS])
def test_inert_cells_check_says_one_line(backend, workdir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(walk.WORLD))
    cells = _inert_cells(backend, workdir)
    assert {"sequence-parallel", "megatron-cp-algo", "hybrid-cp-algo", "general-attention-mask", "ascend-coc",
            "moe-tp-extend-ep", "moe-permutation-async-comm", "moe-alltoall-overlap-comm"} <= {f.id for f, *_ in cells}
    for f, argv, _ in cells:
        rc, notes = walk.check_notes(argv)
        assert rc == 0 and len(notes) == 1, (f.id, rc, notes, walk.check_answer(argv))


def _assert_inert_runs(cells, without: dict, per_rank: list) -> None:
    """Each inert cell trained, its note on one rank only, once, and its losses are those of the
    same command line without the flags (which prints no note)."""
    for f, *_ in cells:
        name, plain = f"inert/{f.id}", without[f.id]
        runs = [r[name] for r in per_rank]
        # rank 0 writes the loss file; every rank ends well
        assert per_rank[0][name]["trained"] and per_rank[0][plain]["trained"], (name, runs)
        assert all(r[key]["rc"] == 0 for r in per_rank for key in (name, plain)), (name, runs)
        noted = [r["notes"] for r in runs if r["notes"]]
        assert len(noted) == 1 and len(noted[0]) == 1, (name, [r["notes"] for r in runs])
        assert noted[0][0].startswith("> MindSpeed: ") and "has no effect here" in noted[0][0]
        assert not any(r[plain]["notes"] for r in per_rank)
        assert per_rank[0][name]["losses"] == per_rank[0][plain]["losses"], name


def test_inert_torch_cells_train_as_without_them(torch_walk):
    per_rank, cells, without = torch_walk
    _assert_inert_runs(cells, without, per_rank)
    print(f"\ntorch/cpu: {len(cells)} inert cells trained as without their flags: {[f.id for f, *_ in cells]}")


@pytest.mark.timeout(960)
def test_inert_mindspore_cells_train_as_without_them(mindspore_walk):
    per_rank, cells, without = mindspore_walk
    _assert_inert_runs(cells, without, per_rank)
    print(f"\nmindspore/cpu: {len(cells)} inert cells trained as without their flags: {[f.id for f, *_ in cells]}")
