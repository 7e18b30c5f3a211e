"""The MindSpore GPT training loop: same flags, data files, log lines and summary as the torch
main job (mindspeed/training/pretrain.py)."""
from __future__ import annotations

import os
import time

import mindspore as ms
import numpy as np

import mindspeed
from mindspeed.backends.mindspore import precision
from mindspeed.backends.mindspore.main_thread_gc import MainThreadCollection, ops_without_collection
from mindspeed.backends.mindspore.msadapter import describe
from mindspeed.checkpoint import neutral
from mindspeed.data.flag_tokenizers import check_dataset_tokenizer, model_vocab_size, named_tokenizer
from mindspeed.data.indexed_reader import check_dataset
from mindspeed.features.context_parallel.feature import FUSED_MERGE
from mindspeed.features.context_parallel.groups import build_cp_groups
from mindspeed.megatron_defaults import DISTRIBUTED_TIMEOUT_MINUTES
from mindspeed.session import Session
from mindspeed.training import loop
from mindspeed.training.logger import TrainingLogger
from mindspeed.training.mindspore import checkpoint, data, schedule
from mindspeed.training.mindspore.distrib_optimizer import DistributedOptimizer
from mindspeed.training.mindspore.dropout import DropoutMasks
from mindspeed.training.mindspore.eod import EodRules
from mindspeed.training.mindspore.interleaved import InterleavedPipeline
from mindspeed.training.mindspore.main_grad import MainGrads
from mindspeed.training.mindspore.mixed_precision import (MasterWeights, bf16_main_grads, scaler_from_args,
                                                          unscale_and_check)
from mindspeed.training.mindspore.model import Extras, GPTConfig, GPTModel, init_full_weights
from mindspeed.training.mindspore.expert_bias import count_groups
from mindspeed.training.mindspore.optimizer import accumulate, build_optimizer, clip_gradients, reduce_gradients
from mindspeed.training.mindspore.parallel import build_parallel_state
from mindspeed.training.mindspore.pipeline import TwoStagePipeline
from mindspeed.training.mindspore.reuse_fp32_param import FoldedWeights
from mindspeed.training.mindspore.tracing import traced


class TrainerConfigError(ValueError):
    """A flag the mindspore trainer cannot honour; raised before any work starts."""


def to_tensors(batch: dict) -> tuple:
    return ms.Tensor(batch["tokens"]), ms.Tensor(batch["labels"]), ms.Tensor(batch["loss_mask"])


def _cp_part(session: Session | None, name: str):
    """What the context-parallel feature provides this trainer under `name` (ApplyContext.provide)."""
    part = session.part(name) if session is not None else None
    if part is None:
        raise TrainerConfigError("--context-parallel-size > 1 needs a context-parallel algorithm "
                                 "(--context-parallel-algo ulysses_cp_algo | megatron_cp_algo | hybrid_cp_algo | "
                                 "kvallgather_cp_algo)")
    return part


def enable_context_parallel(args, model, ps, session: Session | None) -> None:
    """Shard the sequence over the CP group: the CP feature's groups (over the session's backend),
    batch sharding and attention."""
    attention = _cp_part(session, "context_parallel_attention")
    cp = build_cp_groups(args.context_parallel_algo, backend=session.backend, group=ps.cp_group,
                         all_cp_ranks=ps.all_cp_ranks, ulysses_degree=args.ulysses_degree_in_cp,
                         window_size=args.cp_window_size or 1, overlap=bool(args.use_cp_send_recv_overlap),
                         fused_merge=session.applied(FUSED_MERGE))
    model.enable_context_parallel(cp, attention)


