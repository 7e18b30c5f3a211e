"""Checkpoints through megatron.core.dist_checkpointing (torch_dist format: sharded, reshardable,
no pickled code on load; common.pt is read with torch's weights-only unpickler and only the types
Megatron puts there, `common_state`).

Layout (Megatron's): <dir>/latest_checkpointed_iteration.txt and <dir>/iter_0000010/...
Everything written here is files 0640 / directories 0750.

A checkpoint is checked before it is loaded (`check_iteration`: every file present, the index
`.metadata` parsed without running code, every shard file as long as the index says), on every
rank and before any collective, so a truncated or missing file stops every rank with the same
one-line CheckpointError that names the file and the last readable iteration. Nothing is written
on that path: the tracker file and the checkpoints stay as they are.
"""
from __future__ import annotations

import enum
import json
import os
from contextlib import ExitStack, contextmanager
import pickle

import torch
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from mindspeed.files import PRIVATE_DIR, PRIVATE_FILE
from mindspeed.checkpoint import cross_format, neutral, scan
from mindspeed.checkpoint.common_state import UnsafeCommonState, load_common
from mindspeed.checkpoint.scan import iteration_dir
from mindspeed.errors import CheckpointError, one_line, resume_hint, unreadable
from mindspeed.checkpoint.save_guard import writer_failures_reported
from mindspeed.checkpoint.staged_save import TRACKER, staged_save

FILE_MODE, DIR_MODE = PRIVATE_FILE, PRIVATE_DIR
INDEX_FILE, COMMON_FILE, FORMAT_FILE = ".metadata", "common.pt", "metadata.json"




def read_tracker(root: str, step: int | None = None) -> int:
    """The iteration to load: `step` when given, else the one recorded in
    <root>/latest_checkpointed_iteration.txt, after checking that its files can be read
    (check_iteration); one-line CheckpointErrors otherwise, naming the last readable iteration."""
    if not os.path.isdir(root):
        raise CheckpointError(f"--load path {root!r} does not exist or is not a directory")
    if step is not None:
        if not os.path.isdir(iteration_dir(root, step)):
            raise CheckpointError(f"--ckpt-step {step}: {iteration_dir(root, step)} does not exist; "
                                  f"{resume_hint(root, last_readable(root))}")
        iteration = step
    else:
        iteration = _tracked_iteration(root)
    problem = check_iteration(iteration_dir(root, iteration))
    if problem:
        raise unreadable(root, iteration, problem, last_readable(root, exclude=iteration))
    return iteration


def _tracked_iteration(root: str) -> int:
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        raise CheckpointError(f"--load path {root!r} holds no {TRACKER}: not a checkpoint directory "
                              "written by --save")
    try:
        with open(tracker, encoding="utf-8", errors="replace") as f:
            text = f.read().strip()
    except OSError as err:
        raise CheckpointError(f"cannot read {tracker}: {err.strerror}; "
                              f"{resume_hint(root, last_readable(root))}") from err
    if not text.isdigit():
        raise CheckpointError(f"{tracker} should hold an iteration number, found {text[:40]!r}; "
                              f"{resume_hint(root, last_readable(root))}")
    iteration = int(text)
    if not os.path.isdir(iteration_dir(root, iteration)):
        raise CheckpointError(f"{tracker} names iteration {iteration} but {iteration_dir(root, iteration)} "
                              f"is missing; {resume_hint(root, last_readable(root, exclude=iteration))}")
    return iteration


# --- checking a checkpoint's files without loading it ------------------------------------------

class _IndexUnpickler(pickle.Unpickler):
    """Reads torch.distributed.checkpoint's index (.metadata, a pickle) without running code: only
    the classes such an index is made of can be named in it. Python 3.11.0-3.11.4 pickle an enum
    member as `getattr(EnumClass, 'NAME')`: `builtins.getattr` is answered with `_enum_member`, which
    returns a member of an enum class that passed this filter and refuses every other attribute."""
    _BUILTINS = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                 ("torch", "Size"), ("torch.serialization", "_get_layout")}

    def find_class(self, module, name):
        if (module, name) in self._BUILTINS:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith("torch.distributed.checkpoint.") and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint index never holds "
                                     "(not loaded: it could run code)")


