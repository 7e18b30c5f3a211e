"""MindSpeed inside Megatron-LM's own scripts (`pretrain_gpt.py` + `import mindspeed.megatron_adaptor`).

At import: check the Megatron version against the tested window, create the backend and apply the
device shim (Megatron-Core's and megatron.training's CUDA assumptions), then join Megatron's
argument parsing:
- `parse_args`: MindSpeed's flags are added to Megatron's own parser through its extra-args
  provider, so Megatron parses the whole command line and a misspelt flag is an error;
- `validate_args`: before Megatron's checks, MindSpeed-LLM's tokenizer flags become Megatron's
  (megatron_lm_data.tokenizer_problems), and so do its model-family spellings (megatron_lm_family;
  `parse_args` added those the parser lacks); the device's collective backend replaces nccl and
  options the device cannot honour are refused; after them, MindSpeed plans the enabled features,
  the support matrix gates them, and their hooks are applied, all before any model exists; then
  MindSpeed-LLM's --enable-hf2mg-convert converts the Hugging Face model at --load (with the converter the
  import line passes in: `convert_hf`) and Megatron loads the result.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys

from mindspeed.adaptor_core import (MindSpeedConfigError, _msadapter_active, activate_backend, apply_features_again,
                                    plan, resolve_device, set_host_flags, unadapt)
from mindspeed.features.base import FeatureConfigError
from mindspeed.features.registry import all_features
from mindspeed.flags.mindspeed_flags import (add_mindspeed_args, known_flags, mindspeed_parser, resolve_backend_name,
                                 unknown_flag_message, unknown_options)
from mindspeed import megatron_lm_data, megatron_lm_family
from mindspeed.backends import active_backend
from mindspeed.backends.torch.triton_cpu import interpret_triton_on_cpu
from mindspeed.errors import ConvertError
from mindspeed.patching import GLOBAL_PATCHES, PatchManager
from mindspeed.session import Plan, Session
from mindspeed.versions import megatron_version

log = logging.getLogger("mindspeed")

#: Megatron-LM versions the system tests run (tests_extend/system/test_megatron_lm.py)
TESTED_VERSIONS = ("0.12.1", "0.16.1")
BUILTIN_MINDSPORE_TRAINER = ("MindSpeed's built-in MindSpore trainer: "
                             "tests_extend/example/pretrain_gpt.py --backend mindspore "
                             "(launched by tests_extend/example/train_distributed_ms.sh)")


def present() -> bool:
    """True when `megatron.training` (Megatron-LM, not only the megatron-core wheel) is importable."""
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


def check_version(version: str | None = None) -> str:
    version = version or megatron_version()
    if version not in TESTED_VERSIONS:
        raise MindSpeedConfigError(
            f"MindSpeed: Megatron-LM {version} is not supported; tested with "
            f"{', '.join(TESTED_VERSIONS)} (check out core_v{TESTED_VERSIONS[-1]})")
    return version


def _transformer_engine_present() -> bool:
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ModuleNotFoundError, ValueError):
        return False


def _pre_read(argv) -> argparse.Namespace:
    """Backend and device are needed before Megatron parses (the shim precedes its imports);
    Megatron's parser validates them again, with everything else, in parse_args."""
    ns, _ = mindspeed_parser().parse_known_args(list(argv))
    try:
        ns.backend = resolve_backend_name(ns)
    except ValueError as exc:
        raise MindSpeedConfigError(f"MindSpeed: {exc}") from exc
    return ns


def _one_line_error(parser):
    """Megatron's parser errors as one line, an unknown flag with the closest known one."""
    def error(message):
        if message.startswith("unrecognized arguments:"):
            flags = unknown_options(message.split(":", 1)[1].split())
            message = "unrecognized arguments: " + unknown_flag_message(flags, known_flags(parser))
        sys.stderr.write(f"{parser.prog}: error: {' '.join(message.split())}\n")
        raise SystemExit(2)
    return error