def graph_mode_ok(cfg, ps, swap: bool) -> bool:
    """Whether the forward may run as a traced graph: not where a feature edits tensor storage or
    hooks saved tensors on the Python side (--recompute-norm/-activation-function, --swap-attention,
    full and selective recompute), nor with context parallelism (its attention's ring and all-to-all
    are Cells whose backward a trace would not call), nor with --use-ascend-coc (its linears are Cells
    too, and wait on collectives in flight, which a graph cannot hold), nor with pipeline parallelism
    (its stages run under mindspore.vjp between exchanges), nor with MoE layers (their shapes follow
    the routing, decided on the host each step), nor with --gradient-accumulation-fusion (its kernel
    adds into the main grads in a custom backward, which a trace never calls), nor with bf16 where it
    is emulated (MindSpore's CPU graphs have no bf16 Reshape, AddN or ReduceSum:
    backends/mindspore/precision.py). TP (its collectives carry their gradient as primitives,
    comm.with_gradient) and DP (gradients are reduced outside the graph) trace."""
    if os.environ.get("MINDSPEED_MS_PYNATIVE") == "1":      # debugging: op by op
        return False
    if cfg.params_dtype == "bf16" and precision.emulated():
        return False
    return not (swap or cfg.recompute or cfg.recompute_core_attention or cfg.recompute_norm_layers
                or cfg.recompute_activation_layers or ps.cp_size > 1 or ps.tp_linear is not None
                or ps.pp_size > 1 or cfg.num_experts or ps.main_grads is not None)


def extras_names(args, cfg: GPTConfig, training: bool) -> tuple:
    """The Extras a forward takes, in a fixed order (a traced graph has a fixed signature): the
    document mask, per-sample positions where a learned table reads them (RoPE ignores them, as
    Megatron-Core's), and in training dropout's masks."""
    on = {"attention_mask": bool(args.reset_attention_mask),
          "embed_positions": bool(args.reset_position_ids)
          and cfg.position_embedding_type == "learned_absolute",
          "hidden_keep": training and cfg.hidden_dropout > 0, "probs_keep": training and cfg.attention_dropout > 0}
    return tuple(name for name in Extras.NAMES if on[name])


def _loss_with(model, names: tuple):
    """model.loss over positional tensors: tokens, labels, loss_mask, [CP's positions and
    denominator], then the Extras named by `names`."""
    def loss(tokens, labels, loss_mask, *rest):
        lead = len(rest) - len(names)
        return model.loss(tokens, labels, loss_mask, *rest[:lead], extras=Extras(**dict(zip(names, rest[lead:]))))
    return loss


def _scaled(loss_fn):
    """--fp16: the loss times the loss scale (a tensor input: a new scale does not retrace)."""
    def loss(scale, *inputs):
        return loss_fn(*inputs) * scale
    return loss


