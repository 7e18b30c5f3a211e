"""Run in a fresh process for the swap tests (a plain process: dist_checkpointing's save starts a
helper process, which a multiprocessing daemon may not):

    python -m tests_extend.unit.swap_workers ROOT   -> one JSON line on stdout

Trains the torch trainer (Megatron-Core GPT, Megatron's optimizers, mock data) with
--swap-attention / --swap-optimizer on and off from the same seed, counts the bytes each side
holds, and saves/loads checkpoints across the flags."""
from __future__ import annotations

import json
import sys

import torch

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "20", "--lr", "1e-2",
        "--mock-data", "--tensor-model-parallel-size", "1", "--seed", "5"]
STEPS = 4


class _Log:
    def print(self, *_):
        pass


class SavedBytes:
    """Bytes of activations saved for backward outside any swap scope (device side), each storage
    once; trainable leaves (weights) and views of them (torch's linear saves `weight.t()`) are not
    activations."""

    def __init__(self):
        self.seen, self.bytes = set(), 0

    def pack(self, t):
        base = t if t._base is None else t._base
        if not (base.requires_grad and base.is_leaf):
            key = t.untyped_storage().data_ptr()
            if key not in self.seen:
                self.seen.add(key)
                self.bytes += t.untyped_storage().nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def trainer_for(flags, base=TINY, vocab_size=60, world_size=1):
    """The built-in trainer in this process (world of one unless told), adapted for `base + flags`."""
    args, trainer, _session = trainer_and_session(flags, base, vocab_size, world_size)
    return args, trainer


def trainer_and_session(flags, base=TINY, vocab_size=60, world_size=1):
    import mindspeed
    from mindspeed.training import pretrain
    from mindspeed.flags.trainer_flags import parse_args
    args = parse_args(base + list(flags), world_size=world_size)
    mindspeed.unadapt()
    session = mindspeed.adapt(args)
    args.device_name = "cpu"
    args.vocab_size, args.padded_vocab_size = vocab_size, 128
    pretrain._set_seeds(args)
    return args, pretrain.Trainer(args, _Log()), session


class _Tok:
    vocab_size = 60
    eod = 0
    unique_identifiers = {"class": "mock"}


_DATA = []


def dataset(args):
    from mindspeed.training import data
    if not _DATA:       # every run here has the same data flags: build the mock dataset once
        _DATA.append(data.build_datasets(args, _Tok())[0])
    return _DATA[0]


def batches(args, tr, consumed=0):
    return tr.iterators(dataset(args), consumed)


def train(args, tr, steps, consumed=0):
    it = batches(args, tr, consumed)
    return [tr.train_step(it)[0] for _ in range(steps)]


def losses(flags, steps=STEPS, reports=None):
    """Losses of `steps` updates; with `reports`, also the optimizer swap's state after them."""
    args, tr = trainer_for(flags)
    out = train(args, tr, steps)
    if reports is not None:
        reports[" ".join(flags)] = optimizer_state(tr)
    return out


def memory():
    from mindspeed.backends import get_backend
    return get_backend().memory


def swap_attention_bytes(flags):
    """One forward+backward: activation bytes saved on the device side, host bytes held by the swap
    at the end of forward and after backward, and the most reloaded bytes alive during backward."""
    args, tr, session = trainer_and_session(flags)
    it = batches(args, tr)
    from mindspeed.training.data import get_batch
    batch = get_batch(it, "cpu")
    led = memory().ledger
    base_host, base_dev = led.held["host"], led.held["device"]
    counter = SavedBytes()
    model = tr.model[0]
    with counter.hooks():
        out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    after_forward = led.held["host"] - base_host
    led.reset_peaks()
    out.float().mean().backward()
    swapper = session.part("activation_swapper")
    return {"device_saved": counter.bytes, "host_after_forward": after_forward,
            "host_after_backward": led.held["host"] - base_host,
            "device_reload_peak": led.peak["device"] - base_dev,
            "groups": swapper.groups if swapper is not None else 0,
            "loads": swapper.loads[-4:] if swapper is not None else []}


