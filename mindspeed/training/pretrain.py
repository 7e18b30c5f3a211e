"""GPT pretraining loop on Megatron-Core (torch backend): the thing train_distributed.sh runs.

run(args): check inputs -> process groups -> model/DDP/optimizer/scheduler -> (load) -> train
with periodic validation and checkpoints -> final validation. Returns a summary dict.
"""
from __future__ import annotations

import datetime
import os
import time
from contextlib import nullcontext
from functools import partial

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                       get_current_global_batch_size, get_num_microbatches,
                                                       init_num_microbatches_calculator, update_num_microbatches)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from mindspeed.session import Session
from mindspeed.backends.torch import glibc_heap
from mindspeed.backends.torch.device import dist_backend_for
from mindspeed.backends.torch.mode_free_steps import ModeFreeSteps
from mindspeed.checkpoint import legacy, torch_dist
from mindspeed.data import flag_tokenizers
from mindspeed.data.indexed_reader import check_dataset
from mindspeed.errors import CheckpointError
from mindspeed.flags.checks import dynamic_loss_scaling
from mindspeed.net import free_port
from mindspeed.features.parallel import fsdp2_megatron
from mindspeed.training import collective_timeout, data, loop
from mindspeed.features.parallel.dualpipev import dualpipev_on
from mindspeed.training.dualpipev import DualPipeVSchedule
from mindspeed.training.layer_spec import SpecModules
from mindspeed.training.logger import TrainingLogger
from mindspeed.training.model import build_model_chunks, count_parameters, transformer_config, virtual_stages


def process_group_backend(requested: str | None, device: str) -> str:
    """Megatron scripts say `--distributed-backend nccl` meaning "the accelerator's collective
    library": nccl and hccl (and no flag) pick the device's one; gloo is taken as asked."""
    return "gloo" if requested == "gloo" else dist_backend_for(device)


def _init_distributed(args, device: str, setup_minutes: float | None = None) -> None:
    # setting up waits for every rank to start (minutes apart on a loaded machine), however short
    # --distributed-timeout-minutes is; the collectives of training then wait that long (collective_timeout)
    if setup_minutes is None:
        setup_minutes = max(args.distributed_timeout_minutes, collective_timeout.SETUP_MINUTES)
    try:
        _join(args, device, setup_minutes)
    except RuntimeError as err:
        # a rank missing from the setup, or one that left it (exited or died)
        error = collective_timeout.setup_error(err, setup_minutes) or \
            collective_timeout.one_line_error(err, setup_minutes)
        if error is None:
            raise
        raise error from None
    collective_timeout.set_every_group(args.distributed_timeout_minutes)


def _join(args, device: str, setup_minutes: float) -> None:
    if "RANK" not in os.environ:            # plain `python pretrain_gpt.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if device in ("cuda", "npu"):
        getattr(torch, device).set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=process_group_backend(args.distributed_backend, device),
            timeout=datetime.timedelta(minutes=setup_minutes))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_stages(args),
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        # the V's word embeddings (and an MTP block's copy of them) all live on pipeline rank 0
        get_embedding_ranks=(lambda pp_ranks: pp_ranks[:1]) if dualpipev_on(args) else None,
        distributed_timeout_minutes=setup_minutes)      # its groups' timeout: 30 min otherwise


def _set_seeds(args) -> None:
    if args.deterministic_mode:
        torch.use_deterministic_algorithms(True)
    # different seed per pipeline stage, as Megatron does; TP ranks share it (tracker forks TP)
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean token loss of this micro-batch; with CP the token count is the whole sequence's."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    local_sum = torch.sum(losses * mask)
    count = mask.sum()
    total = count.detach().clone()
    if parallel_state.get_context_parallel_world_size() > 1:
        torch.distributed.all_reduce(total, group=parallel_state.get_context_parallel_group())
    loss = local_sum / total.clamp(min=1.0)
    return loss, {"lm loss": torch.stack([local_sum.detach(), count.detach()])}


