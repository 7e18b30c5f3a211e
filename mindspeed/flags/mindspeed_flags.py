"""MindSpeed's command-line flags: its own (backend, device, optimization level) plus every
registered feature's flags, and the Megatron flags those features key on.

Nothing here parses sys.argv at import time. `add_mindspeed_args(parser)` adds to a host parser
(skipping options the host already defines, e.g. Megatron's --context-parallel-size);
`parse_mindspeed_args(argv)` uses parse_known_args so Megatron's own flags are left alone.
"""
from __future__ import annotations

import argparse
import difflib
import os

from mindspeed.features.host_flags import ABSENT_UNTIL_GIVEN
from mindspeed.features.registry import all_features
from mindspeed.errors import ArgumentError, OneLineParser
from mindspeed.flags.checks import is_number
from mindspeed.megatron_defaults import HOST_FLAG_DEFAULTS

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
            if flag.name in existing or flag.host:
                continue            # the host (Megatron) parser owns this flag
            group.add_argument(flag.name, **flag.kwargs)
            existing.add(flag.name)
    return parser


_PARSERS: dict = {}


def shared_parser(kind, build) -> argparse.ArgumentParser:
    """`build()`, built once per kind, $MINDSPEED_DEVICE (a default) and set of registered features,
    then shared: callers only parse with it, never change it. Building one (hundreds of
    add_argument calls) was most of what a `check` or a parse_args cost."""
    features = all_features()
    key = (kind, os.environ.get("MINDSPEED_DEVICE", "auto"), tuple(id(f) for f in features))
    if key not in _PARSERS:
        _PARSERS[key] = (build(), features)     # the features kept alive: their ids stay theirs
    return _PARSERS[key][0]


def mindspeed_parser() -> argparse.ArgumentParser:
    return shared_parser("mindspeed", lambda: add_mindspeed_args(OneLineParser(add_help=False, allow_abbrev=False)))


def trainer_parser(host_defaults: bool = True) -> argparse.ArgumentParser:
    """The built-in trainers' Megatron-style parser with MindSpeed's flags: every flag `check`,
    `adapt(argv)` and the trainers know. host_defaults=False: a Megatron flag not given is left
    out of the namespace (its value is the host's: e.g. a user's own model), not the trainer's."""
    return shared_parser(("trainer", host_defaults), lambda: _build_trainer_parser(host_defaults))


def _build_trainer_parser(host_defaults: bool) -> argparse.ArgumentParser:
    from mindspeed.flags.trainer_flags import build_parser  # cycle: trainer_flags imports this module
    parser = build_parser(prog="mindspeed")
    if not host_defaults:
        for action in parser._actions:
            if action.option_strings:
                action.default = argparse.SUPPRESS
    return add_mindspeed_args(parser)


# -- unknown flags ----------------------------------------------------------------------------
def unknown_options(extras) -> list[str]:
    """The option names among parse_known_args' leftovers (`--x=1` -> `--x`; values dropped)."""
    return [tok.split("=", 1)[0] for tok in extras if tok.startswith("-") and len(tok) > 1
            and not is_number(tok)]


def suggest(flag: str, known) -> str | None:
    close = difflib.get_close_matches(flag, list(known), n=1, cutoff=0.75)
    return close[0] if close else None


def unknown_flag_message(flags, known) -> str:
    """One line: each unknown flag with the closest known one."""
    parts = []
    for flag in flags:
        near = suggest(flag, known)
        parts.append(f"{flag} (did you mean {near}?)" if near else flag)
    return (f"unknown flag{'s' if len(parts) > 1 else ''} {', '.join(parts)}: not a Megatron or MindSpeed "
            "flag (`python -m mindspeed flags` lists MindSpeed's)")


def known_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for opt in parser._option_string_actions if opt.startswith("--")}


def refuse_unknown(parser: argparse.ArgumentParser, extras) -> None:
    """parse_known_args' leftovers of a whole command line are an error (with did-you-mean)."""
    if extras:
        bad = unknown_options(extras)
        raise ArgumentError(unknown_flag_message(bad, known_flags(parser)) if bad
                            else f"unexpected argument {' '.join(extras)}")


def resolve_backend_name(args) -> str:
    """--backend wins; --ai-framework is its alias; they must agree when both are given."""
    backend = args.backend
    framework = FRAMEWORK_ALIASES.get(args.ai_framework or "", None)
    if backend and framework and backend != framework:
        raise ValueError(f"--backend {backend} and --ai-framework {args.ai_framework} disagree")
    return backend or framework or os.environ.get("MINDSPEED_BACKEND") or "torch"


def parse_mindspeed_args(argv=None, namespace=None, unknown: str = "ignore") -> argparse.Namespace:
    """MindSpeed's flags from argv. unknown: "ignore" (the rest is the host's business), "error"
    (argv is a whole command line: anything unknown is refused; Megatron flags not given are left
    out, their values are the host's), "trainer" (as "error", and Megatron flags not given take the
    built-in trainers' defaults: `check` answers as the trainers' own gate does), or "typos" (a user's own
    script: only flags close to a known one are refused, as misspellings)."""
    if unknown in ("error", "trainer"):
        parser = trainer_parser(host_defaults=unknown == "trainer")
        if namespace is None and unknown == "error":
            namespace = mindspeed_parser().parse_args([])     # MindSpeed's own defaults
        args, extras = parser.parse_known_args(argv, namespace)
        refuse_unknown(parser, extras)
    else:
        args, extras = mindspeed_parser().parse_known_args(argv, namespace)
        if unknown == "typos":
            known = known_flags(trainer_parser())
            typos = [flag for flag in unknown_options(extras) if flag not in known and suggest(flag, known)]
            if typos:
                raise ArgumentError(unknown_flag_message(typos, known))
    args.backend = resolve_backend_name(args)
    fill_host_defaults(args)
    return args


def defaults() -> argparse.Namespace:
    """All MindSpeed flags at their defaults, and the host flags features read at the host's
    (programmatic use without a command line)."""
    return parse_mindspeed_args([])


def host_flag_defaults() -> dict:
    """Every host (Megatron) flag MindSpeed's features read -> the value its absence stands for:
    the feature's host-flag definition, else megatron_defaults.HOST_FLAG_DEFAULTS."""
    declared = {fl.dest: fl.default for f in all_features() for fl in f.flags if fl.host}
    return {**HOST_FLAG_DEFAULTS, **declared}


def fill_host_defaults(args) -> None:
    """Give `args` each host flag it lacks, at its default, so that features read attributes:
    `check`'s or a partial command line's namespace, a user's own Namespace, an older Megatron's."""
    for dest, value in host_flag_defaults().items():
        if dest not in ABSENT_UNTIL_GIVEN and not hasattr(args, dest):
            setattr(args, dest, value)