def optimizer_state(tr) -> dict:
    """Managed bytes resident on the device, host bytes, chunks run, where the states are."""
    led = memory().ledger      # a fresh backend per trainer: its ledger counts this trainer's swap
    opts = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
    swaps = [getattr(o, "mindspeed_swap", None) for o in opts]
    n_params = sum(p.numel() for o in opts for g in o.optimizer.param_groups for p in g["params"])
    return dict(attached=[s is not None for s in swaps], params=n_params, host_bytes=led.held["host"],
                resident=sum(s.resident_bytes() for s in swaps if s),
                managed=sum(sum(memory().nbytes(t) for t in s.tensors(s.params())) for s in swaps if s),
                chunks=sum(s.chunks_run for s in swaps if s),
                device_peak=max((s.device_peak for s in swaps if s), default=0))


def checkpoint_crossing(root, on, off, steps=2, more=2, world_size=1):
    """Train `steps` with flags `on`, save, train `more`; a trainer with `off` loads the checkpoint
    and trains `more`: both continuations' losses (and the reverse)."""
    from mindspeed.training import pretrain
    from mindspeed.checkpoint import torch_dist as checkpointing
    import os
    report = {}
    for name, first, second in (("on_to_off", on, off), ("off_to_on", off, on)):
        path = os.path.join(root, name)
        args, tr = trainer_for(first, world_size=world_size)
        it = batches(args, tr)
        for _ in range(steps):
            tr.train_step(it)
        gbs = args.global_batch_size
        checkpointing.save_checkpoint(path, steps, tr.model, tr.optimizer, tr.scheduler, steps * gbs)
        cont = [tr.train_step(it)[0] for _ in range(more)]
        args2, tr2 = trainer_for(list(second) + ["--load", path], world_size=world_size)
        iteration, consumed = pretrain.resume(args2, tr2, _Log())
        report[name] = {"continued": cont, "resumed": train(args2, tr2, more, consumed),
                        "iteration": iteration}
    return report


def reuse_fp32_param(root, steps=20):
    """--bf16 with and without --reuse-fp32-param: losses of `steps` updates (also of Megatron's
    optimizer rounding ties away from zero, as the flag does, and of fp32); after each update of the
    run without, the masters at a tie the two roundings split; after the first update the masters
    (fp32 copies) and where the bf16 parameters differ, with the masters' rounding ties; parameter +
    master bytes; checkpoints across the flag; a model-only load (--no-load-optim)."""
    import os
    from contextlib import nullcontext
    from mindspeed.features.memory.reuse_fp32_param_megatron import parameter_and_master_bytes
    from mindspeed.training import pretrain
    from tests_extend.unit.bf16_rounding import differing_ties, megatron_copies_round_ties_away
    out, first = {}, {}
    one_micro_batch = ["--global-batch-size", "2"]       # 20 steps at half the cost
    runs = (("off", ["--bf16"]), ("reference", ["--bf16"]), ("on", ["--bf16", "--reuse-fp32-param"]), ("fp32", []))
    for name, flags in runs:
        with megatron_copies_round_ties_away() if name == "reference" else nullcontext():
            args, tr = trainer_for(flags + one_micro_batch)
            it = batches(args, tr)
            (opt,) = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
            shared = getattr(opt, "mindspeed_reuse", None)
            total, bf16, params = parameter_and_master_bytes(tr.model, tr.optimizer)
            run = {"bytes_per_bf16_param": (total - 4 * (params - bf16)) / bf16 if bf16 else None,
                   "attached": shared is not None, "losses": [], "differing_ties": []}
            masters = [m for g in getattr(opt, "fp32_from_float16_groups", []) for m in g]
            for step in range(steps):
                run["losses"].append(tr.train_step(it)[0])
                run["differing_ties"].append(differing_ties(masters) if name == "off" else None)
                if step == 0 and name in ("off", "on"):
                    copies = shared.master_copies() if shared else {}
                    first[name] = ([copies.get(id(m), m).clone() for m in masters],
                                   [p.detach().clone() for g in opt.float16_groups for p in g])
            if name != "fp32":
                run["masters_norm"] = masters_norm(tr.model)  # Megatron-LM's --log-params-norm reads these
                tr.optimizer.reload_model_params()            # what a model-only load calls
                run["reloaded_masters_equal_params"] = _masters_equal_params(opt)
        out[name] = run
    (m_off, p_off), (m_on, p_on) = first["off"], first["on"]
    ties = [(m.view(torch.int32) & 0xFFFF) == 0x8000 for m in m_off]
    out["after_first_update"] = {
        "masters_bitwise": all(torch.equal(a, b) for a, b in zip(m_off, m_on)),
        "ties": sum(int(t.sum()) for t in ties),
        "params_differ": sum(int((a != b).sum()) for a, b in zip(p_off, p_on)),
        "params_differ_off_ties": sum(int(((a != b) & ~t.view(a.shape)).sum()) for a, b, t in zip(p_off, p_on, ties))}
    path = os.path.join(root, "reuse")
    # Megatron's Float16 optimizer (no --use-distributed-optimizer) both ways, the other side with
    # --swap-optimizer; --add-bias-linear: the norms' fp32 weights sit among bf16 biases in the
    # no-weight-decay group (what once failed: "Param id N does not match any model sharded param")
    # (Megatron's side rounds ties away from zero, as the flag does: the continuations agree bit for bit)
    with megatron_copies_round_ties_away():
        out["checkpoint"] = checkpoint_crossing(path, ["--bf16", "--add-bias-linear", "--reuse-fp32-param"],
                                                ["--bf16", "--add-bias-linear", "--swap-optimizer"])
    # a model-only load (--no-load-optim) must give the masters the loaded weights
    args, tr = trainer_for(["--bf16", "--add-bias-linear", "--load", os.path.join(path, "on_to_off"),
                            "--no-load-optim"])
    pretrain.resume(args, tr, _Log())
    (opt,) = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
    out["model_only_load_masters_equal_params"] = _masters_equal_params(opt)
    return out