class Trainer:
    """Model + optimizer + one training step; usable without the data pipeline (parity tests).
    `session`: the applied features' parts (activation swap, CoC linears, CP), None: none."""

    def __init__(self, args, backend, ps, cfg: GPTConfig, session: Session | None = None):
        self.args, self.backend, self.ps, self.cfg = args, backend, ps, cfg
        self.model = GPTModel(cfg, backend, ps)
        self.model.load_full(init_full_weights(cfg, args.seed))
        self.distributed_optimizer = bool(args.use_distributed_optimizer)
        # --fp16: the optimizer updates the fp32 masters; the fp16 weights are copied from them
        self.scaler = scaler_from_args(args)
        weights = (FoldedWeights(self.model) if self.model.folded is not None
                   else MasterWeights(self.model) if self.model.masters else self.model)
        self.optimizer = (DistributedOptimizer(weights, backend, ps, args) if self.distributed_optimizer
                          else build_optimizer(weights, args))
        # steps skipped on an fp16 overflow: the lr schedule does not advance on them (Megatron's)
        self.skipped_iterations, self.last_step_skipped = 0, False
        # samples of the skipped (fp16 overflow) steps: the lr schedule counts the applied ones
        self.skipped_samples, self.scheduled_samples = 0, 0
        self.lr_at = schedule.from_args(args)
        self._shard = None
        part = session.part if session is not None else (lambda _name: None)
        swap = part("activation_swap")
        if swap is not None:
            self.model.enable_activation_swap(*swap())
        linears = part("tensor_parallel_linear")
        if linears is not None:
            ps.tp_linear = linears()
        if ps.cp_size > 1:
            enable_context_parallel(args, self.model, ps, session)
            self._shard = _cp_part(session, "shard_batch")
        dense_main_grads = "matmul_add_fp32" in cfg.fused_kernels
        if dense_main_grads or cfg.expert_main_grads:
            ps.main_grads = MainGrads(backend, dense_main_grads, cfg.expert_main_grads)
        self.graph_mode = graph_mode_ok(cfg, ps, swap is not None)
        self.dropout = DropoutMasks(cfg, ps, args.seed, len(self.model.layers))
        self._train_names, self._eval_names = extras_names(args, cfg, True), extras_names(args, cfg, False)
        loss, self._eval_loss = _loss_with(self.model, self._train_names), _loss_with(self.model, self._eval_names)
        if self.scaler is not None:
            loss = _scaled(loss)
        if self.graph_mode:
            # the forward traced once into a MindSpore graph, differentiated by graph autodiff:
            # one launch instead of hundreds of PyNative op dispatches;
            # evaluation gets its own trace (no gradient, no dropout, no loss scale)
            loss, self._eval_loss = traced(loss), traced(self._eval_loss)
        self._grad_fn = ms.value_and_grad(loss, None, weights=self.model.parameters())
        pipeline = InterleavedPipeline if cfg.virtual_chunks > 1 else TwoStagePipeline
        self.pipeline = pipeline(backend, ps, self.model, bool(args.variable_seq_lengths), self._eval_names
                                 ) if ps.pp_size > 1 else None

    def _inputs(self, mb: dict, names: tuple = (), masks: dict | None = None) -> tuple:
        """Model inputs for one micro-batch: this CP rank's share of the sequence, its positions,
        and the kept-token count of the whole sequence (so CP losses add up); then the Extras
        `names` (the batch's document mask and positions, dropout's `masks`)."""
        extra = {"attention_mask": mb.get("attention_mask"), "embed_positions": mb.get("position_ids"),
                 **(masks or {})}
        tail = tuple(ms.Tensor(extra[name]) for name in names)
        if self._shard is None:
            return to_tensors(mb) + tail
        # the matrix lets only the documents' mask through with CP (--attention-mask-type general): it
        # covers the whole sequence, and ring attention slices it per block
        assert tuple(names) in ((), ("attention_mask",)), "the support matrix refuses these Extras with CP"
        b, s = mb["tokens"].shape
        full = dict(mb, position_ids=np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)))
        local = self._shard(full)
        denominator = ms.Tensor(np.float32(mb["loss_mask"].sum()))
        return to_tensors(local) + (ms.Tensor(np.ascontiguousarray(local["position_ids"])), denominator) + tail

    def train_step(self, micro_batches: list, iteration: int, consumed: int | None = None
                   ) -> tuple[float, float | None, float]:
        """One optimizer step over this rank's micro-batches -> (loss, grad norm, lr); `iteration`
        is 1-based, `consumed` the samples before it (default: iterations of --global-batch-size);
        the lr is the schedule's at the samples of the applied steps, as Megatron's scheduler
        counts them. With --fp16, a step whose gradients overflow is skipped on every rank
        (last_step_skipped; grad norm None) and the loss scale lowered. No garbage collection
        starts on MindSpore's runtime threads meanwhile (docs/native-crash.md)."""
        with ops_without_collection():
            return self._train_step(micro_batches, iteration, consumed)

    def _train_step(self, micro_batches: list, iteration: int, consumed: int | None) -> tuple:
        names = list(self.model.params)
        grads, losses = None, []
        n = len(micro_batches)
        scale = None if self.scaler is None else ms.Tensor(self.scaler.scale, ms.float32)
        main_grads = self.ps.main_grads
        if main_grads is not None:
            main_grads.zero()
        if self.pipeline is not None:
            grads, losses = self.pipeline.train(micro_batches, scale)
        else:
            for m, mb in enumerate(micro_batches):
                inputs = self._inputs(mb, self._train_names, self.dropout.draw(iteration, m, mb["tokens"].shape[0]))
                if scale is None:
                    loss, g = self._grad_fn(*inputs)
                else:       # (loss x scale) / scale: exact for the power-of-two scales
                    loss, g = self._grad_fn(scale, *inputs)
                    loss = loss / scale
                losses.append(loss)
                grads = accumulate(grads, g, n)
                if self.model.expert_bias is not None:
                    self.model.expert_bias.end_micro_batch()
        if self.model.expert_bias is not None:     # Megatron: in finalize_model_grads, before the update
            self.model.expert_bias.update(self.backend.comm, count_groups(self.ps))
        if main_grads is not None:
            grads = main_grads.added_to(names, grads, n)
        step_samples = n * micro_batches[0]["tokens"].shape[0] * self.ps.dp_size
        if consumed is None:
            consumed = (iteration - 1) * self.args.global_batch_size
        self.scheduled_samples = consumed - self.skipped_samples
        lr = self.lr_at(self.scheduled_samples)
        if self.scaler is not None:
            grads, self.last_step_skipped = unscale_and_check(self.backend.comm, grads, self.scaler)
            self.scaler.update(self.last_step_skipped)
        elif self.cfg.params_dtype == "bf16":     # no loss scale: fp32 main gradients, reduced in fp32
            grads = bf16_main_grads(grads)
        if self.last_step_skipped:
            self.skipped_iterations += 1
            self.skipped_samples += step_samples
            return self._step_loss(losses, n), None, lr
        self.scheduled_samples += step_samples
        grads = reduce_gradients(self.backend, self.ps, self.model, dict(zip(names, grads)),
                                 over_dp=not self.distributed_optimizer)
        if self.distributed_optimizer:      # reduce-scatter, clip, update its slice, all-gather
            norm = self.optimizer.step_on_local_grads(grads, lr, self.args.clip_grad)
        else:
            grads, norm = clip_gradients(self.backend, self.ps, self.model, grads, self.args.clip_grad)
            self.optimizer.step(grads, lr)
        self.model.copy_from_masters()
        # read back once the whole step is launched
        return self._step_loss(losses, n), float(norm.asnumpy()), lr

    def _step_loss(self, losses: list, n: int) -> float:
        loss_sum = sum(float(x.asnumpy()) for x in losses)
        return self._dp_mean(self._cp_sum(self._from_last_stage(loss_sum / n)))

    @property
    def loss_scale(self) -> float | None:
        return None if self.scaler is None else self.scaler.scale

    def evaluate(self, micro_batches: list) -> float | None:
        """Mean loss over the batches; None without any (--eval-iters 0), as the torch trainer."""
        if not micro_batches:
            return None
        with ops_without_collection():
            if self.pipeline is not None:
                losses = [float(x.asnumpy()) for x in self.pipeline.evaluate(micro_batches)]
            else:
                losses = [float(self._eval_loss(*self._inputs(mb, self._eval_names)).asnumpy())
                          for mb in micro_batches]
            return self._dp_mean(self._cp_sum(self._from_last_stage(sum(losses) / len(micro_batches))))

    def _from_last_stage(self, value: float) -> float:
        """The loss, computed on the last pipeline stage, on every stage (for logging, as Megatron)."""
        if self.ps.pp_size == 1:
            return value
        t = self.backend.comm.broadcast(ms.Tensor([value], ms.float32), self.ps.pp_size - 1, self.ps.pp_group)
        return float(t.asnumpy()[0])

    def _cp_sum(self, value: float) -> float:
        if self.ps.cp_size == 1:
            return value
        t = self.backend.comm.all_reduce(ms.Tensor([value], ms.float32), "sum", self.ps.cp_group)
        return float(t.asnumpy()[0])

    def _dp_mean(self, value: float) -> float:
        if self.ps.dp_size == 1:
            return value
        t = self.backend.comm.all_reduce(ms.Tensor([value], ms.float32), "avg", self.ps.dp_group)
        return float(t.asnumpy()[0])