def forward_step(reader: data.BatchReader, data_iterator, model, mtp: bool = False,
                 return_schedule_plan: bool = False):
    batch = reader(data_iterator)
    # the MTP block masks its own losses with the batch's mask (GPTModel's loss_mask is read by MTP only)
    extra = {"loss_mask": batch["loss_mask"]} if mtp else {}
    # Megatron-Core's combined 1F1B (--moe-fb-overlap) asks for the micro-batch's schedule plan instead
    # of its output; the plan runs the same forward layer by layer
    run = model.build_schedule_plan if return_schedule_plan else model
    output = run(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                 **extra)
    return output, partial(loss_func, batch["loss_mask"])


def optimizer_config(args, params_dtype: torch.dtype) -> OptimizerConfig:
    """Megatron-Core's optimizer settings; fp16 loss-scaling flags not given take Megatron's defaults."""
    scaling = dynamic_loss_scaling(args)
    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        params_dtype=params_dtype, loss_scale=args.loss_scale, **scaling,
        use_distributed_optimizer=args.use_distributed_optimizer, overlap_param_gather=args.overlap_param_gather)


def init_batch_schedule(args, rank: int) -> None:
    """Megatron-Core's micro-batch calculator: constant, or growing under --rampup-batch-size."""
    init_num_microbatches_calculator(rank, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size,
                                     args.data_parallel_size)


def step_batch(consumed_samples: int) -> tuple[int, int]:
    """(micro-batches per rank, global batch size) of the step that starts at consumed_samples."""
    update_num_microbatches(consumed_samples, consistency_check=True)
    return get_num_microbatches(), get_current_global_batch_size()


def _reduce_loss(losses_reduced: list, device: str) -> float:
    """Mean token loss of a step over all micro-batches, data- and context-parallel ranks."""
    pair = torch.zeros(2, dtype=torch.float64, device=device)
    # the schedules return the losses where the loss is computed (DualPipeV: pipeline rank 0)
    counts_here = bool(losses_reduced) and parallel_state.get_tensor_model_parallel_rank() == 0
    if counts_here:
        for item in losses_reduced:
            pair += item["lm loss"].to(torch.float64)
    torch.distributed.all_reduce(pair)
    return float(pair[0] / pair[1].clamp(min=1.0))