def _masters_equal_params(opt) -> bool:
    shared = getattr(opt, "mindspeed_reuse", None)
    copies = shared.master_copies() if shared else {}
    return all(torch.equal(copies.get(id(m), m), p.float())
               for mg, pg in zip(opt.fp32_from_float16_groups, opt.float16_groups) for m, p in zip(mg, pg))


def reuse_fp32_param_distributed(rank, world_size, root, steps=20):
    """DP=2 (run_distributed), --bf16 --use-distributed-optimizer with and without --reuse-fp32-param:
    this rank's losses; the masters after the first update; bytes of the bf16 buffer, fp32 master
    shards and residuals; checkpoints across the flag; a model-only load; the stale neighbour half
    after an update is rewritten by the all-gather (the full buffers agree across ranks). With
    --overlap-param-gather too ("overlap": the all-gather deferred to the next forward): its losses,
    masters, a save right after an update (every tensor saved), a forward-only loss and a weights norm
    right after the last update, against "on" bit for bit, and checkpoints across that flag."""
    import os
    import time
    import mindspeed
    from contextlib import nullcontext
    from mindspeed.training import pretrain
    from mindspeed.flags.trainer_flags import parse_args
    from tests_extend.unit.bf16_rounding import megatron_copies_round_ties_away
    t0 = time.perf_counter()
    base = ["--bf16", "--use-distributed-optimizer", "--global-batch-size", "4"]
    args = parse_args(TINY + base, world_size=world_size)
    mindspeed.adapt(args)
    pretrain._init_distributed(args, "cpu")
    pretrain.init_batch_schedule(args, rank)
    out, first = {"rank": rank}, {}
    on = base + ["--reuse-fp32-param"]
    runs = (("off", base), ("reference", base), ("on", on), ("overlap", on + OVERLAP_PARAM_GATHER),
            ("fp32", ["--use-distributed-optimizer", "--global-batch-size", "4"]))
    for name, flags in runs:
        with megatron_copies_round_ties_away() if name == "reference" else nullcontext():
            run = _distributed_run(name, flags, world_size, root, steps, first)
        out[name] = run
    out["masters_bitwise_after_first_update"] = all(torch.equal(a, b) for a, b in zip(first["off"], first["on"]))
    out["overlap_masters_bitwise"] = {
        when: all(torch.equal(a, b) for a, b in zip(first["on" + suffix], first["overlap" + suffix]))
        for when, suffix in (("after_first_update", ""), ("at_the_end", "_end"))}
    out["overlap_saved_tensors"] = _saved_tensors_equal(*(os.path.join(root, "reuse_dist", name, "iter_0000002")
                                                          for name in ("on", "overlap")), first["bucket_params"])
    out["checkpoint"] = {}
    # Megatron's side rounds ties away from zero, as the flag does: the continuations agree bit for bit
    with megatron_copies_round_ties_away():
        for direction, saved, flags in (("on_to_off", "on", runs[1][1]), ("off_to_on", "reference", on),
                                        ("overlap_to_on", "overlap", on), ("on_to_overlap", "on", runs[3][1])):
            args, tr = trainer_for(flags + ["--load", os.path.join(root, "reuse_dist", saved)], world_size=world_size)
            iteration, consumed = pretrain.resume(args, tr, _Log())
            out["checkpoint"][direction] = {"iteration": iteration, "continued": out[saved]["losses"][2:4],
                                            "resumed": train(args, tr, 2, consumed)}
    mindspeed.unadapt()
    out["seconds"] = time.perf_counter() - t0
    return out


