"""Megatron-LM's legacy checkpoint (--ckpt-format torch): one torch.save'd file per model-parallel rank.

Layout (Megatron-LM's `get_checkpoint_name`):

    <root>/latest_checkpointed_iteration.txt
    <root>/iter_0000010/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
                                              /distrib_optim.pt      (--use-distributed-optimizer)

TT the tensor-parallel rank; _PPP the pipeline rank when the pipeline has more than one stage; _EEE the
expert-parallel rank when there is expert parallelism. One rank of each data-parallel group (expert-data-
parallel rank 0) writes model_optim_rng.pt, a dict:

    args                  argparse.Namespace: the run's plain flags (run_flags.plain_flags), with
                          consumed_train_samples / consumed_valid_samples / skipped_train_samples
                          (where Megatron-LM keeps the data position)
    checkpoint_version    3.0
    iteration             the iteration saved
    model | model0, ..    the model chunk's state_dict_for_save_checkpoint() (Megatron-Core's names;
                          one per virtual pipeline stage)
    optimizer             Megatron-Core's optimizer.state_dict() (absent with --no-save-optim)
    opt_param_scheduler   the learning-rate schedule
    rng_state             [ {random_rng_state, np_rng_state, torch_rng_state, cuda_rng_state,
                          rng_tracker_states} ] (absent with --no-save-rng)
    lora / ...            the `extra` common state of save_checkpoint (LoRA's settings)

With the distributed optimizer, its parameter state (fp32 masters and Adam's moments, gathered over the
data-parallel group) is distrib_optim.pt, Megatron-Core's save_parameter_state; the optimizer entry then
holds only the parameter groups and step.

The files are Megatron-LM's, so its own loader reads them (the model's names are Megatron-Core's local
spec's; a Transformer Engine model names its norms otherwise). They are read back here with torch's
weights-only unpickler and only the types such a file holds (common_state, numpy's RNG state).

A save goes through the same staging as torch_dist's (scan): everything is written under
iter_NNNNNNN.partial, renamed when every rank's files are complete, then the tracker is written; a save
killed or failing midway leaves the tracked checkpoint as it was. A failure on any rank is one line on
every rank. A legacy checkpoint loads only at the parallel sizes it was saved at (its files are per
rank); any other layout is refused in one line naming them.
"""
from __future__ import annotations

import argparse
import functools
import os
import random
import zipfile
from contextlib import contextmanager

import numpy as np
import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from mindspeed.checkpoint import scan
from mindspeed.checkpoint.common_state import UnsafeCommonState, load_common
from mindspeed.checkpoint.run_flags import plain_flags
from mindspeed.checkpoint.scan import iteration_dir
from mindspeed.checkpoint.staged_save import agreed, staged_save, write_failure
from mindspeed.checkpoint.torch_dist import (DIR_MODE, FILE_MODE, TRACKER, _finish_param_gathers, _model_keys,
                                             _restore_adam_steps, _unwrap, distributed_parts, no_optimizer_refusal,
                                             other_architecture_refusal)
from mindspeed.errors import CheckpointError, one_line

MODEL_FILE, DIST_OPTIM_FILE = "model_optim_rng.pt", "distrib_optim.pt"
CHECKPOINT_VERSION = 3.0

try:                                          # what pickling numpy's RNG state names
    from numpy._core.multiarray import _reconstruct   # numpy 2
except ImportError:
    from numpy.core.multiarray import _reconstruct    # numpy 1
NUMPY_GLOBALS = (np.ndarray, np.dtype, _reconstruct, type(np.dtype(np.uint32)))


# --- names -------------------------------------------------------------------------------------

def rank_dir_name(tp: int, pp: int, ep: int, pp_size: int, ep_size: int) -> str:
    """Megatron-LM's directory of one model-parallel rank."""
    return f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pp_size > 1 else "") + (f"_{ep:03d}" if ep_size > 1 else "")


def _sizes() -> tuple[int, int, int]:
    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size())


def own_rank_dir() -> str:
    _tp, pp_size, ep_size = _sizes()
    return rank_dir_name(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                         ps.get_expert_model_parallel_rank(), pp_size, ep_size)