def _enum_member(owner, name):
    """getattr as an index may use it: a member of one of torch.distributed.checkpoint's enums."""
    if isinstance(owner, type) and issubclass(owner, enum.Enum) and \
            owner.__module__.startswith("torch.distributed.checkpoint.") and \
            isinstance(name, str) and name in owner.__members__:
        return owner.__members__[name]
    raise pickle.UnpicklingError(f"it asks for getattr({getattr(owner, '__qualname__', type(owner).__name__)}, "
                                 f"{name!r}), which a checkpoint index never holds (not loaded: it could run code)")


def read_index(directory: str):
    """The torch.distributed.checkpoint Metadata of an iteration directory (restricted unpickling)."""
    with open(os.path.join(directory, INDEX_FILE), "rb") as f:
        return _IndexUnpickler(f).load()


def _describe(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = str(err).strip()
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def is_neutral(directory: str) -> bool:
    """The MindSpore trainer's framework-neutral safetensors checkpoint, not a torch_dist one."""
    return os.path.isfile(os.path.join(directory, "model.safetensors")) and \
        not os.path.isfile(os.path.join(directory, INDEX_FILE))


def check_iteration(directory: str) -> str | None:
    """None when every file of the torch_dist checkpoint in `directory` is present and as long as
    its index says; else the problem, naming the file (one phrase). Reads only the small files
    (metadata.json, common.pt, .metadata) and the sizes of the shard files."""
    if not os.path.isdir(directory):
        return f"{directory} is missing"
    if is_neutral(directory):      # written by the MindSpore trainer: loads through cross_format
        return neutral.check_iteration(directory)
    if scan.is_legacy(directory):  # Megatron-LM's per-rank files (--ckpt-format torch)
        from mindspeed.checkpoint import legacy   # it builds on this module
        return legacy.check_iteration(directory)
    for name in (FORMAT_FILE, COMMON_FILE, INDEX_FILE):
        if not os.path.isfile(os.path.join(directory, name)):
            return f"{os.path.join(directory, name)} is missing"
    path = os.path.join(directory, FORMAT_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            if not isinstance(json.load(f), dict):
                return f"{path} is not a Megatron checkpoint description"
    except (OSError, ValueError) as err:
        return f"{path} is unreadable ({_describe(err)})"
    path = os.path.join(directory, COMMON_FILE)
    try:
        load_common(path)
    except UnsafeCommonState as err:
        return str(err)
    except Exception as err:   # a damaged zip or pickle surfaces as several exception types
        return f"{path} is unreadable ({_describe(err)})"
    path = os.path.join(directory, INDEX_FILE)
    try:
        index = read_index(directory)
        storage = index.storage_data
        needed: dict[str, int] = {}
        for info in storage.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Exception as err:   # EOFError, UnpicklingError, AttributeError, ... from a damaged index
        return f"{path} is unreadable ({_describe(err)})"
    for name, size in sorted(needed.items()):
        shard = os.path.join(directory, name)
        if not os.path.isfile(shard):
            return f"{shard} is missing (the index {INDEX_FILE} lists it)"
        have = os.path.getsize(shard)
        if have < size:
            return f"{shard} is truncated ({have} bytes, the index {INDEX_FILE} needs {size})"
    return None


def find_damaged_tensor(directory: str) -> str | None:
    """After a failed load: decode every tensor of every shard file (as the loader does) and name
    the first one that cannot be read; None when all decode (the problem is elsewhere)."""
    import io
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    try:
        index = read_index(directory)
    except Exception as err:
        return f"{os.path.join(directory, INDEX_FILE)} is unreadable ({_describe(err)})"
    by_file: dict[str, list] = {}
    for key, info in index.storage_data.items():
        if isinstance(index.state_dict_metadata.get(key.fqn), TensorStorageMetadata):
            by_file.setdefault(info.relative_path, []).append((info.offset, info.length, key.fqn))
    for name, items in sorted(by_file.items()):
        shard = os.path.join(directory, name)
        try:
            with open(shard, "rb") as f:
                for offset, length, fqn in sorted(items):
                    f.seek(offset)
                    blob = f.read(length)
                    try:
                        torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
                    except Exception as err:
                        return f"{shard} is corrupt: tensor {fqn!r} at byte {offset} cannot be decoded " \
                               f"({one_line(_describe(err), 80)})"   # torch.load's own text runs to lines
        except OSError as err:
            return f"{shard} is unreadable ({_describe(err)})"
    return None


def last_readable(root: str, exclude: int | None = None) -> int | None:
    """The newest iteration under root (other than `exclude`) whose files pass check_iteration."""
    return scan.last_readable(root, check_iteration, exclude)


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def _sharded_in_place(chunk) -> bool:
    """FSDP2 (--use-torch-fsdp2): dist_checkpointing has loaded each parameter's local shard in place (the
    sharded state holds the shards themselves), as Megatron-LM's load relies on."""
    from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
    return isinstance(chunk, TorchFullyShardedDataParallel)


@contextmanager
def _sharded_states_kept(optimizer):
    """FSDP2: the optimizer's sharded (DTensor) states, loaded in place, stay as they are; torch's
    load_state_dict would put plain tensor copies in their place (their parameters stay DTensors)."""
    from torch.distributed.tensor import DTensor
    kept = [(opt.optimizer, param, key, value) for opt in optimizer_parts(optimizer, object)
            for param, state in opt.optimizer.state.items() for key, value in state.items()
            if isinstance(value, DTensor)]
    yield
    for torch_optimizer, param, key, value in kept:    # the load replaced the state dicts themselves
        torch_optimizer.state[param][key] = value


def _model_keys(chunks) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def optimizer_parts(optimizer, kind) -> list:
    """The parts of `optimizer` (a ChainedOptimizer's, or itself) that are `kind`; [] for None."""
    if optimizer is None:
        return []
    return [opt for opt in getattr(optimizer, "chained_optimizers", [optimizer]) if isinstance(opt, kind)]


def distributed_parts(optimizer) -> list:
    """The DistributedOptimizers among `optimizer`'s parts."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    return optimizer_parts(optimizer, DistributedOptimizer)


def _init_empty_distributed_optimizer_state(optimizer) -> None:
    """Without Apex/TE, DistributedOptimizer.state_dict() needs Adam's 'step' to exist before a
    load; a dummy zero-grad step creates the state that the checkpoint then overwrites."""
    for opt in distributed_parts(optimizer):
        if len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer) -> None:
    """Without Apex/TE, Megatron's DistributedOptimizer keeps Adam's 'step' in the checkpoint's
    param_groups, but its load leaves the per-parameter torch 'step' at the value of the dummy
    state (and, where it does set it, shares one tensor among all parameters, which torch then
    advances once per parameter). Give every parameter its own step from its group."""
    for opt in distributed_parts(optimizer):
        for group in opt.optimizer.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = opt.optimizer.state.get(param)
                if state and isinstance(state.get("step"), torch.Tensor):
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)


@contextmanager
def _float16_layout(optimizer):
    """Megatron-Core's Float16OptimizerWithFloat16Params (--bf16/--fp16 without the distributed
    optimizer) numbers its checkpointed parameters by `float16_groups` alone: it assumes every model
    parameter is float16, as Megatron-LM's Float16Module makes them. The built-in trainer keeps the
    norms' weights fp32 (Megatron-Core creates them so), and those sit among the float16 ones in the
    optimizer's groups, so the numbering no longer matches the torch optimizer's ("Param id N does
    not match any model sharded param"). While saving or loading, show it every parameter in its
    group's order (an fp32 one as its own master), so ids and masters line up; an fp32 parameter's
    master is then checkpointed too, as in Megatron-LM's all-float16 models."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    with ExitStack() as stack:
        for opt in optimizer_parts(optimizer, Float16OptimizerWithFloat16Params):
            stack.enter_context(_every_param_as_float16(opt))
        yield


@contextmanager
def _every_param_as_float16(opt):
    model_of = {id(main): model for mains, models in zip(opt.fp32_from_float16_groups, opt.float16_groups)
                for main, model in zip(mains, models)}
    saved = opt.float16_groups, opt.fp32_from_float16_groups
    groups = [list(g["params"]) for g in opt.optimizer.param_groups]
    opt.float16_groups = [[model_of.get(id(p), p) for p in g] for g in groups]
    opt.fp32_from_float16_groups = groups
    try:
        yield
    finally:
        opt.float16_groups, opt.fp32_from_float16_groups = saved


def _sharded_state(chunks, optimizer, is_loading: bool, only=None) -> dict:
    # metadata: a dict Megatron fills with the DP x CP group in place (GPTModel's MTP stage without the
    # embedding reads it back from its own argument, which stays None when none is given)
    state = {key: _unwrap(chunk).sharded_state_dict(metadata={}) for key, chunk in zip(_model_keys(chunks), chunks)}
    if only is not None:
        state = {key: {name: value for name, value in model.items() if only(name)} for key, model in state.items()}
    if optimizer is not None:
        if is_loading:
            _init_empty_distributed_optimizer_state(optimizer)
        # dp_reshardable: Megatron-LM's default (the flattened 'fully_sharded_model_space' format
        # is rejected by dist_checkpointing 0.16)
        with _float16_layout(optimizer):
            state["optimizer"] = optimizer.sharded_state_dict(
                state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    return state


def _finish_param_gathers(chunks) -> None:
    """--overlap-param-gather defers the parameter all-gather that follows each update of the
    distributed optimizer to the next forward's pre-hooks: until then a rank holds only its own shard
    of the updated weights (the others as before the update; with --reuse-fp32-param, fp32 bits where
    its master shard borrowed a neighbour's). A save reads whole weights: gather now (waiting for one
    in flight), as Megatron-LM's save does (force_param_sync); the next forward finds it done."""
    for chunk in chunks:
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)


def save_checkpoint(root: str, iteration: int, chunks, optimizer, scheduler, consumed_samples: int,
                    sharded_strategy=None, only=None, extra: dict | None = None) -> str:
    """sharded_strategy: dist_checkpointing's (default: Megatron's torch_dist writer; the converter
    passes its streaming one). only(name): which of the model's tensors to save (default all; LoRA
    saves its adapters); extra: more common state (plain values, read back by read_common). Staged,
    published, then tracked (staged_save: a failure on any rank stops every rank in one line)."""
    def write(staged: str) -> None:
        _finish_param_gathers(chunks)
        state = _sharded_state(chunks, optimizer, is_loading=False, only=only)
        state.update(iteration=iteration, consumed_train_samples=consumed_samples,
                     opt_param_scheduler=scheduler.state_dict(), checkpoint_version=3.0, **(extra or {}))
        try:
            with writer_failures_reported():
                dist_checkpointing.save(state, staged, sharded_strategy=sharded_strategy)
        except CheckpointException as err:     # raised on every rank; only the coordinator has the cause
            raise _save_failure(iteration_dir(root, iteration), err) from None
    return staged_save(root, iteration, write)


def load_checkpoint(root: str, chunks, optimizer, scheduler, *, load_optim: bool = True,
                    finetune: bool = False, step: int | None = None, only=None,
                    load_rng: bool = False) -> tuple[int, int]:
    """Load into chunks/optimizer/scheduler in place; return (iteration, consumed samples).
    A neutral checkpoint (the MindSpore trainer's) loads too (cross_format), and one in Megatron-LM's
    legacy per-rank layout (legacy: whatever --ckpt-format says; with its RNG state when load_rng).
    only(name): which of the model's tensors to load (default all); the others keep their values."""
    iteration = read_tracker(root, step)
    path = iteration_dir(root, iteration)
    if scan.is_legacy(path):
        from mindspeed.checkpoint import legacy
        return legacy.load_checkpoint(root, iteration, chunks, optimizer, scheduler, load_optim=load_optim,
                                      finetune=finetune, only=only, load_rng=load_rng)
    use_optim = load_optim and not finetune
    if use_optim and optimizer is not None and saved_without_optimizer(root, iteration):
        raise CheckpointError(no_optimizer_refusal(path))
    state = _sharded_state(chunks, optimizer if use_optim else None, is_loading=True, only=only)
    if only is None and not is_neutral(path):
        _refuse_other_architecture(root, path, [state[key] for key in _model_keys(chunks)])
    if not finetune:
        state.update(iteration=0, consumed_train_samples=0, opt_param_scheduler={}, checkpoint_version=0.0)
    if is_neutral(path):
        loaded = cross_format.fill_from_neutral(state, path)
    else:
        try:
            loaded = dist_checkpointing.load(state, path)
        except (Exception, CheckpointException) as err:   # CheckpointException is a BaseException
            raise _load_failure(root, iteration, err) from None
    try:
        with torch.no_grad():   # main params are views of the model's parameters
            for key, chunk in zip(_model_keys(chunks), chunks):
                if not _sharded_in_place(chunk):
                    _load_model(_unwrap(chunk), loaded[key], only)
            if use_optim:
                with _float16_layout(optimizer), _sharded_states_kept(optimizer):
                    optimizer.load_state_dict(loaded["optimizer"])
                _restore_adam_steps(optimizer)
            elif optimizer is not None:   # as Megatron-LM: fp32 masters from the loaded bf16/fp16 weights
                optimizer.reload_model_params()
    except (KeyError, ValueError, RuntimeError) as err:   # state that does not fit this model
        raise CheckpointError(f"checkpoint {path} does not fit this model: {_describe(err)}") from None
    if finetune:
        return 0, 0
    consumed = int(loaded["consumed_train_samples"])
    if loaded.get("opt_param_scheduler"):
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    else:                      # a neutral checkpoint keeps no schedule: this run's, at the samples consumed
        scheduler.step(increment=consumed)
    return int(loaded["iteration"]), consumed


def _refuse_other_architecture(root: str, path: str, model_states: list) -> None:
    """dist_checkpointing loads the tensors the model asks for and ignores the others: a checkpoint of
    another architecture (with q/k norms, more layers, an MTP block) would load into a smaller model
    without a word, dropping its weights. Refused in one line, naming the first tensors it would drop."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    local = {getattr(v, "key", None) for state in model_states for v in nested_values(state)}
    every_rank = [None] * torch.distributed.get_world_size()     # pipeline stages hold different layers
    torch.distributed.all_gather_object(every_rank, local)
    wanted = set().union(*every_rank)
    saved = dist_checkpointing.load_tensors_metadata(path)
    extra = sorted(k for k in saved if k not in wanted and not k.startswith(("chained_", "optimizer")))
    if extra:
        raise CheckpointError(other_architecture_refusal(root, path, extra))


def no_optimizer_refusal(path: str) -> str:
    """Either format's refusal of a --no-save-optim checkpoint where optimizer state is asked for."""
    return (f"checkpoint {path} holds no optimizer state (saved with --no-save-optim): resume it with "
            "--no-load-optim (or --finetune)")


def other_architecture_refusal(root: str, path: str, extra: list[str]) -> str:
    """Either format's refusal of a checkpoint holding weight tensors (`extra`) this model does not have."""
    return (f"checkpoint {path} holds {len(extra)} weight tensor(s) this model does not have "
            f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}): it was trained with other "
            f"model flags (see {os.path.join(root, 'run_flags.json')}); give those flags")