class Trainer:
    def __init__(self, args, logger: TrainingLogger, reader: data.BatchReader | None = None, lora=None,
                 spec_modules: SpecModules | None = None, ema_weights=None):
        self.args, self.log = args, logger
        self.ema_weights = ema_weights      # --use-ema: a context in which the model holds the EMA weights
        self.lora = lora            # the LoRA feature's part: adapters on a frozen model
        self.spec_modules = spec_modules     # what the features put into the layer spec (layer_spec.py)
        self.device = args.device_name
        self.reader = reader or data.BatchReader(self.device)
        self._mode_free = ModeFreeSteps(self.device)
        self.config = transformer_config(args)
        self.model = self._build_model()
        self.optimizer = self._build_optimizer()
        self.scheduler = self._build_scheduler()
        self.forward_backward = forward_backward_func(args)
        self.num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)

    def _build_model(self):
        a = self.args
        chunks = build_model_chunks(a, self.config, self.spec_modules)
        if self.lora is not None:   # frozen before DDP and the optimizer: they hold only the adapters
            adapters = self.lora.attach(chunks)
            trainable = sum(p.numel() for chunk in chunks for p in chunk.parameters() if p.requires_grad)
            self.log.print(f"> LoRA: {adapters} adapters (r {self.lora.r}, alpha {self.lora.alpha:g}) on "
                           f"{' '.join(self.lora.targets)}; trainable parameters on rank 0: {trainable}")
        for chunk in chunks:
            chunk.to(self.device)
        if a.use_torch_fsdp2:     # PyTorch's fully_shard instead of DDP (features/parallel/fsdp2.py)
            return fsdp2_megatron.wrap_chunks(a, self.config, chunks)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=a.overlap_grad_reduce,
            overlap_param_gather=a.overlap_param_gather, use_distributed_optimizer=a.use_distributed_optimizer,
            check_for_nan_in_grad=a.check_for_nan_in_loss_and_grad, bucket_size=None if not a.overlap_grad_reduce else 40_000_000)
        wrapped = [DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=chunk,
                                           disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
        for model_chunk in wrapped:
            model_chunk.broadcast_params()   # every data-parallel replica starts identical
        return wrapped

    def _build_optimizer(self):
        a = self.args
        settings = optimizer_config(a, self.config.params_dtype)
        if a.use_torch_fsdp2:
            settings = fsdp2_megatron.optimizer_config(a, settings)
        optimizer = get_megatron_optimizer(settings, self.model)
        # what Megatron-LM's setup wires into the config for the schedules
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = optimizer.scale_loss
        if a.overlap_grad_reduce:
            self.config.no_sync_func = self._per_chunk("no_sync")
            self.config.grad_sync_func = self._per_chunk("start_grad_sync")
        if a.overlap_param_gather:
            self.config.param_sync_func = self._per_chunk("start_param_sync")
        return optimizer

    def _per_chunk(self, method: str):
        """Megatron's schedules take one callable, or a list with one per virtual stage."""
        funcs = [getattr(m, method) for m in self.model]
        return funcs[0] if len(funcs) == 1 else funcs

    def _build_scheduler(self):
        a = self.args
        gbs = a.global_batch_size
        return OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if a.lr_warmup_iters else a.lr, max_lr=a.lr, min_lr=a.min_lr,
            lr_warmup_steps=a.lr_warmup_iters * gbs, lr_decay_steps=a.lr_decay_iters * gbs,
            lr_decay_style=a.lr_decay_style, start_wd=a.weight_decay, end_wd=a.weight_decay,
            wd_incr_steps=a.train_iters * gbs, wd_incr_style="constant",
            wsd_decay_steps=a.lr_wsd_decay_iters * gbs if a.lr_decay_style == "WSD" else None,
            lr_wsd_decay_style=a.lr_wsd_decay_style)

    def iterators(self, dataset, consumed: int):
        """One micro-batch iterator per model chunk (virtual pipeline stages need one each)."""
        return microbatch_iterators(self.args, self.model, dataset, consumed, self.reader.masks)

    def _run_schedule(self, iterator, forward_only: bool, num_microbatches: int | None = None):
        return run_schedule(self.args, self.model, iterator, self.reader, forward_only,
                            num_microbatches or self.num_microbatches, self.forward_backward)

    def train_step(self, iterator, num_microbatches: int | None = None, batch_size: int | None = None):
        """One optimizer step; during batch size ramp-up, of `batch_size` samples in
        `num_microbatches` micro-batches per rank (default: the full global batch). On cpu the
        steps after a first one that asked the device shim's mode for nothing run without it."""
        return self._mode_free(self._train_step, iterator, num_microbatches, batch_size)

    def _train_step(self, iterator, num_microbatches: int | None, batch_size: int | None):
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self._run_schedule(iterator, forward_only=False, num_microbatches=num_microbatches)
        ok, grad_norm, _ = self.optimizer.step()
        if ok:   # the schedule counts samples, as Megatron's does
            self.scheduler.step(increment=batch_size or self.args.global_batch_size)
        return _reduce_loss(losses, self.device), grad_norm, ok

    def evaluate(self, dataset) -> float | None:
        with self.ema_weights([self.optimizer]) if self.ema_weights else nullcontext():
            return validation_loss(self.args, self.model, dataset, self.reader, self.num_microbatches)


def microbatch_iterators(args, model_chunks: list, dataset, consumed: int, masks):
    """One micro-batch iterator per model chunk (virtual pipeline stages need one each); `masks`: the
    reader's shared causal masks."""
    return [data.microbatches(dataset, consumed, args, masks) for _ in model_chunks] \
        if len(model_chunks) > 1 else data.microbatches(dataset, consumed, args, masks)


def forward_backward_func(args):
    """Megatron-Core's schedule for the run's layout, or DualPipeV's (training/dualpipev.py)."""
    return DualPipeVSchedule(args.dualpipev_dw_detach) if dualpipev_on(args) else get_forward_backward_func()