def expected_rank_dirs(tp_size: int, pp_size: int, ep_size: int) -> list[str]:
    return sorted(rank_dir_name(t, p, e, pp_size, ep_size)
                  for t in range(tp_size) for p in range(pp_size) for e in range(ep_size))


def _distributed(optimizer) -> bool:
    return bool(distributed_parts(optimizer))


def _writes_parameter_state(optimizer) -> bool:
    """Whether Megatron-Core's save_parameter_state writes distrib_optim.pt on this rank: data-parallel
    rank 0 of (one of) its distributed optimizers."""
    return any(opt.data_parallel_group.rank() == 0 for opt in distributed_parts(optimizer))


# --- saving ----------------------------------------------------------------------------------------

def saved_args(args, consumed_samples: int, iteration: int):
    """The `args` entry: the run's plain flags as Megatron-LM's Namespace, with the data position where
    Megatron-LM reads it (consumed_train_samples)."""
    values = plain_flags(args) if args is not None else {}
    values.update(consumed_train_samples=consumed_samples, consumed_valid_samples=0, skipped_train_samples=0,
                  iteration=iteration)
    return argparse.Namespace(**values)


def _device_generator(chunks):
    """The torch module whose generator is the device's for the model's parameters (torch.cuda,
    torch.npu), or None on cpu, where the device generator is torch's own."""
    kind = next(_unwrap(chunks[0]).parameters()).device.type
    return None if kind == "cpu" else torch.get_device_module(kind)


def rng_state(chunks) -> dict:
    """This rank's RNG state, as Megatron-LM's get_rng_state collects it (the device generator is the
    cpu one on cpu)."""
    device = _device_generator(chunks)
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": (device or torch).get_rng_state(),
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def state_dict(chunks, optimizer, scheduler, iteration: int, consumed_samples: int, *, args=None,
               only=None, extra: dict | None = None, save_rng: bool = True) -> dict:
    """model_optim_rng.pt's dict for this rank (Megatron-LM's generate_state_dict for ckpt-format torch)."""
    state = {"args": saved_args(args, consumed_samples, iteration), "checkpoint_version": CHECKPOINT_VERSION,
             "iteration": iteration}
    for key, chunk in zip(_model_keys(chunks), chunks):
        model = _unwrap(chunk).state_dict_for_save_checkpoint()
        state[key] = model if only is None else type(model)((k, v) for k, v in model.items() if only(k))
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    state["opt_param_scheduler"] = scheduler.state_dict()
    if save_rng:
        state["rng_state"] = [rng_state(chunks)]
    state.update(extra or {})
    return state


def _write_rank_files(rank_dir: str, state: dict | None, optimizer) -> str | None:
    """This rank's files under `rank_dir` (the model file where `state` is given); the problem, or None.
    The distributed optimizer's gather runs on every rank whatever happened before it here."""
    problem = None
    try:
        os.makedirs(rank_dir, mode=DIR_MODE, exist_ok=True)
    except OSError as err:
        problem = write_failure(rank_dir, err)
    if _distributed(optimizer):
        path = os.path.join(rank_dir, DIST_OPTIM_FILE)
        try:
            if _writes_parameter_state(optimizer) and problem is None:
                with open(path, "wb") as f:
                    optimizer.save_parameter_state(f)      # collectives, then torch.save on the writer
            else:
                optimizer.save_parameter_state(path)       # the gather only: this rank writes nothing
        except (OSError, RuntimeError) as err:
            problem = problem or write_failure(path, err)
    if state is not None and problem is None:
        path = os.path.join(rank_dir, MODEL_FILE)
        try:
            with open(path, "wb") as f:
                torch.save(state, f)
        except (OSError, RuntimeError) as err:
            problem = write_failure(path, err)
    return problem


def save_checkpoint(root: str, iteration: int, chunks, optimizer, scheduler, consumed_samples: int, *,
                    args=None, only=None, extra: dict | None = None, save_rng: bool = True) -> str:
    """Save in Megatron-LM's legacy layout; same contract as torch_dist.save_checkpoint (staged_save:
    staged, then published, then the tracker; a failure on any rank is one CheckpointError on every rank)."""
    def write(staged: str) -> str | None:
        _finish_param_gathers(chunks)
        writer = ps.get_expert_data_parallel_rank() == 0      # one copy per model-parallel rank, as Megatron-LM
        state = state_dict(chunks, optimizer, scheduler, iteration, consumed_samples, args=args, only=only,
                           extra=extra, save_rng=save_rng) if writer else None
        return _write_rank_files(os.path.join(staged, own_rank_dir()), state, optimizer)
    return staged_save(root, iteration, write)