class MegatronLMHooks:
    """The parse_args / validate_args wrappers, bound to one activated backend."""

    def __init__(self, session: Session, msadapter: bool, convert_hf=None):
        self.session = session
        self.msadapter = msadapter
        self.convert_hf = convert_hf     # (args, log) -> None: --load's Hugging Face model converted, args.load moved
        self.family = None          # megatron_lm_family.ParsedFamily of the last parse
        self.family_notes = []
        self.applied = None         # adaptor_core.AppliedFeatures of the last validate_args

    # -- parse_args ----------------------------------------------------------------------------
    def wrap_parse_args(self, original):
        def parse_args(extra_args_provider=None, ignore_unknown_args=False):
            def provider(parser):
                if extra_args_provider is not None:
                    parser = extra_args_provider(parser)
                add_mindspeed_args(parser)
                megatron_lm_data.add_args(parser)
                megatron_lm_data.add_tokenizer_args(parser)
                self.family = megatron_lm_family.add_args(parser)      # MindSpeed-LLM's model-family spellings
                parser.error = _one_line_error(parser)
                if not _transformer_engine_present():
                    # the default (transformer_engine) cannot import here: Megatron-Core's local
                    # layers are what MindSpeed's fused kernels plug into
                    parser.set_defaults(transformer_impl="local")
                return parser
            return original(provider, ignore_unknown_args)
        return parse_args

    # -- validate_args -------------------------------------------------------------------------
    def wrap_validate_args(self, original):
        def validate_args(args, defaults={}):   # noqa: B006 (Megatron's signature)
            tokenizer_problems = megatron_lm_data.tokenizer_problems(args)   # PretrainedFromHF: HuggingFaceTokenizer
            if tokenizer_problems:
                self._refuse(tokenizer_problems[0])
            if self.family is not None:       # MindSpeed-LLM's family spellings become Megatron's args
                family_problems, self.family_notes = megatron_lm_family.before_checks(args, self.family)
                if family_problems:
                    self._refuse(family_problems[0])
            self._before_megatron(args)
            result = original(args, defaults)
            if self.family is not None:
                megatron_lm_family.after_checks(args)
            self._after_megatron(args)
            if args.enable_hf2mg_convert:      # after the gate: nothing is converted for a refused run
                self._convert_hf(args)
            return result
        return validate_args

    def _convert_hf(self, args) -> None:
        if self.convert_hf is None:
            self._refuse("--enable-hf2mg-convert: this entry point has no converter (import mindspeed.megatron_adaptor "
                         "passes it); convert first with python -m mindspeed.convert and --load the result")
        rank0 = int(os.environ.get("RANK", "0")) == 0
        try:
            self.convert_hf(args, log=(lambda msg: print(msg, flush=True)) if rank0 else (lambda msg: None))
        except ConvertError as exc:
            self._refuse(str(exc))

    def _refuse(self, message: str):
        raise SystemExit(f"MindSpeed: {message}")

    def _before_megatron(self, args) -> None:
        device = self.session.plan.device
        if self.session.plan.backend != "torch":
            return
        from mindspeed.backends.torch.device import dist_backend_for  # imports torch: torch backend only
        wanted, given = dist_backend_for(device), args.distributed_backend
        gloo_on_accelerator = given == "gloo" and device != "cpu"   # the user's explicit choice
        if given in ("nccl", "hccl", "gloo") and given != wanted and not gloo_on_accelerator:
            if int(os.environ.get("RANK", "0")) == 0:
                log.warning("MindSpeed: --distributed-backend %s -> %s (device %s)", given, wanted, device)
            args.distributed_backend = wanted
        if args.use_torch_fsdp2 and device == "cpu":
            # Megatron-LM asserts this CUDA knob is not 1 under FSDP2 (the CPU shim sets 1 for its TP/CP
            # assert, which FSDP2 runs skip); meaningless on CPU, restored by unadapt() with the shim's
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "2"
        if args.transformer_impl == "transformer_engine" and not _transformer_engine_present():
            self._refuse("--transformer-impl transformer_engine needs NVIDIA Transformer Engine, which is "
                         "not installed; use --transformer-impl local (MindSpeed's fused kernels plug into it)")
        if args.apply_rope_fusion and not _transformer_engine_present():
            # Megatron's default (--no-rope-fusion turns it off) needs TE's kernel; MindSpeed's
            # fused rope kernel serves it instead (Megatron's own unfused RoPE at level 0)
            args.apply_rope_fusion = False
            if args.position_embedding_type == "rope":
                args.use_fused_rotary_pos_emb = True
        if getattr(args, "batch_invariant_mode", False) and device == "cpu":     # core_v0.16's, not core_v0.12's
            self._refuse("--batch-invariant-mode needs triton GPU kernels, which device cpu lacks; "
                         "drop the flag")
        self._early_host_flags(args)

    def _early_host_flags(self, args) -> None:
        """Host flags Megatron's own checks must already see (--num-layer-list's pipeline layout)."""
        for f in all_features():
            if f.before_host_checks and f.enabled(args):
                try:
                    f.validate(args)
                except FeatureConfigError as exc:
                    self._refuse(str(exc))
                values = f.host_values(args)
                missing = [dest for dest in values if not hasattr(args, dest)]
                if missing:      # e.g. a pipeline layout on a Megatron-LM older than core_v0.13
                    self._refuse(f"{f.trigger(args)} needs Megatron's --{missing[0].replace('_', '-')}, which "
                                 f"Megatron-LM {megatron_version()} lacks (core_v0.13 on have it; tested: "
                                 "core_v0.16.1)")
                for dest, value in values.items():
                    setattr(args, dest, value)

    def _after_megatron(self, args) -> None:
        if args.use_torch_fsdp2 and self.session.plan.device == "cpu" and hasattr(args, "high_priority_stream_groups"):
            # core_v0.16 gives FSDP2's dp_cp group high-priority CUDA streams, whose NCCL options a CPU torch lacks
            args.high_priority_stream_groups = [g for g in args.high_priority_stream_groups if g != "dp_cp"]
        try:
            p = plan(args)
        except MindSpeedConfigError as exc:
            raise SystemExit(str(exc)) from None
        for f in p.features:
            if f.megatron_lm_refusal:
                self._refuse(f"{f.trigger(args)}: {f.megatron_lm_refusal}")
        data_problems = megatron_lm_data.problems(args)
        if data_problems:
            self._refuse(data_problems[0])
        active = self.session.plan
        if (p.backend, p.device) != (active.backend, active.device):
            self._refuse(f"--backend/--device give {p.backend}/{p.device} but the adaptor activated "
                         f"{active.backend}/{active.device} at import; pass them on the command line")
        # Megatron-Core's tests validate args once per test in one process: the same flags keep
        # what is applied, other flags replace the last plan's features
        self.applied = apply_features_again(
            self.session.context, p, self.applied,
            then=(lambda: megatron_lm_data.install(self.session)) if args.is_instruction_dataset else None)
        set_host_flags(p, args)      # after Megatron's checks (its --deterministic-mode asserts NCCL_ALGO)
        self.session.plan = p
        megatron_lm_data.after_plan(args, self.session)
        if int(os.environ.get("RANK", "0")) == 0:
            # one write with its newline: under `python -u` print writes the end apart, and another
            # rank's output sharing the pipe could land between the two
            sys.stdout.write("".join(f"> {line}\n" for line in
                                     ["MindSpeed " + p.describe().replace("\n", "; "), *p.notes(),
                                      *(f"MindSpeed: {note}" for note in self.family_notes)]))
            sys.stdout.flush()