def run_schedule(args, model_chunks: list, iterator, reader: data.BatchReader, forward_only: bool,
                 num_microbatches: int, forward_backward=None):
    """One global batch through the run's pipeline schedule; the losses of its micro-batches."""
    forward_backward = forward_backward or forward_backward_func(args)
    return forward_backward(
        forward_step_func=partial(forward_step, reader, mtp=bool(args.mtp_num_layers)),
        data_iterator=iterator,
        model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
        num_microbatches=num_microbatches, seq_length=args.seq_length // args.context_parallel_size,
        micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length, forward_only=forward_only)


def validation_loss(args, model_chunks: list, dataset, reader: data.BatchReader,
                    num_microbatches: int) -> float | None:
    """The trainer's validation loss: the mean over --eval-iters global batches (the same batches
    every time, from the split's first sample) of each batch's mean token loss. Also what
    `python -m mindspeed.evaluate` reports for this trainer's checkpoints."""
    if dataset is None or args.eval_iters < 1:
        return None
    for chunk in model_chunks:
        chunk.eval()
    iterator = microbatch_iterators(args, model_chunks, dataset, 0, reader.masks)
    pair = []
    with torch.no_grad():
        for _ in range(args.eval_iters):
            losses = run_schedule(args, model_chunks, iterator, reader, True, num_microbatches)
            pair.append(_reduce_loss(losses, reader.device))
    for chunk in model_chunks:
        chunk.train()
    return sum(pair) / len(pair)


def run(args, session: Session) -> dict:
    """Train as `args` say, with the features `session` applied (mindspeed.adapt(args))."""
    started_at = time.time()     # --exit-duration-in-mins counts setup too, as Megatron's
    os.umask(0o027)   # checkpoints, logs, TensorBoard files: 0640 / 0750
    args.device_name = session.device
    collectives = process_group_backend(args.distributed_backend, args.device_name)
    if args.distributed_backend not in (None, collectives):
        args.flag_notes = [*args.flag_notes, f"> --distributed-backend {args.distributed_backend} "
                           f"runs as {collectives}: the collective library of device {args.device_name}"]
    if args.device_name == "cpu":
        glibc_heap.keep_freed_memory()     # each step reuses the pages the last one freed
    rank = int(os.environ.get("RANK", "0"))
    say = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)

    # --- everything that can be wrong with the inputs is found before any work -------------
    tokenizer = resolve_tokenizer(args, log=say)
    args.vocab_size = tokenizer.vocab_size
    rows_given = args.padded_vocab_size is not None         # --padded-vocab-size
    args.padded_vocab_size = flag_tokenizers.model_vocab_size(args, tokenizer.vocab_size,
                                                              args.tensor_model_parallel_size)
    if args.load:
        torch_dist.read_tracker(args.load, args.ckpt_step)
        if rows_given:
            torch_dist.check_vocab_rows(args.load, args.ckpt_step, args.padded_vocab_size)
    lora = session.part("lora")
    if lora is not None:
        check_lora_checkpoints(args, lora)

    _init_distributed(args, args.device_name)
    _set_seeds(args)
    init_batch_schedule(args, rank)
    logger = TrainingLogger(args, is_writer=rank == 0)
    try:
        return _train(args, tokenizer, logger, session, started_at)
    except RuntimeError as err:
        hung = collective_timeout.one_line_error(err, args.distributed_timeout_minutes)
        if hung is None:
            raise
        raise hung from None
    finally:
        logger.close()
        destroy_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def resolve_tokenizer(args, log=print):
    """The flags' tokenizer (GPT2BPETokenizer / NullTokenizer) checked against every dataset, else
    the dataset's own (data.resolve_data)."""
    tokenizer = flag_tokenizers.from_flags(args)
    if tokenizer is None:
        return data.resolve_data(args, log=log)
    if not args.mock_data:
        for prefix in data.indexed_prefixes(args):
            check_dataset(prefix)
        for prefix in data.dataset_prefixes(args.data_path):
            flag_tokenizers.check_dataset_tokenizer(prefix, tokenizer)
        for prefix in data.token_prefixes(args):
            check_dataset(prefix, tokenizer.vocab_size)
    return tokenizer