def setup(args):
    """Gate the requested features (support matrix), create the backend and the process groups,
    fix up sizes; no data, no model yet."""
    args.backend = "mindspore"
    session = mindspeed.adapt(args)        # the support matrix (the one gate) refuses what this trainer cannot run
    backend = session.backend
    world = backend.comm.world_size()
    ps = build_parallel_state(backend.comm, args.tensor_model_parallel_size, args.sequence_parallel,
                              args.context_parallel_size, args.pipeline_model_parallel_size,
                              args.expert_model_parallel_size or 1, bool(args.moe_tp_extend_ep))
    set_collective_timeout(backend, args.distributed_timeout_minutes)
    if args.world_size != world:      # msrun sets no WORLD_SIZE: sizes derived at parse time were for 1
        args.world_size, args.data_parallel_size = world, ps.dp_size
    if args.global_batch_size % (args.micro_batch_size * ps.dp_size):
        raise TrainerConfigError(f"--global-batch-size {args.global_batch_size} is not divisible by "
                                 f"micro-batch-size x data-parallel size = {args.micro_batch_size} x {ps.dp_size}")
    backend.device.manual_seed(args.seed)
    # Megatron's flag (also set by --npu-deterministic): MindSpore's deterministic kernels, a switch
    # it refuses to set twice in one process (a second run in the same process finds it on)
    if args.deterministic_mode and ms.get_context("deterministic") != "ON":
        ms.set_deterministic(True)
    return session, ps