OVERLAP_PARAM_GATHER = ["--overlap-param-gather"]


def _buffers_agree(buffers, world_size) -> bool:
    """Whether the full bf16 buffers are the same on every rank (the all-gather has run since the update)."""
    full = torch.cat([b.param_data.float() for b in buffers])
    gathered = [torch.empty_like(full) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, full)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _bucket_params(opt) -> dict:
    """Where the optimizer's checkpoint tensors (dp_reshardable: one per bucket, the padding between
    parameters included, never written) hold parameters: key part -> bool mask over the bucket."""
    masks = {}
    for g, buffer in enumerate(opt.buffers):
        (bucket,) = buffer.buckets                   # the tiny model: one bucket per buffer
        mask = torch.zeros(bucket.numel_unpadded, dtype=torch.bool)
        for start, end, _bucket in buffer.param_index_map.values():
            mask[start - bucket.offset:end - bucket.offset] = True
        masks[f".gbuf_idx_{g}."] = mask
    return masks


def _saved_tensors_equal(a: str, b: str, masks: dict) -> dict:
    """Every tensor two checkpoints hold (the model's weights, the optimizer's masters and moments at
    the parameters' places): the keys, and which differ bit for bit."""
    from megatron.core import dist_checkpointing

    def flat(tree, prefix=""):
        if isinstance(tree, dict):
            return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}/").items()}
        return {prefix.rstrip("/"): tree}

    def same(key, x, y):
        if not isinstance(x, torch.Tensor):
            return x == y
        mask = next((m for part, m in masks.items() if key.startswith("optimizer.") and part in key), None)
        return torch.equal(x, y) if mask is None else torch.equal(x[mask], y[mask])
    ta, tb = flat(dist_checkpointing.load_plain_tensors(a)), flat(dist_checkpointing.load_plain_tensors(b))
    tensors = {k: v for k, v in ta.items() if isinstance(v, torch.Tensor)}
    return {"keys": sorted(ta), "same_keys": sorted(ta) == sorted(tb),
            "bf16_weights": sum(1 for t in tensors.values() if t.dtype == torch.bfloat16),
            "optimizer_tensors": sum(1 for k in tensors if k.startswith("optimizer.")),
            "differ": sorted(k for k in ta if k in tb and not same(k, ta[k], tb[k]))}


def _weights_norm(model_chunks):
    """A norm of every weight as Megatron-LM's calc_params_l2_norm reads them (param.data.float())."""
    return float(torch.sqrt(sum(p.detach().float().pow(2).sum() for c in model_chunks for p in c.parameters())))


def _masters_norm(model_chunks):
    """This rank's sum of squares of the bf16 weights' masters, read as Megatron-LM's calc_params_l2_norm
    reads them with --bf16 (`param.main_param`, the master or this rank's master shard)."""
    mains = [p.main_param for c in model_chunks for p in c.parameters()
             if p.dtype == torch.bfloat16 and getattr(p, "main_param", None) is not None]
    assert mains
    return float(sum(m.detach().double().pow(2).sum() for m in mains))


def masters_norm(model_chunks):
    """_masters_norm through --reuse-fp32-param's wrapper of calc_params_l2_norm (masters readable)."""
    from mindspeed.features.memory.reuse_fp32_param_distrib import _params_norm_of_gathered_weights
    return _params_norm_of_gathered_weights(_masters_norm)(model_chunks)