def _load_model(model, loaded: dict, only) -> None:
    """load_state_dict, strict over the tensors `only` selects (all when None)."""
    if only is None:
        model.load_state_dict(loaded)
        return
    result = model.load_state_dict(loaded, strict=False)
    missing = [name for name in result.missing_keys if only(name)]
    if missing or result.unexpected_keys:
        raise KeyError(f"missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")


def saved_without_optimizer(root: str, iteration: int) -> bool:
    """--no-save-optim's checkpoint, of either trainer (torch_dist's common state, the neutral meta.json)."""
    path = iteration_dir(root, iteration)
    if is_neutral(path):
        return bool(neutral.read_meta(path).get("no_optimizer"))
    return bool(read_common(root, iteration).get("no_optimizer"))


def read_common(root: str, step: int | None = None) -> dict:
    """The common (non-tensor) state of the checkpoint --load would read: iteration, counters,
    and what save_checkpoint's `extra` added. {} for a neutral checkpoint."""
    directory = iteration_dir(root, read_tracker(root, step))
    if is_neutral(directory):
        return {}
    if scan.is_legacy(directory):
        from mindspeed.checkpoint import legacy
        return legacy.read_common(directory)
    return torch.load(os.path.join(directory, COMMON_FILE), map_location="cpu", weights_only=True)