def set_collective_timeout(backend, minutes: float) -> None:
    """--distributed-timeout-minutes over every group's collectives once the groups are set up (which
    wait longer, as the torch trainer's do); refused where a group's collectives cannot time out."""
    untimed = backend.comm.set_timeout(minutes)
    if untimed and minutes != DISTRIBUTED_TIMEOUT_MINUTES:
        raise TrainerConfigError(
            f"--distributed-timeout-minutes {minutes:g}: the group of ranks {list(untimed[0].ranks)} runs MindSpore "
            "2.10's CPU collectives (MCCL: its ranks span hosts, are not on x86-64 or MINDSPEED_MS_SHM_COLLECTIVES=0), "
            "which take no timeout; drop the flag (msrun's MS_NODE_TIMEOUT notices a dead node) or use --backend torch")


def run(args) -> dict:
    started_at = time.time()     # --exit-duration-in-mins counts setup too, as Megatron's
    os.umask(0o027)
    # collections only on this thread: one started on a MindSpore runtime thread (running a pyfunc
    # kernel) frees autograd graphs there, under the main thread's feet
    with MainThreadCollection() as gc_point:
        session, ps = setup(args)
        logger = TrainingLogger(args, is_writer=session.backend.comm.rank() == 0)
        try:
            return _train(args, session, ps, logger, started_at, gc_point)
        finally:
            logger.close()
            session.close()