def _distributed_run(name, flags, world_size, root, steps, first) -> dict:
    """One run of reuse_fp32_param_distributed: losses (and, for "off", this rank's masters at a
    tie the two bf16 roundings split, after each update); for the bf16 runs the bytes, the masters
    after the first update (into `first`), a checkpoint after 2 steps ("on", "reference" and
    "overlap": the runs the crossings load), whether the full buffers agree across ranks, and whether
    a model-only load sets the masters from the weights; for "on" and "overlap" also the masters
    after the last update (into `first`), then, before any forward, Megatron-LM's weights norm (as
    --log-params-norm wraps it) and a forward-only loss (the built-in trainer's evaluation)."""
    import os
    from mindspeed.checkpoint import torch_dist as checkpointing
    from mindspeed.features.memory.reuse_fp32_param_megatron import parameter_and_master_bytes
    from tests_extend.unit.bf16_rounding import differing_ties
    args, tr = trainer_for(flags, world_size=world_size)
    it = batches(args, tr)
    if "--bf16" not in flags:
        return {"losses": train(args, tr, steps)}
    (opt,) = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
    shared = getattr(opt, "mindspeed_reuse", None)
    total, bf16, params = parameter_and_master_bytes(tr.model, tr.optimizer)
    buffers = [b for b in opt.buffers if b.param_dtype == torch.bfloat16]
    masters = [m for g in opt.shard_fp32_from_float16_groups for m in g]
    run = {"attached": shared is not None, "bytes": total, "bf16_params": bf16, "params": params,
           "bf16_buffer_bytes": sum(b.param_data.numel() * 2 for b in buffers),
           "other_buffer_bytes": sum(b.param_data.untyped_storage().nbytes() for b in opt.buffers
                                     if b.param_dtype != torch.bfloat16),
           "master_elements": sum(m.numel() for m in masters), "losses": [], "differing_ties": []}
    for step in range(steps):
        run["losses"].append(tr.train_step(it)[0])
        run["differing_ties"].append(differing_ties(masters) if name == "off" else None)
        if step == 0:
            first[name] = [(shared.read(m) if shared else m).clone() for m in masters]
        if step == 1 and name in ("on", "reference", "overlap"):   # loaded below by trainers with other flags
            # right after the update: with --overlap-param-gather the all-gather has not run yet
            run["buffers_agree_before_save"] = _buffers_agree(buffers, world_size)
            checkpointing.save_checkpoint(os.path.join(root, "reuse_dist", name), 2, tr.model, tr.optimizer,
                                          tr.scheduler, 2 * args.global_batch_size)
            run["buffers_agree_after_save"] = _buffers_agree(buffers, world_size)
    if name not in ("on", "overlap"):
        run["masters_norm"] = masters_norm(tr.model)       # Megatron-LM's --log-params-norm reads these
    if name in ("on", "overlap"):
        from mindspeed.features.memory.reuse_fp32_param_distrib import _params_norm_of_gathered_weights
        from mindspeed.training import pretrain
        first[name + "_end"] = [shared.read(m).clone() for m in masters]
        first["bucket_params"] = _bucket_params(opt)
        run["buffers_agree_after_update"] = _buffers_agree(buffers, world_size)
        run["weights_norm"] = _params_norm_of_gathered_weights(_weights_norm)(tr.model)
        run["masters_norm"] = masters_norm(tr.model)       # (after the check above: the wrapper gathers)
        run["buffers_agree_after_norm"] = _buffers_agree(buffers, world_size)
        tr.train_step(it)                       # one more update; then the evaluation's forward gathers
        run["buffers_agree_before_forward"] = _buffers_agree(buffers, world_size)
        args.eval_iters = 1
        reader = pretrain.data.BatchReader("cpu")
        run["forward_only_loss"] = pretrain.validation_loss(args, tr.model, _DATA[0], reader, tr.num_microbatches)
    run["buffers_agree_across_ranks"] = _buffers_agree(buffers, world_size)
    tr.optimizer.reload_model_params()           # what a model-only load calls
    run["reloaded_masters_equal_params"] = all(
        torch.equal((shared.read(m) if shared else m),
                    p.detach().view(-1)[opt._get_model_param_range_map(p)["param"].start:
                                        opt._get_model_param_range_map(p)["param"].end].float())
        for mg, pg in zip(opt.shard_fp32_from_float16_groups, opt.model_float16_groups) for m, p in zip(mg, pg))
    return run


# --reuse-fp32-param with --use-distributed-optimizer where a rank's shard is a whole buffer (no neighbour
# shard to borrow: the buffer's storage grows to hold the masters' low halves)