# --- checking and reading -------------------------------------------------------------------------

def read_file(path: str, mmap: bool = False) -> dict:
    """A model_optim_rng.pt, unpickled without running code (UnsafeCommonState names a foreign type)."""
    return load_common(path, NUMPY_GLOBALS, mmap=mmap)


def _check_file(path: str) -> str | None:
    """None when `path` is a whole torch.save file (a zip archive whose members all lie inside it)."""
    try:
        size = os.path.getsize(path)
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except FileNotFoundError:
        return f"{path} is missing"
    except (OSError, zipfile.BadZipFile) as err:
        return f"{path} is unreadable ({one_line(str(err), 120)})"
    if not any(m.filename.endswith("/data.pkl") for m in members):
        return f"{path} is not a torch.save file"
    if any(m.header_offset + m.compress_size > size for m in members):
        return f"{path} is truncated"
    return None


def _rank_dirs_problem(directory: str, names: list[str]) -> str | None:
    """What is wrong with the mp_rank_* directories `names` (a mix of layouts, or the first directory of
    the grid they span that is absent); None when the grid is whole."""
    parsed = [tuple(int(g) for g in scan.LEGACY_RANK_DIR.match(n).groups() if g is not None) for n in names]
    if len({len(p) for p in parsed}) > 1:
        return f"{directory} mixes mp_rank_* directories of different layouts ({names[0]}, {names[-1]})"
    have = set(parsed)
    grid = [()]
    for axis in range(len(parsed[0])):
        grid = [g + (i,) for g in grid for i in range(1 + max(p[axis] for p in parsed))]
    for rank in grid:
        if rank not in have:
            name = "mp_rank_" + "_".join([f"{rank[0]:02d}", *(f"{r:03d}" for r in rank[1:])])
            return f"{os.path.join(directory, name)} is missing"
    return None


def check_iteration(directory: str) -> str | None:
    """None when every rank's files of the legacy checkpoint in `directory` are present and whole;
    else the problem, naming the file. Reads only the archives' directories."""
    names = scan.legacy_rank_dirs(directory)
    if not names:
        return f"{directory} holds no mp_rank_* directories"
    problem = _rank_dirs_problem(directory, names)
    if problem:
        return problem
    for name in names:
        for file in (MODEL_FILE, DIST_OPTIM_FILE):
            path = os.path.join(directory, name, file)
            if file == MODEL_FILE or os.path.exists(path):
                problem = _check_file(path)
                if problem:
                    return problem
    return None