def resume(args, trainer, logger) -> tuple[int, int]:
    """(iteration, consumed samples) to start from: --load's checkpoint (iteration --ckpt-step when
    given) into the trainer's model, and its optimizer moments unless --no-load-optim or --finetune.
    Neutral checkpoints hold no RNG state, so none is loaded (--no-load-rng holds)."""
    if args.load_note:
        logger.print(args.load_note)
    for note in args.flag_notes:
        logger.print(note)
    if not args.load:
        return 0, 0
    meta = checkpoint.load(args.load, trainer.model, trainer.optimizer,
                           load_optimizer=not (args.no_load_optim or args.finetune), step=args.ckpt_step)
    iteration, consumed = 0, 0
    if not args.finetune:
        iteration, consumed = int(meta["iteration"]), int(meta.get("consumed_samples", 0))
        trainer.skipped_iterations = int(meta.get("skipped_iterations", 0))
        trainer.skipped_samples = int(meta.get("skipped_samples", trainer.skipped_iterations * args.global_batch_size))
    if trainer.scaler is not None and not (args.no_load_optim or args.finetune):
        trainer.scaler.load_state_dict(meta.get("grad_scaler", {}))    # Megatron keeps it with the optimizer
    logger.print(f"> loaded checkpoint {neutral.resolve(args.load, args.ckpt_step)} at iteration {iteration}")
    return iteration, consumed


# the summary run() returns, in this order (tests and users read it)
SUMMARY_KEYS = ("iteration", "final_valid_loss", "tokens_per_s", "parameters", "losses", "step_time_s")


def _train(args, session: Session, ps, logger, started_at: float, gc_point) -> dict:
    a, backend = args, session.backend
    vocab, train, valid, eod_rules = _data(a, logger)
    a.vocab_size = vocab
    a.padded_vocab_size = model_vocab_size(a, vocab, ps.tp_size)
    cfg = GPTConfig.from_args(a, a.padded_vocab_size, session.feature_ids)
    trainer = Trainer(a, backend, ps, cfg, session)
    n_params = sum(int(np.prod(p.shape)) for p in trainer.model.parameters())
    _print_setup(a, logger, backend, ps, cfg, trainer, n_params)
    for note in session.notes():
        logger.print(f"> {note}")
    logger.print(f"> data {a.data_path or 'default'}: vocab {vocab} (padded {a.padded_vocab_size}), "
                 f"train {train.num_samples} samples of {a.seq_length + 1} tokens")

    iteration, consumed = resume(a, trainer, logger)
    parts = loop_parts(a, backend, ps, trainer, (train, valid, eod_rules), gc_point)
    report = loop.RunReport(parameters=n_params, summary_keys=SUMMARY_KEYS, device=backend.device.name,
                            write_loss_file=rank_is_zero(backend), started_at=started_at)
    return loop.train(a, logger, parts, report, loop.Progress(iteration, consumed, trainer.skipped_iterations),
                      publish=session.publish)


def _data(args, logger):
    """(vocab size, train stream, validation stream or None, EOD rules): the flags' tokenizer
    (GPT2BPETokenizer, NullTokenizer, HuggingFaceTokenizer) gives the vocabulary where one is named."""
    a = args
    flag_tokenizer = named_tokenizer(a)
    if flag_tokenizer is not None:
        for prefix in ([] if a.mock_data else data.dataset_prefixes(a, logger.print)[0]):
            check_dataset_tokenizer(prefix, flag_tokenizer)
            if not a.is_instruction_dataset:        # (instruction data: its components are checked as read)
                check_dataset(prefix, flag_tokenizer.vocab_size)      # every id within the vocabulary
        a.vocab_size = flag_tokenizer.vocab_size   # build_streams takes it instead of the dataset's file
    vocab, train, valid = data.build_streams(a, log=logger.print)
    note = data.cache_note(a, [s for s in (train, valid) if s is not None])
    if note:
        logger.print(note)
    eod_rules = EodRules.from_args(a, data.eod_id(a, flag_tokenizer)
                                   if a.eod_mask_loss or a.reset_position_ids or a.reset_attention_mask else None)
    return vocab, train, valid, eod_rules