RECIPE_OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]      # Qwen3's recipe
FOLD_CHUNK_SMALL = 100
SIZE_ONE = {
    # 2 processes, pipeline-parallel 2: data-parallel size 1 (Qwen3's recipe at PP 2 on 2 processes)
    "pp2": ["--pipeline-model-parallel-size", "2"],
    # 2 processes, MoE at expert-parallel 2: the dense optimizer's data-parallel size 2 (neighbour shards),
    # the experts' optimizer's expert-data-parallel size 1 (a whole buffer), chained
    "moe_ep2": ["--num-experts", "2", "--expert-model-parallel-size", "2"],
}


def reuse_fp32_param_size_one(rank, world_size, root, layout, steps=20):
    """SIZE_ONE[layout] with --bf16 --use-distributed-optimizer: runs "off", "reference" (Megatron's copy
    rounding ties away from zero), "on" (--reuse-fp32-param), "recipe" (on + Qwen3's overlap flags) and
    "fp32", `steps` updates each (_size_one_run); the masters after the first update; checkpoints saved
    after 2 updates loaded across the flag and across the overlap flags."""
    import os
    import time
    import mindspeed
    from contextlib import nullcontext
    from mindspeed.training import pretrain
    from mindspeed.flags.trainer_flags import parse_args
    from tests_extend.unit.bf16_rounding import megatron_copies_round_ties_away
    t0 = time.perf_counter()
    base = ["--bf16", "--use-distributed-optimizer", "--global-batch-size", "4"] + SIZE_ONE[layout]
    args = parse_args(TINY + base, world_size=world_size)
    mindspeed.adapt(args)
    pretrain._init_distributed(args, "cpu")
    pretrain.init_batch_schedule(args, rank)
    dataset(args)                                # built before any run counts its bytes
    on = base + ["--reuse-fp32-param"]
    runs = {"off": base, "reference": base, "on": on, "recipe": on + RECIPE_OVERLAP,
            "fp32": base[1:]}
    out, first = {"rank": rank, "layout": layout}, {}
    from mindspeed.features.memory import reuse_fp32_param_megatron as folding
    for name, flags in runs.items():
        # the recipe run folds its buffers FOLD_CHUNK_SMALL pairs at a time (the recursive path of fold)
        folding.FOLD_CHUNK, default_chunk = (FOLD_CHUNK_SMALL if name == "recipe" else folding.FOLD_CHUNK,
                                             folding.FOLD_CHUNK)
        try:
            with megatron_copies_round_ties_away() if name == "reference" else nullcontext():
                out[name] = _size_one_run(name, flags, world_size, os.path.join(root, layout, name), steps, first)
        finally:
            folding.FOLD_CHUNK = default_chunk
    out["masters_bitwise_after_first_update"] = {
        name: len(first[name]) > 0 and all(torch.equal(a, b) for a, b in zip(first["off"], first[name], strict=True))
        for name in ("reference", "on", "recipe")}
    out["checkpoint"] = {}
    with megatron_copies_round_ties_away():     # the flag's rounding on Megatron's side: bit for bit
        for direction, saved, flags in (("on_to_off", "on", runs["reference"]), ("off_to_on", "reference", on),
                                        ("recipe_to_off", "recipe", runs["reference"]),
                                        ("off_to_recipe", "reference", runs["recipe"])):
            args, tr = trainer_for(flags + ["--load", os.path.join(root, layout, saved)], world_size=world_size)
            iteration, consumed = pretrain.resume(args, tr, _Log())
            out["checkpoint"][direction] = {"iteration": iteration, "continued": out[saved]["losses"][2:4],
                                            "resumed": train(args, tr, 2, consumed)}
    mindspeed.unadapt()
    out["seconds"] = time.perf_counter() - t0
    return out