def resume(args, trainer, logger) -> tuple[int, int]:
    """(iteration, consumed samples) to start from: --load's checkpoint (iteration --ckpt-step when
    given) into the trainer's model, and its optimizer unless --no-load-optim or --finetune; the
    learning-rate schedule continues from the loaded iteration. A torch_dist checkpoint holds no RNG
    state (every run seeds from --seed); a legacy one's (--ckpt-format torch) is loaded unless
    --no-load-rng."""
    if args.load_note:
        logger.print(args.load_note)
    for note in args.flag_notes:
        logger.print(note)
    if trainer.lora is not None:
        return resume_lora(args, trainer, logger)
    if not args.load:
        return 0, 0
    iteration, consumed = _load_training_state(args.load, trainer, args, step=args.ckpt_step)
    logger.print(f"> loaded checkpoint {args.load} at iteration {iteration}")
    return iteration, consumed


def _load_training_state(root: str, trainer, args, step: int | None = None, only=None) -> tuple[int, int]:
    """The model (the tensors `only` selects), the optimizer unless --no-load-optim / --finetune,
    the schedule and the counters from `root`."""
    return torch_dist.load_checkpoint(root, trainer.model, trainer.optimizer, trainer.scheduler,
                                      load_optim=not args.no_load_optim, finetune=args.finetune, step=step,
                                      only=only, load_rng=not args.no_load_rng)


def check_lora_checkpoints(args, lora) -> None:
    """Before any work: --load is a whole model and --lora-load holds adapters like this run's."""
    if args.load and "lora" in torch_dist.read_common(args.load, args.ckpt_step):
        raise CheckpointError(f"--load {args.load} holds only LoRA adapters: give it as --lora-load, and the "
                              "base model's checkpoint as --load")
    if args.lora_load and args.save and os.path.realpath(args.lora_load) == os.path.realpath(args.save) \
            and not os.path.isfile(os.path.join(args.lora_load, torch_dist.TRACKER)):
        # Megatron's auto-resume idiom (--save X --lora-load X) on its first run: nothing to resume yet
        args.load_note = f"> --lora-load {args.lora_load}: no adapters yet in this --save directory; new adapters"
        args.lora_load = None
    if args.lora_load:
        saved = torch_dist.read_common(args.lora_load).get("lora")
        if saved is None:
            raise CheckpointError(f"--lora-load {args.lora_load} holds no LoRA adapters (a whole model's "
                                  "checkpoint belongs in --load)")
        if saved != lora.settings:
            raise CheckpointError(f"--lora-load {args.lora_load} holds adapters with r {saved['r']}, alpha "
                                  f"{saved['alpha']:g} on {' '.join(saved['target_modules'])}; give the same "
                                  "--lora-r, --lora-alpha and --lora-target-modules")


def resume_lora(args, trainer, logger) -> tuple[int, int]:
    """LoRA: the frozen base model's weights from --load (none of its optimizer state or counters),
    then the adapters, their optimizer state and the counters from --lora-load (unless
    --no-load-optim / --finetune)."""
    lora = trainer.lora
    if args.load:
        torch_dist.load_checkpoint(args.load, trainer.model, None, trainer.scheduler, finetune=True,
                                   step=args.ckpt_step, only=lambda name: not lora.is_adapter_key(name))
        logger.print(f"> loaded base model {args.load} (frozen)")
    if not args.lora_load:
        return 0, 0
    iteration, consumed = _load_training_state(args.lora_load, trainer, args, only=lora.is_adapter_key)
    logger.print(f"> loaded LoRA adapters {args.lora_load} at iteration {iteration}")
    return iteration, consumed


# the summary run() returns, in this order (tests and users read it)
SUMMARY_KEYS = ("iteration", "final_valid_loss", "unigram_baseline", "tokens_per_s", "parameters")