def _route_cp_batch_sharding(session: Session):
    """Megatron-LM's get_batch shards for its own (load-balanced ring) layout; MindSpeed's CP
    algorithms each expect their own. Bound at import, before pretrain_gpt.py imports the name;
    routes to the CP feature's sharding once that feature is applied (validate_args)."""
    def wrap(original):
        def get_batch_on_this_cp_rank(batch, *args, **kwargs):
            megatron_lm_data.publish_documents(batch, session)    # EOD reset: the document ends, before sharding
            shard = session.shard_batch
            return shard(batch) if shard is not None else original(batch, *args, **kwargs)
        return get_batch_on_this_cp_rank
    return wrap


def adapt_megatron_lm(argv, patcher: PatchManager = GLOBAL_PATCHES, convert_hf=None) -> Session:
    """The import hook under Megatron-LM: version check, backend + device shim, parser hooks. convert_hf:
    the Hugging Face converter --enable-hf2mg-convert runs (mindspeed.convert sits beside this layer)."""
    if active_backend() is not None:
        unadapt(patcher)
    msadapter = _msadapter_active()
    ns = _pre_read(argv)
    if msadapter and not any(a.split("=")[0] in ("--backend", "--ai-framework") for a in argv):
        ns.backend = "mindspore"
    if ns.backend == "mindspore" and not msadapter:
        raise MindSpeedConfigError(
            "MindSpeed: Megatron-LM's own scripts run on MindSpore only through MSAdapter (put an "
            "MSAdapter checkout first on PYTHONPATH); without it use " + BUILTIN_MINDSPORE_TRAINER)
    try:
        device = resolve_device(ns.backend, ns.mindspeed_device or "auto")
    except (ValueError, RuntimeError, ImportError) as exc:
        raise MindSpeedConfigError(f"MindSpeed: {exc}") from exc
    if ns.backend == "torch":
        interpret_triton_on_cpu(patcher, device)   # before check_version imports megatron.core's kernels
    check_version()
    ctx = activate_backend(ns.backend, device, patcher, megatron_lm=(ns.backend == "torch"))
    session = Session(Plan(ns, ns.backend, device, [], msadapter=msadapter), ctx, patcher)
    hooks = MegatronLMHooks(session, msadapter, convert_hf)
    patcher.wrap("megatron.training.arguments.parse_args", hooks.wrap_parse_args,
                 reason="MindSpeed's flags join Megatron's parser", aliases="megatron")
    patcher.wrap("megatron.training.arguments.validate_args", hooks.wrap_validate_args,
                 reason="device backend, then MindSpeed's gate and features after Megatron's checks",
                 aliases="megatron")
    patcher.wrap("megatron.core.utils.get_batch_on_this_cp_rank", _route_cp_batch_sharding(session),
                 reason="batches sharded as the active MindSpeed CP algorithm expects", aliases="megatron")
    if ns.backend == "torch":
        from mindspeed.features.memory import shared_mask  # imports torch: torch backend only
        shared_mask.install_megatron_lm(patcher)
    megatron_lm_data.install_documents(ctx)
    return session