def first_state(directory: str) -> dict:
    """The first rank's file of the checkpoint in `directory`, its tensors left on disk (mmap). A resume
    asks it for the vocabulary rows, then the common state: unpickled once (the file is never rewritten
    in place: a save publishes a new directory, so a file of the same identity holds the same state)."""
    path = os.path.join(directory, scan.legacy_rank_dirs(directory)[0], MODEL_FILE)
    stat = os.stat(path)
    return _read_once(path, (stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=1)
def _read_once(path: str, identity: tuple) -> dict:
    return read_file(path, mmap=True)


def read_common(directory: str, state: dict | None = None) -> dict:
    """The non-tensor state of the checkpoint in `directory` (`state`: its first rank's file, read when not
    given): iteration, consumed_train_samples, opt_param_scheduler, what `extra` added, and no_optimizer
    (saved with --no-save-optim: the file holds no optimizer entry, as Megatron-LM's)."""
    state = first_state(directory) if state is None else state
    common = {k: v for k, v in state.items()
              if not k.startswith("model") and k not in ("args", "optimizer", "rng_state")}
    common["consumed_train_samples"] = int(getattr(state.get("args"), "consumed_train_samples", 0))
    common["no_optimizer"] = "optimizer" not in state
    return common


def sizes_saved_in(state: dict) -> tuple[int, int, int] | None:
    """(TP, PP, EP) a rank file's `args` says it was saved at; None when it does not say."""
    try:
        args = state.get("args")
        return (int(args.tensor_model_parallel_size), int(args.pipeline_model_parallel_size),
                int(getattr(args, "expert_model_parallel_size", 1) or 1))
    except (AttributeError, TypeError, ValueError):
        return None


def saved_sizes(directory: str) -> tuple[int, int, int] | None:
    """(TP, PP, EP) the checkpoint in `directory` was saved at; None when its first file does not say."""
    try:
        return sizes_saved_in(first_state(directory))
    except (OSError, RuntimeError, UnsafeCommonState):
        return None


def vocab_rows(directory: str) -> int | None:
    """The vocabulary rows of the whole embedding (its TP shards' rows together); None without one."""
    state = first_state(directory)
    sizes = sizes_saved_in(state)
    model = state.get("model", state.get("model0", {}))
    weight = model.get("embedding.word_embeddings.weight")
    return None if weight is None or sizes is None else int(weight.shape[0]) * sizes[0]


# --- loading -------------------------------------------------------------------------------------

def _layout_refusal(directory: str, saved: tuple[int, int, int] | None, here: tuple[int, int, int]) -> str:
    shown = f"TP {saved[0]} x PP {saved[1]} x EP {saved[2]}" if saved else \
        f"{len(scan.legacy_rank_dirs(directory))} mp_rank_* directories"
    return (f"checkpoint {directory} is Megatron-LM's legacy per-rank format (--ckpt-format torch), saved at "
            f"{shown}: it loads only at those sizes (this run: TP {here[0]} x PP {here[1]} x EP {here[2]}); run "
            "at them, or resume it once at them with --ckpt-format torch_dist --save DIR and load DIR at any size")


def _selected(model: dict, only) -> dict:
    return {k: v for k, v in model.items() if only is None or only(k)}


def fit_problem(root: str, directory: str, chunks, state: dict, only=None) -> str | None:
    """Why the saved model does not load into `chunks` (other tensors, other shapes); None when it does."""
    keys = _model_keys(chunks)
    absent = [key for key in keys if key not in state]
    if absent:
        saved = sorted(k for k in state if k.startswith("model"))
        return (f"checkpoint {directory} holds model chunk(s) {', '.join(saved)}, this run has {', '.join(keys)}: "
                "give the virtual pipeline flags it was trained with")
    for key, chunk in zip(keys, chunks):
        own, saved = _selected(_unwrap(chunk).state_dict_for_save_checkpoint(), only), _selected(state[key], only)
        extra = sorted(k for k in saved if k not in own and not k.endswith("_extra_state"))
        if extra:
            return other_architecture_refusal(root, directory, extra)
        missing = sorted(k for k in own if k not in saved and not k.endswith("_extra_state"))
        if missing:
            return f"checkpoint {directory} does not fit this model: it has no {', '.join(missing[:3])}"
        for name, value in own.items():
            other = saved.get(name)
            if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) and other.shape != value.shape:
                return (f"checkpoint {directory} does not fit this model: {name} is {list(other.shape)} there, "
                        f"{list(value.shape)} here (other model flags or --padded-vocab-size)")
    return None


def optimizer_problem(directory: str, rank_dir: str, state: dict, optimizer) -> str | None:
    """Why the saved optimizer state does not load into `optimizer`; None when it does."""
    if "optimizer" not in state:
        return no_optimizer_refusal(directory)
    has_parameter_state = os.path.isfile(os.path.join(rank_dir, DIST_OPTIM_FILE))
    if _distributed(optimizer) and not has_parameter_state:
        return (f"checkpoint {directory} was saved without --use-distributed-optimizer (no {DIST_OPTIM_FILE}): "
                "resume it without that flag, or with --no-load-optim")
    if has_parameter_state and not _distributed(optimizer):
        return (f"checkpoint {directory} was saved with --use-distributed-optimizer ({DIST_OPTIM_FILE}): add that "
                "flag, or resume it with --no-load-optim")
    return None


