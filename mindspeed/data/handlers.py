"""`--handler-name`: how one input record becomes token arrays (MindSpeed-LLM's handler names).

GeneralPretrainHandler: the text under each `--json-keys` key -> one document of dataset
`PREFIX_<key>_document`. The instruction handlers render a conversation with a chat template
(`--prompt-type`) and produce the three datasets MindSpeed-LLM's fine-tuning reads,
`PREFIX_packed_{input_ids,attention_mask,labels}_document`; `labels` holds -100 wherever the loss
must not look (prompts, system text, padding), the token id elsewhere.
"""
from __future__ import annotations

import json

import numpy as np

from mindspeed.data.errors import DataError
from mindspeed.data.templates import ASSISTANT, USER, get_template

IGNORE_INDEX = -100
INSTRUCTION_KEYS = ("input_ids", "attention_mask", "labels")


def parse_map_keys(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"--map-keys is not valid JSON ({err.msg} at column {err.colno}): {text}") from err
    if not isinstance(value, dict):
        raise DataError(f"--map-keys must be a JSON object such as '{{\"prompt\":\"instruction\"}}', got {text}")
    return value


def _field(origin: str, record: dict, column: str, role: str, kind=str):
    if column not in record:
        raise DataError(f"{origin}: no {column!r} field (the {role}; map another column with --map-keys)")
    value = record[column]
    if not isinstance(value, kind):
        raise DataError(f"{origin}: field {column!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


class GeneralPretrainHandler:
    instruction = False

    def __init__(self, tokenizer, json_keys, append_eod: bool):
        self.tokenizer, self.keys, self.append_eod = tokenizer, tuple(json_keys), append_eod

    def output_prefixes(self, prefix: str) -> dict:
        return {key: f"{prefix}_{key}_document" for key in self.keys}

    def encode(self, origin: str, record: dict) -> dict:
        out = {}
        for key in self.keys:
            ids = self.tokenizer.encode(_field(origin, record, key, f"--json-keys {key} text"))
            out[key] = np.asarray(ids + [self.tokenizer.eod] if self.append_eod else ids, dtype=np.int64)
        return out


class InstructionHandler:
    """A conversation -> input_ids, attention_mask (ones) and labels (prompts at IGNORE_INDEX)."""
    instruction = True
    keys = INSTRUCTION_KEYS
    MAP_DEFAULTS: dict = {}

    def __init__(self, tokenizer, prompt_type: str | None, map_keys: dict, append_eod: bool):
        unknown = sorted(set(map_keys) - set(self.MAP_DEFAULTS))
        if unknown:
            raise DataError(f"--map-keys: {', '.join(map(repr, unknown))} is not a key of {type(self).__name__} "
                            f"(its keys: {', '.join(self.MAP_DEFAULTS)})")
        self.explicit = set(map_keys)            # columns the user named must exist in every record
        self.columns = {**self.MAP_DEFAULTS, **map_keys}
        self.template = get_template(prompt_type)
        self.template.check(tokenizer)
        self.tokenizer, self.append_eod = tokenizer, append_eod

    def output_prefixes(self, prefix: str) -> dict:
        return {key: f"{prefix}_packed_{key}_document" for key in self.keys}

    def conversation(self, origin: str, record: dict) -> tuple[list, str | None]:
        raise NotImplementedError

    def _optional(self, origin, record, name, kind):
        column = self.columns.get(name)
        if column is None or (column not in record and name not in self.explicit):
            return None
        return _field(origin, record, column, f"--map-keys {name}", kind)

    def encode(self, origin: str, record: dict) -> dict:
        messages, system = self.conversation(origin, record)
        ids, labels = [], []
        for prompt, reply in self.template.encode_turns(self.tokenizer, messages, system):
            ids += prompt + reply
            labels += [IGNORE_INDEX] * len(prompt) + reply
        if self.append_eod:
            ids.append(self.tokenizer.eod)
            labels.append(self.tokenizer.eod)
        ids = np.asarray(ids, dtype=np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": np.asarray(labels, dtype=np.int64)}


class AlpacaStyleInstructionHandler(InstructionHandler):
    """instruction (+ "\\n" + input) is the question, output the reply; history holds earlier
    [question, reply] pairs, system the system prompt."""
    MAP_DEFAULTS = {"prompt": "instruction", "query": "input", "response": "output", "system": None,
                    "history": None}

    def conversation(self, origin, record):
        question = _field(origin, record, self.columns["prompt"], "--map-keys prompt")
        query = self._optional(origin, record, "query", str)
        reply = _field(origin, record, self.columns["response"], "--map-keys response")
        messages = []
        for pair in self._optional(origin, record, "history", list) or []:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise DataError(f"{origin}: each history entry must be a [question, reply] pair of strings")
            messages += [(USER, pair[0]), (ASSISTANT, pair[1])]
        messages += [(USER, "\n".join(t for t in (question, query) if t)), (ASSISTANT, reply)]
        return messages, self._optional(origin, record, "system", str)


class SharegptStyleInstructionHandler(InstructionHandler):
    """A list of turns {from: human|gpt, value: text}, optionally led by a system turn."""
    TAG_DEFAULTS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                    "system_tag": "system"}
    MAP_DEFAULTS = {"messages": "conversations", "system": None, "tags": None}

    def __init__(self, tokenizer, prompt_type, map_keys, append_eod):
        super().__init__(tokenizer, prompt_type, map_keys, append_eod)
        tags = map_keys.get("tags") or {}
        if not isinstance(tags, dict) or set(tags) - set(self.TAG_DEFAULTS):
            raise DataError(f"--map-keys tags must be an object with keys among {', '.join(self.TAG_DEFAULTS)}")
        self.tags = {**self.TAG_DEFAULTS, **tags}

    def conversation(self, origin, record):
        t = self.tags
        turns = _field(origin, record, self.columns["messages"], "--map-keys messages", list)
        system = self._optional(origin, record, "system", str)
        if turns and isinstance(turns[0], dict) and turns[0].get(t["role_tag"]) == t["system_tag"]:
            system, turns = turns[0].get(t["content_tag"]), turns[1:]
        roles = {t["user_tag"]: USER, t["assistant_tag"]: ASSISTANT}
        messages = []
        for i, turn in enumerate(turns):
            want = (t["user_tag"], t["assistant_tag"])[i % 2]
            if not isinstance(turn, dict) or turn.get(t["role_tag"]) != want \
                    or not isinstance(turn.get(t["content_tag"]), str):
                raise DataError(f"{origin}: turn {i} must be {{{t['role_tag']!r}: {want!r}, "
                                f"{t['content_tag']!r}: text}} (turns alternate {t['user_tag']}/{t['assistant_tag']})")
            messages.append((roles[want], turn[t["content_tag"]]))
        if not messages or len(messages) % 2:
            raise DataError(f"{origin}: a conversation needs {t['user_tag']}/{t['assistant_tag']} pairs "
                            f"({len(messages)} turns)")
        return messages, system


HANDLERS = {cls.__name__: cls for cls in (GeneralPretrainHandler, AlpacaStyleInstructionHandler,
                                          SharegptStyleInstructionHandler)}


def build_handler(name: str, tokenizer, *, json_keys, prompt_type, map_keys, append_eod: bool):
    if name not in HANDLERS:
        raise DataError(f"unknown --handler-name {name!r}; choose one of {', '.join(HANDLERS)}")
    if name == "GeneralPretrainHandler":
        if prompt_type is not None or map_keys:
            raise DataError("--prompt-type and --map-keys apply to the instruction handlers, "
                            "not GeneralPretrainHandler")
        return GeneralPretrainHandler(tokenizer, json_keys, append_eod)
    return HANDLERS[name](tokenizer, prompt_type, map_keys, append_eod)