def _live_tensor_bytes() -> int:
    """Bytes of the storages every live tensor of this process views, each storage once."""
    import gc
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): a weakref.proxy forwards __class__ to its referent, which may be gone
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _optimizer_bytes(opt) -> dict:
    """One of the (chained) distributed optimizers: its data-parallel size, what holds its masters, the
    elements of its bf16 buffers, the bytes of the storages of those buffers, of its masters and of
    --reuse-fp32-param's residuals (each storage once), and its masters' elements."""
    buffers = [b for b in opt.buffers if b.param_dtype == torch.bfloat16]
    masters = [m for g in opt.shard_fp32_from_float16_groups for m in g]
    shared = getattr(opt, "mindspeed_reuse", None)
    residuals = [sh.residual for sh in shared.buckets.values()] if shared else []
    storages = {}
    for t in [b.param_data for b in buffers] + masters + residuals:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return {"data_parallel_size": opt.data_parallel_group.size(),
            "units": sorted({type(u).__name__ for u in shared.units}) if shared else [],
            "fold_chunks": sorted({u.chunk for u in shared.units if hasattr(u, "buffer")}) if shared else [],
            "bf16_elements": sum(b.param_data.numel() for b in buffers), "bytes": sum(storages.values()),
            "master_elements": sum(m.numel() for m in masters)}


def _size_one_run(name, flags, world_size, path, steps, first) -> dict:
    """One run of reuse_fp32_param_size_one: losses; for bf16 runs (every chained optimizer): whether the
    flag attached, per optimizer its bytes (_optimizer_bytes), the bytes every live tensor of the process
    holds once the trainer is built less those before it, the masters after the first update (into
    `first`; for "off" also the masters at a tie the two roundings split, after each update), a checkpoint
    after 2 updates (reference, on, recipe), with the flag whether the dummy step before a checkpoint load
    leaves masters and weights as they were, and whether a model-only load sets the masters from the weights."""
    from mindspeed.checkpoint import torch_dist as checkpointing
    from tests_extend.unit.bf16_rounding import differing_ties
    before = _live_tensor_bytes()
    args, tr = trainer_for(flags, world_size=world_size)
    it = batches(args, tr)
    if "--bf16" not in flags:
        return {"losses": train(args, tr, steps)}
    live = _live_tensor_bytes() - before
    opts = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
    shared = [getattr(o, "mindspeed_reuse", None) for o in opts]
    pairs = [(sh, m) for o, sh in zip(opts, shared) for g in o.shard_fp32_from_float16_groups for m in g]
    run = {"attached": [sh is not None for sh in shared], "optimizers": [_optimizer_bytes(o) for o in opts],
           "live_bytes_after_build": live, "losses": [], "differing_ties": []}
    for step in range(steps):
        run["losses"].append(tr.train_step(it)[0])
        run["differing_ties"].append(differing_ties([m for _, m in pairs]) if name == "off" else None)
        if step == 0:
            first[name] = [(sh.read(m) if sh else m).clone() for sh, m in pairs]
        if step == 1 and name != "off":
            checkpointing.save_checkpoint(path, 2, tr.model, tr.optimizer, tr.scheduler, 2 * args.global_batch_size)
    run["masters_norm"] = masters_norm(tr.model)           # Megatron-LM's --log-params-norm reads these
    if all(run["attached"]):
        # the dummy step a checkpoint load runs on an optimizer without state (torch_dist.py): it steps the
        # masters (here with 20 updates' moments) and must leave the bf16 weights and their masters as they
        # were (the fp32 norms are their own masters: Megatron's dummy step moves them, flag or not)
        bf16 = [p for chunk in tr.model for p in chunk.parameters() if p.dtype == torch.bfloat16]
        weights = [p.detach().clone() for p in bf16]
        masters = [sh.read(m).clone() for sh, m in pairs]
        for o in opts:
            o._init_optimizer_states_with_dummy_values()
        run["dummy_step_keeps_masters_and_weights"] = (
            all(torch.equal(a, sh.read(m)) for a, (sh, m) in zip(masters, pairs, strict=True)) and
            # bitwise: with --overlap-param-gather at DP 2 the borrowed halves hold fp32 bits until the gather
            all(torch.equal(a.view(torch.int16), p.detach().view(torch.int16))
                for a, p in zip(weights, bf16, strict=True)))
    tr.optimizer.reload_model_params()           # what a model-only load calls
    run["reloaded_masters_equal_params"] = all(
        torch.equal(sh.read(m) if sh else m,
                    p.detach().view(-1)[o._get_model_param_range_map(p)["param"].start:
                                        o._get_model_param_range_map(p)["param"].end].float())
        for o, sh in zip(opts, shared)
        for mg, pg in zip(o.shard_fp32_from_float16_groups, o.model_float16_groups) for m, p in zip(mg, pg))
    return run


