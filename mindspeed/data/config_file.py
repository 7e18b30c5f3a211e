"""`--config FILE.yaml`: the flags of `python -m mindspeed.data` as a YAML mapping, the way
MindSpeed-RL's data configs (configs/datasets/NAME.yaml) write them.

Each key is a flag's name with underscores (`output_prefix: data/orz` is `--output-prefix
data/orz`); a value has the flag's type: text, an integer, true/false for a switch, a list or one
text for a flag that takes several (`input`, `json_keys`, `dataset_additional_keys`), a mapping (or
its JSON text) for `map_keys`. The values become the parser's defaults, so a flag also typed on the
command line wins. A file that is not YAML, not a mapping, or has an unknown key or a value of the
wrong type is refused in one line naming the file and the key.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os

from mindspeed.errors import ArgumentError, one_line

CONFIG_DIR = os.path.join("configs", "datasets")     # where MindSpeed-RL keeps them: --config NAME
# not keys: the file itself and --help; --no-append-eod is written `append_eod: false`
NOT_KEYS = ("config", "help")


def config_path(name: str) -> str:
    """FILE, or NAME for configs/datasets/NAME.yaml under the current directory."""
    if os.path.isfile(name):
        return name
    named = os.path.join(CONFIG_DIR, name + ".yaml")
    if os.sep not in name and not name.endswith((".yaml", ".yml")) and os.path.isfile(named):
        return named
    raise ArgumentError(f"--config {name}: no such file (give a YAML file, or NAME for {named})")


def read_mapping(path: str) -> dict:
    """The YAML mapping in `path`, or ArgumentError in one line."""
    try:
        import yaml    # third-party and optional (the "data" extra): char-level mode runs without it
    except ImportError as err:
        raise ArgumentError(f"--config {path}: reading YAML needs PyYAML (pip install -e \".[data]\")") from err
    try:
        with open(path, encoding="utf-8") as f:
            value = yaml.safe_load(f)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ArgumentError(f"--config {path} is not valid YAML ({one_line(problem, 200)}{where})") from err
    except (OSError, UnicodeDecodeError) as err:
        raise ArgumentError(f"--config {path} cannot be read ({one_line(err, 200)})") from err
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ArgumentError(f"--config {path} must be a mapping of flag names to values "
                            f"(such as `input: data.jsonl`), not a {_kind(value)}")
    return value


def _kind(value) -> str:
    return {bool: "true/false", int: "number", float: "number", str: "text", list: "list",
            dict: "mapping"}.get(type(value), type(value).__name__)


def _actions(parser: argparse.ArgumentParser) -> dict:
    """The flag each key names: its dest, for the actions that have a long option."""
    return {action.dest: action for action in parser._actions
            if action.option_strings and action.dest not in NOT_KEYS
            and not isinstance(action, argparse._StoreFalseAction)}


def _scalar_text(value) -> str | None:
    """A YAML scalar as a flag's text (numbers too: `input: 2024` is a name), else None."""
    if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
        return None
    return str(value)


def _convert(path: str, key: str, action: argparse.Action, value):
    def wrong(expected: str):
        return ArgumentError(f"--config {path}: {key} must be {expected}, got {_kind(value)} {value!r}")

    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if key == "map_keys":
        if isinstance(value, dict):
            return json.dumps(value)
        if isinstance(value, str):
            return value
        raise wrong("a mapping such as {\"prompt\": \"problem\"}")
    if action.nargs == "+":
        items = value if isinstance(value, list) else [value]
        texts = [_scalar_text(item) for item in items]
        if not items or None in texts:
            raise wrong("a list of texts (or one text)")
        return texts
    if action.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
        return value
    text = _scalar_text(value)
    if text is None:
        raise wrong("a text")
    if action.choices is not None and text not in action.choices:
        raise ArgumentError(f"--config {path}: {key} must be one of {', '.join(action.choices)}, got {text!r}")
    return text


def config_defaults(parser: argparse.ArgumentParser, path: str) -> dict:
    """{dest: value} from the YAML file at `path`, checked against the parser's flags."""
    path = config_path(path)
    mapping = read_mapping(path)
    actions = _actions(parser)
    values = {}
    for key, value in mapping.items():
        if not isinstance(key, str) or key not in actions:
            near = difflib.get_close_matches(str(key), list(actions), n=1, cutoff=0.75)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ArgumentError(f"--config {path}: unknown key {key!r}{hint}; the keys are the flags of "
                                "`python -m mindspeed.data --help` with underscores")
        if value is None:                # `seq_length:` with no value: the flag's own default
            continue
        values[key] = _convert(path, key, actions[key], value)
    return values