def check_vocab_rows(root: str, step: int | None, rows: int) -> None:
    """Before the model is built, with --padded-vocab-size `rows`: the torch_dist checkpoint --load
    reads has at least that many vocabulary rows (embedding, output layer). torch_dist loads the
    rows both have, so a checkpoint with more rows loses only padding rows (`rows` is at least the
    vocabulary), as at another TP size; one with fewer would leave this model's last rows untrained.
    A neutral checkpoint's rows are fitted on load (cross_format); a checkpoint without an embedding
    (LoRA adapters) or with an unreadable index is left to the load to judge."""
    directory = iteration_dir(root, read_tracker(root, step))
    if is_neutral(directory):
        return
    if scan.is_legacy(directory):     # per-rank files: the rows load only as they are
        from mindspeed.checkpoint import legacy
        saved = legacy.vocab_rows(directory)
        if saved is not None and saved != rows:
            raise CheckpointError(f"checkpoint {directory} has {saved} vocabulary rows, this run {rows} "
                                  f"(--padded-vocab-size): give --padded-vocab-size {saved}")
        return
    try:
        meta = read_index(directory).state_dict_metadata
    except (OSError, EOFError, AttributeError, pickle.UnpicklingError):
        return
    saved = next((int(meta[key].size[0]) for key in cross_format.VOCAB_ROWS if key in meta), None)
    if saved is not None and saved < rows:
        raise CheckpointError(f"checkpoint {directory} has {saved} vocabulary rows, fewer than --padded-vocab-size "
                              f"{rows}: the other {rows - saved} would start untrained; give --padded-vocab-size "
                              f"{saved}, or convert the model with --padded-vocab-size {rows}")