def shared_mask_report(steps=2) -> dict:
    """The shared causal mask: the masks each layer's attention got over `steps` updates of 2
    micro-batches (distinct objects and storages), losses against per-micro-batch stacked masks
    (the data loader's old way), and, with no mask passed (Megatron's default mask in the softmax),
    the bool [s, s] storages saved for backward across the layers of one forward."""
    from mindspeed.training.data import get_batch
    seen, out = [], {}

    def capture(module, args, kwargs):
        mask = kwargs.get("attention_mask", args[3] if len(args) > 3 else None)
        seen.append((id(mask), mask.untyped_storage().data_ptr(), tuple(mask.shape)))

    def stacked(it, mbs):     # each micro-batch its own stack of Megatron's per-sample masks, as before
        from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
        for batch in it:
            masks = [_get_ltor_masks_and_position_ids(t, _Tok.eod, False, False, False, True)[0]
                     for t in batch["tokens"]]
            yield {**batch, "attention_mask": torch.stack(masks)}

    for name in ("shared", "stacked"):
        args, tr = trainer_for([])
        it = batches(args, tr)
        if name == "stacked":
            it = stacked(it, args.micro_batch_size)
        layers = tr.model[0].module.decoder.layers
        handles = [l.self_attention.core_attention.register_forward_pre_hook(capture, with_kwargs=True)
                   for l in layers] if name == "shared" else []
        out[name] = [tr.train_step(it)[0] for _ in range(steps)]
        for h in handles:
            h.remove()
        out["layers"], out["micro_batches"] = len(layers), steps * args.global_batch_size // args.micro_batch_size
    out["calls"], out["mask_objects"] = len(seen), len({s[0] for s in seen})
    out["mask_storages"], out["mask_shapes"] = len({s[1] for s in seen}), sorted({s[2] for s in seen})
    # no mask passed: each layer's softmax asks Megatron for its default causal mask
    batch = get_batch(batches(args, tr), "cpu")
    seq = batch["tokens"].shape[1]
    counter = SavedBytes()
    masks = set()

    def pack(t):
        if t.dtype == torch.bool and t.shape[-2:] == (seq, seq):
            masks.add(t.untyped_storage().data_ptr())
        return t
    with counter.hooks(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tr.model[0](batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    out["default_mask_storages_saved"] = len(masks)
    return out


def start_world_of_one() -> None:
    """This process as a world of one (gloo), adapted for TINY: what trainer_for's trainers run in."""
    import os
    os.environ.pop("RANK", None)
    import mindspeed
    from mindspeed.training import pretrain
    from mindspeed.flags.trainer_flags import parse_args
    args = parse_args(TINY, world_size=1)
    mindspeed.adapt(args)
    pretrain._init_distributed(args, "cpu")
    pretrain.init_batch_schedule(args, 0)


def main(root: str) -> dict:
    import mindspeed
    start_world_of_one()
    bf16_dist = ["--bf16", "--use-distributed-optimizer"]
    import time
    t0 = time.perf_counter()
    states = {}
    t_mask = time.perf_counter()
    mask = shared_mask_report()
    mask["seconds"] = time.perf_counter() - t_mask
    report = {
        "losses": {name: losses(flags, reports=states) for name, flags in (
            ("off", []),
            ("attention", ["--swap-attention", "--swap-modules", "input_norm,self_attention,post_attention_norm"]),
            ("optimizer", ["--swap-optimizer", "--swap-optimizer-times", "3"]),
            ("bf16_off", ["--bf16"]), ("bf16_optimizer", ["--bf16", "--swap-optimizer", "--swap-optimizer-times", "4"]),
            ("bf16_dist_off", bf16_dist), ("bf16_dist_both", bf16_dist + ["--swap-attention", "--swap-optimizer"]))},
        "attention": {"off": swap_attention_bytes([]), "on": swap_attention_bytes(["--swap-attention"])},
        "optimizer": states,
        "t_before_checkpoint": time.perf_counter() - t0,
        "checkpoint": checkpoint_crossing(root, bf16_dist + ["--swap-optimizer", "--swap-attention"], bf16_dist),
    }
    t1 = time.perf_counter()
    report["mask"] = mask
    report["reuse"] = reuse_fp32_param(root)
    report["reuse_seconds"] = time.perf_counter() - t1
    mindspeed.unadapt()
    report["seconds"] = time.perf_counter() - t0
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