def _read_own(root: str, directory: str, chunks, optimizer, use_optim: bool, only) -> dict:
    """This rank's file, checked against the model and the optimizer on every rank before any is loaded:
    one CheckpointError, the same on every rank, when any rank's does not fit (the layout first: the
    directory names, then the sizes in the file's args, the same in every rank's file)."""
    here = _sizes()
    if scan.legacy_rank_dirs(directory) != expected_rank_dirs(*here):
        raise CheckpointError(_layout_refusal(directory, saved_sizes(directory), here))
    rank_dir = os.path.join(directory, own_rank_dir())
    state, problem = None, None
    try:
        state = read_file(os.path.join(rank_dir, MODEL_FILE))
    except UnsafeCommonState as err:
        problem = f"checkpoint {directory} cannot be read: {err}"
    except Exception as err:      # a damaged archive or pickle surfaces as several exception types
        problem = f"checkpoint {directory} cannot be read: {os.path.join(rank_dir, MODEL_FILE)}: " \
                  f"{one_line(f'{type(err).__name__}: {err}', 200)}"
    if state is not None:
        saved = sizes_saved_in(state)
        problem = (_layout_refusal(directory, saved, here) if saved not in (None, here) else None) or \
            fit_problem(root, directory, chunks, state, only) or \
            (optimizer_problem(directory, rank_dir, state, optimizer) if use_optim else None)
    problem = agreed(problem)
    if problem:
        raise CheckpointError(problem)
    return state


@contextmanager
def _steps_aside(optimizer):
    """Without Apex/TE, torch's Adam keeps its 'step' beside the moments in each parameter's state, and
    Megatron-Core's load_parameter_state copies every entry of that state from distrib_optim.pt, which
    holds the masters and moments only (KeyError: 'step'). The steps are set aside meanwhile; the loaded
    groups' step then sets them (_restore_adam_steps)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    aside = [(state, state.pop("step")) for opt in getattr(optimizer, "chained_optimizers", [optimizer])
             if isinstance(opt, DistributedOptimizer) for state in opt.optimizer.state.values() if "step" in state]
    try:
        yield
    finally:
        for state, step in aside:
            state.setdefault("step", step)


def restore_rng(state: dict, directory: str, chunks) -> None:
    """The RNG state of the checkpoint's first data-parallel rank (Megatron-LM's, without
    --data-parallel-random-init) into this process's generators."""
    rng = state["rng_state"][0] if isinstance(state["rng_state"], list) else state["rng_state"]
    try:
        random.setstate(rng["random_rng_state"])
        np.random.set_state(rng["np_rng_state"])
        torch.set_rng_state(rng["torch_rng_state"])
        (_device_generator(chunks) or torch).set_rng_state(rng["cuda_rng_state"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["rng_tracker_states"])
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint {directory}: its RNG state does not load on this device "
                              f"({one_line(f'{type(err).__name__}: {err}', 120)}): resume it with --no-load-rng") from None


def load_checkpoint(root: str, iteration: int, chunks, optimizer, scheduler, *, load_optim: bool = True,
                    finetune: bool = False, only=None, load_rng: bool = True) -> tuple[int, int]:
    """Load iteration `iteration` of `root` (checked already: check_iteration) into chunks / optimizer /
    scheduler and, unless load_rng is False, the RNG; return (iteration, consumed samples); (0, 0) with
    finetune. Same contract as torch_dist.load_checkpoint."""
    directory = iteration_dir(root, iteration)
    use_optim = load_optim and not finetune and optimizer is not None
    state = _read_own(root, directory, chunks, optimizer, use_optim, only)
    with torch.no_grad():   # main params are views of the model's parameters
        for key, chunk in zip(_model_keys(chunks), chunks):
            _unwrap(chunk).load_state_dict(_selected(state[key], only), strict=False)   # fit_problem checked
        if use_optim:
            optimizer.load_state_dict(state["optimizer"])
            if _distributed(optimizer):
                with _steps_aside(optimizer):
                    optimizer.load_parameter_state(os.path.join(directory, own_rank_dir(), DIST_OPTIM_FILE))
            _restore_adam_steps(optimizer)
        elif optimizer is not None:   # as Megatron-LM: fp32 masters from the loaded bf16/fp16 weights
            optimizer.reload_model_params()
    if finetune:
        return 0, 0
    consumed = int(getattr(state.get("args"), "consumed_train_samples", 0))
    if state.get("opt_param_scheduler"):
        scheduler.load_state_dict(state["opt_param_scheduler"])
    else:
        scheduler.step(increment=consumed)
    if load_rng and "rng_state" in state:
        restore_rng(state, directory, chunks)
    return int(state["iteration"]), consumed