def _train(args, tokenizer, logger: TrainingLogger, session: Session, started_at: float) -> dict:
    a = args
    baseline = None if a.mock_data else data.unigram_entropy(data.token_prefixes(a), tokenizer.vocab_size)
    reader = data.BatchReader.for_session(session, a, tokenizer.eod)
    train_ds, valid_ds, _test_ds = data.build_datasets(a, tokenizer, packed=reader.packed)
    trainer = Trainer(a, logger, reader, lora=session.part("lora"), spec_modules=SpecModules.of(session),
                      ema_weights=session.part("ema_weights"))
    n_params = count_parameters(trainer.model)
    logger.print(f"> MindSpeed {session.plan.describe()}".replace("\n", "; "))
    for note in session.notes():
        logger.print(f"> {note}")
    logger.print(f"> world {a.world_size} = TP {a.tensor_model_parallel_size} x PP {a.pipeline_model_parallel_size}"
                 f" x CP {a.context_parallel_size} x DP {a.data_parallel_size}; micro-batches per step "
                 f"{trainer.num_microbatches}; parameters on rank 0: {n_params}")
    logger.print(f"> data {a.data_path}: vocab {tokenizer.vocab_size} (padded {a.padded_vocab_size}), "
                 f"train {data.samples_per_epoch_note(train_ds, a)}")
    if baseline is not None:
        logger.print(f"> unigram baseline (entropy of token frequencies): {baseline:.4f} nats/token")

    iteration, consumed = resume(a, trainer, logger)
    parts = loop_parts(a, trainer, trainer.iterators(train_ds, consumed), valid_ds, session.backend)
    report = loop.RunReport(parameters=n_params, summary_keys=SUMMARY_KEYS, device=a.device_name,
                            write_loss_file=torch.distributed.get_rank() == 0, unigram_baseline=baseline,
                            started_at=started_at)
    return loop.train(a, logger, parts, report, loop.Progress(iteration, consumed), publish=session.publish)


def loop_parts(args, trainer: Trainer, train_iter, valid_ds, backend) -> loop.TrainParts:
    """This trainer's side of the shared outer loop (training/loop.py); `backend`: the session's."""
    def step(iteration: int, consumed: int, batch_size: int) -> loop.StepResult:
        # the micro-batch count step_batch set for this step (the loop asked batch_size first)
        loss, grad_norm, ok = trainer.train_step(train_iter, get_num_microbatches(), batch_size)
        return loop.StepResult(loss, grad_norm, applied=bool(ok))

    lora = trainer.lora

    def save(iteration: int, consumed: int) -> str:
        extra = {"lora": lora.settings} if lora else {}
        optimizer, only = None if args.no_save_optim else trainer.optimizer, lora.is_adapter_key if lora else None
        if args.ckpt_format == "torch":       # Megatron-LM's legacy per-rank files (no optimizer entry says it)
            return legacy.save_checkpoint(args.save, iteration, trainer.model, optimizer, trainer.scheduler, consumed,
                                          args=args, only=only, extra=extra or None, save_rng=not args.no_save_rng)
        if args.no_save_optim:
            extra["no_optimizer"] = True      # a resume that asks for optimizer state is refused in one line
        return torch_dist.save_checkpoint(args.save, iteration, trainer.model, optimizer, trainer.scheduler,
                                          consumed, only=only, extra=extra or None)

    return loop.TrainParts(
        step=step, evaluate=lambda: trainer.evaluate(valid_ds), save=save,
        lr=lambda _iteration: trainer.scheduler.get_lr(trainer.optimizer.param_groups[0]),
        peak_memory_mb=lambda: backend.memory.peak_memory_bytes() / 2**20,
        batch_size=lambda consumed: step_batch(consumed)[1],
        loss_scale=(lambda: float(trainer.optimizer.get_loss_scale())) if args.fp16 else None,
        any_rank=lambda flag: _any_rank(flag, args.device_name))


def _any_rank(flag: bool, device: str) -> bool:
    votes = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(votes)
    return bool(votes.item())
