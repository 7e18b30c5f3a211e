"""The support matrix is the one gate: for every feature x backend cell this machine can run
(torch/cpu, mindspore/cpu), `python -m mindspeed check` and a real start of the trainer with the
same flags agree. Refused: the trainer exits 2 with the very line `check` printed, before any
backend exists. Accepted: the trainer trains 2 iterations on 2 processes with finite losses.
Inert (a feature on where the layout leaves it nothing to do, Feature.inert): `check` accepts it
with one line saying so, and the trainer prints that line once (rank 0) and trains the very losses
of the same command line without the feature's flags.

Refusals start in this process (they stop before any backend); accepted cells start in one
2-process spawn per backend that runs them in turn, to keep CI time down."""
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
    """Each accepted cell in turn on this process group's ranks (a fresh rendezvous per cell)."""
    from tests_extend.distributed.harness import next_rendezvous
    results = {}
    for name, argv, loss_file in cells:
        next_rendezvous(rank, loss_file + ".port")
        results[name] = walk.start(argv, loss_file + f".{rank}")
    return results


def test_accepted_torch_cells_train(workdir, tmp_path):
    from tests_extend.distributed.harness import run_distributed
    accepted = [f for f in all_features() if _expected(f, "torch", "cpu") and f.id not in walk.NOT_STARTED]
    cells = [(f.id, _argv(f, "torch", workdir), str(tmp_path / f"{f.id}.jsonl")) for f in accepted]
    for name, argv, _ in cells:
        rc, line = walk.check_answer(argv)
        assert rc == 0, f"{name}: check refused a cell the matrix accepts: {line}"
    results = run_distributed(_start_all, world_size=walk.WORLD, args=(cells,), timeout=900)
    failed = {name: r for name, r in results[0].items() if not r["trained"]}
    assert not failed, failed
    # --profile-ranks 1: the rank is known only once the trainer has its process group
    assert os.listdir(os.path.join(workdir[0], "profile")) == ["rank1"]
    print(f"\ntorch/cpu: {len(cells)} accepted cells trained 2 iterations on 2 processes")


@pytest.mark.timeout(960)      # the launch's own limit (900 s) reports the workers' logs first
def test_accepted_mindspore_cells_train(workdir, tmp_path, monkeypatch):
    pytest.importorskip("mindspore")
    monkeypatch.setenv("WORLD_SIZE", str(walk.WORLD))     # as train_distributed_ms.sh exports it for msrun

    from tests_extend.distributed.msrun_helper import run_msrun
    accepted = [f for f in all_features() if _expected(f, "mindspore", "cpu") and f.id not in walk.NOT_STARTED]
    cells = [(f.id, _argv(f, "mindspore", workdir)) for f in accepted]
    for name, argv in cells:
        rc, line = walk.check_answer(argv)
        assert rc == 0, f"{name}: check refused a cell the matrix accepts: {line}"
    worker = os.path.join(walk.ROOT, "tests_extend", "system", "matrix_walk_ms_worker.py")
    # one launch: each process trains every cell in turn (a native crash there fails the test)
    (tmp_path / "cells.json").write_text(json.dumps(cells))
    trained = run_msrun(worker, [str(tmp_path / "cells.json"), str(tmp_path)], str(tmp_path), timeout=900)[0]
    assert sorted(trained) == sorted(name for name, _ in cells)
    failed = {name: r for name, r in trained.items() if not r["trained"]}
    assert not failed, "\n".join(f"{name}: {r}" for name, r in failed.items())
    slowest = sorted(trained.items(), key=lambda kv: -kv[1]["seconds"])[:8]
    print(f"\nmindspore/cpu: {len(cells)} accepted cells trained 2 iterations on 2 processes in "
          f"{sum(r['seconds'] for r in trained.values()):.0f} s; slowest: "
          + ", ".join(f"{name} {r['seconds']:.1f} s" for name, r in slowest))


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


@pytest.mark.parametrize("backend", [b for b, _ in walk.COLUMNS])
def test_inert_cells_check_says_one_line(backend, workdir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(walk.WORLD))
    cells = _inert_cells(backend, workdir)
    assert {"sequence-parallel", "megatron-cp-algo", "hybrid-cp-algo", "general-attention-mask", "ascend-coc",
            "moe-tp-extend-ep", "moe-permutation-async-comm", "moe-alltoall-overlap-comm"} <= {f.id for f, *_ in cells}
    for f, argv, _ in cells:
        rc, notes = walk.check_notes(argv)
        assert rc == 0 and len(notes) == 1, (f.id, rc, notes, walk.check_answer(argv))


def _train_pairs(rank, world_size, cells):
    from tests_extend.distributed.harness import next_rendezvous
    results = {}
    for name, argv, loss_file in cells:
        next_rendezvous(rank, loss_file + ".port")
        results[name] = walk.start(argv, loss_file + f".{rank}")
    return results


def _assert_inert_runs(cells, per_rank: list) -> None:
    """Each inert cell trained, its note on one rank only, once, and its losses are those of the
    same command line without the flags (which prints no note)."""
    for f, *_ in cells:
        name = f.id
        runs = [r[name] for r in per_rank]
        # rank 0 writes the loss file; every rank ends well
        assert per_rank[0][name]["trained"] and per_rank[0][f"{name}+without"]["trained"], (name, runs)
        assert all(r[key]["rc"] == 0 for r in per_rank for key in (name, f"{name}+without")), (name, runs)
        noted = [r["notes"] for r in runs if r["notes"]]
        assert len(noted) == 1 and len(noted[0]) == 1, (name, [r["notes"] for r in runs])
        assert noted[0][0].startswith("> MindSpeed: ") and "has no effect here" in noted[0][0]
        assert not any(r[f"{name}+without"]["notes"] for r in per_rank)
        assert per_rank[0][name]["losses"] == per_rank[0][f"{name}+without"]["losses"], name


def test_inert_torch_cells_train_as_without_them(workdir, tmp_path):
    from tests_extend.distributed.harness import run_distributed
    cells = _inert_cells("torch", workdir)
    runs = [(name, a, str(tmp_path / f"{name}.jsonl")) for f, argv, without in cells
            for name, a in ((f.id, argv), (f"{f.id}+without", without))]
    results = run_distributed(_train_pairs, world_size=walk.WORLD, args=(runs,), timeout=900)
    _assert_inert_runs(cells, results)
    print(f"\ntorch/cpu: {len(cells)} inert cells trained as without their flags: {[f.id for f, *_ in cells]}")


@pytest.mark.timeout(960)
def test_inert_mindspore_cells_train_as_without_them(workdir, tmp_path, monkeypatch):
    pytest.importorskip("mindspore")
    monkeypatch.setenv("WORLD_SIZE", str(walk.WORLD))
    from tests_extend.distributed.msrun_helper import run_msrun
    cells = _inert_cells("mindspore", workdir)
    runs = [(name, a) for f, argv, without in cells
            for name, a in ((f.id, argv), (f"{f.id}+without", without))]
    worker = os.path.join(walk.ROOT, "tests_extend", "system", "matrix_walk_ms_worker.py")
    (tmp_path / "cells.json").write_text(json.dumps(runs))
    per_rank = run_msrun(worker, [str(tmp_path / "cells.json"), str(tmp_path)], str(tmp_path), timeout=900)
    _assert_inert_runs(cells, per_rank)
    print(f"\nmindspore/cpu: {len(cells)} inert cells trained as without their flags: {[f.id for f, *_ in cells]}")