def _load_failure(root: str, iteration: int, err: BaseException) -> CheckpointError:
    """One line for a load that failed after check_iteration passed. torch.distributed.checkpoint
    gathers every rank's failure and raises the same CheckpointException on all of them, so every
    rank builds the same line. A file that cannot be decoded is named; anything else (a model that
    does not match the checkpoint) is summarised from the first failing rank's exception."""
    path = iteration_dir(root, iteration)
    damaged = find_damaged_tensor(path)
    if damaged:
        return unreadable(root, iteration, damaged, last_readable(root, exclude=iteration))
    if isinstance(err, CheckpointException) and err.failures:
        rank, (cause, _trace) = min(err.failures.items(), key=lambda kv: kv[0])
        return CheckpointError(f"cannot load checkpoint {path}: {_describe(cause)} (rank {rank})")
    return CheckpointError(f"cannot load checkpoint {path}: {one_line(_describe(err))}")


def _save_failure(path: str, err: BaseException) -> CheckpointError:
    """One line for a save that failed on some rank: the first failing rank's cause where this rank
    has it (Megatron gives it to the coordinator), else where to find it. The tracker still names
    the last complete checkpoint."""
    rank = torch.distributed.get_rank()
    failures = getattr(err, "failures", None) or {}
    if failures:
        failed, cause = min(failures.items(), key=lambda kv: kv[0])
        cause = cause[0] if isinstance(cause, tuple) else cause
        return CheckpointError(f"saving {path} failed on rank {failed}: {_describe(cause)} "
                               f"(reported by rank {rank}; the tracker still names the last complete checkpoint)")
    return CheckpointError(f"saving {path} failed on another rank (rank 0's error line names the cause; "
                           f"reported by rank {rank})")
