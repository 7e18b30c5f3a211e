"""MindSpeed's command-line flags: its own (backend, device, optimization level) plus every
registered feature's flags, and the Megatron flags those features key on.

Nothing here parses sys.argv at import time. `add_mindspeed_args(parser)` adds to a host parser
(skipping options the host already defines, e.g. Megatron's --context-parallel-size);
`parse_mindspeed_args(argv)` uses parse_known_args so Megatron's own flags are left alone.
"""
from __future__ import annotations

import argparse
import os

from mindspeed.features.registry import all_features

FRAMEWORK_ALIASES = {"pytorch": "torch", "torch": "torch", "mindspore": "mindspore"}


def _core_flags(group, existing):
    def add(name, **kwargs):
        if name not in existing:
            group.add_argument(name, **kwargs)

    add("--backend", choices=["torch", "mindspore"], default=None,
        help="framework that runs the job (default: torch, or mindspore when MSAdapter is active)")
    add("--ai-framework", dest="ai_framework", choices=["pytorch", "mindspore"], default=None,
        help="alias of --backend, as in MindSpeed upstream")
    add("--device", dest="mindspeed_device", choices=["auto", "cpu", "cuda", "npu", "ascend"],
        default=os.environ.get("MINDSPEED_DEVICE", "auto"),
        help="device for the backend (default auto: npu > cuda > cpu; env MINDSPEED_DEVICE)")
    add("--optimization-level", type=int, choices=[0, 1, 2], default=2,
        help="0: device support only; 1: + affinity (fused kernels); 2: + acceleration features")


def add_mindspeed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    existing = set(parser._option_string_actions)
    group = parser.add_argument_group("MindSpeed")
    _core_flags(group, existing)
    for feature in all_features():
        for flag in feature.flags:
            if flag.name in existing:
                continue            # the host (Megatron) parser already owns this flag
            group.add_argument(flag.name, **flag.kwargs)
            existing.add(flag.name)
    return parser


def mindspeed_parser() -> argparse.ArgumentParser:
    return add_mindspeed_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))


def resolve_backend_name(args) -> str:
    """--backend wins; --ai-framework is its alias; they must agree when both are given."""
    backend = getattr(args, "backend", None)
    framework = FRAMEWORK_ALIASES.get(getattr(args, "ai_framework", None) or "", None)
    if backend and framework and backend != framework:
        raise ValueError(f"--backend {backend} and --ai-framework {args.ai_framework} disagree")
    return backend or framework or os.environ.get("MINDSPEED_BACKEND") or "torch"


def parse_mindspeed_args(argv=None, namespace=None) -> argparse.Namespace:
    args, _unknown = mindspeed_parser().parse_known_args(argv, namespace)
    args.backend = resolve_backend_name(args)
    return args


def defaults() -> argparse.Namespace:
    """All MindSpeed flags at their defaults (programmatic use without a command line)."""
    return parse_mindspeed_args([])