def _print_setup(args, logger, backend, ps, cfg, trainer, n_params) -> None:
    a, say = args, logger.print
    say(f"> MindSpeed backend mindspore on {backend.device.name} (MindSpore {ms.__version__}, "
        f"{'graph (traced forward)' if trainer.graph_mode else 'PyNative'}); {describe()}")
    say(f"> world {ps.tp_size * ps.cp_size * ps.dp_size * ps.pp_size} = TP {ps.tp_size} x CP {ps.cp_size} "
        f"x DP {ps.dp_size} x PP {ps.pp_size}"
        f"{f' (MoE: {cfg.num_experts} experts, top-{cfg.moe_router_topk}, EP {ps.ep_size})' if cfg.num_experts else ''}"
        f"{' (sequence parallel)' if ps.sequence_parallel else ''}; micro-batches per step "
        f"{a.global_batch_size // (a.micro_batch_size * ps.dp_size)}; parameters on rank 0: {n_params}")
    overlapped = [flag for flag, on in (("--overlap-grad-reduce", a.overlap_grad_reduce),
                                        ("--overlap-param-gather", a.overlap_param_gather)) if on]
    if overlapped:      # the support matrix's `emulated`: same collectives, run in turn
        say(f"> {' and '.join(overlapped)}: the same reductions and gathers, not overlapped with compute (emulated)")
    if trainer.distributed_optimizer:
        say(f"> distributed optimizer: rank 0 keeps {trainer.optimizer.state_elements()} optimizer state "
            f"values for its {n_params} parameters (a 1/{ps.dp_size} slice"
            f"{f'; its experts: a 1/{ps.edp_size} slice over expert-DP' if trainer.optimizer.experts else ''})")


def loop_parts(args, backend, ps, trainer: Trainer, streams: tuple, gc_point=lambda: None) -> loop.TrainParts:
    """This trainer's side of the shared outer loop (training/loop.py); streams: (train,
    validation or None, EOD rules); gc_point: called after each step (MainThreadCollection)."""
    a, (train, valid, eod_rules) = args, streams

    def step(iteration: int, consumed: int, batch_size: int) -> loop.StepResult:
        batches = data.micro_batches_for_step(train, consumed, a, ps.dp_rank, ps.dp_size, eod_rules, batch_size)
        loss, grad_norm, _lr = trainer.train_step(batches, iteration, consumed)
        gc_point()
        return loop.StepResult(loss, grad_norm, applied=not trainer.last_step_skipped)

    def evaluate() -> float | None:
        if valid is None:
            return None
        return trainer.evaluate([mb for k in range(a.eval_iters) for mb in data.micro_batches_for_step(
            valid, k * a.global_batch_size, a, ps.dp_rank, ps.dp_size, eod_rules)])

    def save(iteration: int, consumed: int) -> None:
        meta = {"consumed_samples": consumed, "backend": "mindspore", "tp": ps.tp_size,
                "num_layers": trainer.cfg.num_layers, "hidden_size": trainer.cfg.hidden_size,
                "skipped_iterations": trainer.skipped_iterations, "skipped_samples": trainer.skipped_samples,
                **({"grad_scaler": trainer.scaler.state_dict()} if trainer.scaler else {})}
        checkpoint.save(backend, ps, a.save, iteration, trainer.model, trainer.optimizer, meta,
                        with_optimizer=not a.no_save_optim)

    return loop.TrainParts(
        step=step, evaluate=evaluate, save=save,
        lr=lambda _iteration: trainer.lr_at(trainer.scheduled_samples),     # after the step just taken
        peak_memory_mb=lambda: backend.memory.peak_memory_bytes() / 2**20,
        batch_size=lambda consumed: loop.ramped_global_batch(a, consumed),
        loss_scale=(lambda: trainer.loss_scale) if trainer.scaler else None,
        any_rank=lambda flag: _any_rank(backend, flag))


def _any_rank(backend, flag: bool) -> bool:
    votes = backend.comm.all_reduce(ms.Tensor([int(flag)], ms.int32), "sum")
    return bool(votes.asnumpy()[0])


def rank_is_zero(backend) -> bool:
    return backend.comm.rank() == 0
