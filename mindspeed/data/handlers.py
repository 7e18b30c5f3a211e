"""`--handler-name`: how one input record becomes token arrays (MindSpeed-LLM's handler names).

GeneralPretrainHandler: the text under each `--json-keys` key -> one document of dataset
`PREFIX_<key>_document`. The instruction handlers render a conversation with a chat template
(`--prompt-type`) and produce the three datasets MindSpeed-LLM's fine-tuning reads,
`PREFIX_packed_{input_ids,attention_mask,labels}_document`; `labels` holds -100 wherever the loss
must not look (prompts, system text, padding), the token id elsewhere.
R1AlpacaStyleInstructionHandler writes MindSpeed-RL's prompt datasets instead: the rendered prompt,
and one dataset per `--dataset-additional-keys` key (`labels`: the reference answer's tokens).
"""
from __future__ import annotations

import json
import re

import numpy as np

from mindspeed.data.errors import DataError
from mindspeed.data.templates import (ASSISTANT, FUNCTION, OBSERVATION, USER, function_call_text,
                                      get_template)

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
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise DataError(f"{origin}: field {column!r} must be a {names}, got {type(value).__name__}")
    return value


class GeneralPretrainHandler:
    instruction = False

    def __init__(self, tokenizer, json_keys, append_eod: bool):
        self.tokenizer, self.keys, self.append_eod = tokenizer, tuple(json_keys), append_eod
        self.token_keys = self.keys          # datasets of token ids (checked against the vocabulary)

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
    packable = True                      # --pack / --pad-to-multiple-of shape its samples
    keys = INSTRUCTION_KEYS
    token_keys = ("input_ids",)          # labels hold -100, attention_mask ones or sample numbers
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

    @staticmethod
    def too_long(sample: dict, seq_length: int) -> bool:
        return len(sample["input_ids"]) > seq_length

    def conversation(self, origin: str, record: dict) -> tuple[list, str | None, list | None]:
        """(messages, system prompt, tools) of one record."""
        raise NotImplementedError

    def _optional(self, origin, record, name, kind):
        column = self.columns.get(name)
        # a role mapped to "" is not used (MindSpeed-LLM's configs write "query": "")
        if not column or (column not in record and name not in self.explicit):
            return None
        return _field(origin, record, column, f"--map-keys {name}", kind)

    def encode(self, origin: str, record: dict) -> dict:
        messages, system, tools = self.conversation(origin, record)
        try:
            turns = self.template.encode_turns(self.tokenizer, messages, system, tools)
        except DataError as err:
            raise DataError(f"{origin}: {err}") from err
        ids, labels = [], []
        for prompt, reply in turns:
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

    def _reply(self, origin, record):
        return _field(origin, record, self.columns["response"], "--map-keys response")

    def conversation(self, origin, record):
        question = _field(origin, record, self.columns["prompt"], "--map-keys prompt")
        query = self._optional(origin, record, "query", str)
        reply = self._reply(origin, record)
        messages = []
        for pair in self._optional(origin, record, "history", list) or []:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise DataError(f"{origin}: each history entry must be a [question, reply] pair of strings")
            messages += [(USER, pair[0]), (ASSISTANT, pair[1])]
        messages += [(USER, "\n".join(t for t in (question, query) if t)), (ASSISTANT, reply)]
        return messages, self._optional(origin, record, "system", str), None


_KEY_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class R1AlpacaStyleInstructionHandler(AlpacaStyleInstructionHandler):
    """MindSpeed-RL's prompts for R1-style RL, from Alpaca columns: input_ids is the rendered prompt
    (earlier turns in full, then the question up to the assistant header), attention_mask ones, and
    one dataset per additional key K: `labels` the reference answer's tokens (what the reward
    compares with), any other K the tokens of the record's text column K. Nothing is masked; a
    record whose answer is null is left out (MindSpeed-RL drops it too) and counted."""
    packable = False

    def __init__(self, tokenizer, prompt_type, map_keys, append_eod, additional_keys=()):
        if append_eod:
            raise DataError("--append-eod: R1AlpacaStyleInstructionHandler writes prompts that the RL "
                            "trainer continues, with no end token: drop it")
        super().__init__(tokenizer, prompt_type, map_keys, append_eod)
        additional_keys = list(additional_keys or ())
        for key in additional_keys:
            if not _KEY_NAME.fullmatch(key) or key in INSTRUCTION_KEYS[:2] or additional_keys.count(key) > 1:
                raise DataError(f"--dataset-additional-keys {key!r}: each key names one more dataset "
                                "PREFIX_packed_<key>_document, so it must be a distinct column name (letters, "
                                "digits, _ . -) other than input_ids and attention_mask")
        self.additional = tuple(additional_keys)
        self.keys = INSTRUCTION_KEYS[:2] + self.additional
        self.token_keys = ("input_ids",) + self.additional

    @staticmethod
    def too_long(sample: dict, seq_length: int) -> bool:
        # MindSpeed-RL keeps a record only when every one of its arrays is shorter than seq_length
        return any(len(ids) >= seq_length for ids in sample.values())

    def _reply(self, origin, record):
        column = self.columns["response"]
        if not column or column not in record:
            return _field(origin, record, column, "--map-keys response")      # refuses: no such field
        value = record[column]
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if value is None or isinstance(value, str):
            return value
        raise DataError(f"{origin}: field {column!r} must be the answer text (a string, or a list of one), "
                        f"got {type(value).__name__}")

    def encode(self, origin: str, record: dict) -> dict | None:
        messages, system, _ = self.conversation(origin, record)
        answer = messages[-1][1]
        if answer is None:
            return None
        try:
            turns = self.template.encode_turns(self.tokenizer, messages, system, None)
        except DataError as err:
            raise DataError(f"{origin}: {err}") from err
        ids = [i for prompt, reply in turns[:-1] for i in prompt + reply] + turns[-1][0]
        ids = np.asarray(ids, dtype=np.int64)
        out = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        for key in self.additional:
            text = answer if key == "labels" else _field(origin, record, key, f"--dataset-additional-keys {key}")
            out[key] = np.asarray(self.tokenizer.encode(text), dtype=np.int64)
        return out


class SharegptStyleInstructionHandler(InstructionHandler):
    """A list of turns {from: ROLE, value: text}, optionally led by a system turn. Prompt turns
    (human, or observation: a tool's result) alternate with reply turns (gpt, or function_call: a
    JSON {"name", "arguments"} call, learned like a reply), as MindSpeed-LLM's ShareGPT reader has
    them; `tools` (a JSON list of {name, description, parameters}) is described after the system."""
    TAG_DEFAULTS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                    "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
    MAP_DEFAULTS = {"messages": "conversations", "system": None, "tools": "tools", "tags": None}

    def __init__(self, tokenizer, prompt_type, map_keys, append_eod):
        super().__init__(tokenizer, prompt_type, map_keys, append_eod)
        tags = map_keys.get("tags") or {}
        if not isinstance(tags, dict) or set(tags) - set(self.TAG_DEFAULTS):
            raise DataError(f"--map-keys tags must be an object with keys among {', '.join(self.TAG_DEFAULTS)}")
        self.tags = t = {**self.TAG_DEFAULTS, **tags}
        # turn i: a prompt role when i is even, a reply role when odd
        self.sides = ({t["user_tag"]: USER, t["observation_tag"]: OBSERVATION},
                      {t["assistant_tag"]: ASSISTANT, t["function_tag"]: FUNCTION})

    def _tools(self, origin, record):
        tools = self._optional(origin, record, "tools", (str, list))
        if isinstance(tools, str):
            try:
                tools = json.loads(tools) if tools.strip() else []
            except json.JSONDecodeError as err:
                raise DataError(f"{origin}: field {self.columns['tools']!r} is not valid JSON ({err.msg})") from err
        if tools is not None and not (isinstance(tools, list) and all(
                isinstance(x, dict) and isinstance(x.get("name"), str) for x in tools)):
            raise DataError(f"{origin}: field {self.columns['tools']!r} must be a list of tools "
                            "{\"name\": ..., \"description\": ..., \"parameters\": {...}}")
        return tools or None

    def _call_text(self, origin, i, content):
        try:
            call = json.loads(content)
            return function_call_text(call["name"], call["arguments"])
        except (json.JSONDecodeError, TypeError, KeyError) as err:
            raise DataError(f"{origin}: turn {i} ({self.tags['function_tag']}) must be JSON "
                            "{\"name\": ..., \"arguments\": {...}}") from err

    def conversation(self, origin, record):
        t = self.tags
        turns = _field(origin, record, self.columns["messages"], "--map-keys messages", list)
        system = self._optional(origin, record, "system", str)
        if turns and isinstance(turns[0], dict) and turns[0].get(t["role_tag"]) == t["system_tag"]:
            system, turns = turns[0].get(t["content_tag"]), turns[1:]
        known = {**self.sides[0], **self.sides[1]}
        messages = []
        for i, turn in enumerate(turns):
            role = turn.get(t["role_tag"]) if isinstance(turn, dict) else None
            if role not in known:
                raise DataError(f"{origin}: turn {i} has role {role!r}; the roles are {', '.join(known)} "
                                f"(and {t['system_tag']} first); name others with --map-keys tags")
            side = self.sides[i % 2]
            if role not in side or not isinstance(turn.get(t["content_tag"]), str):
                raise DataError(f"{origin}: turn {i} must be {{{t['role_tag']!r}: {' or '.join(map(repr, side))}, "
                                f"{t['content_tag']!r}: text}} (prompt turns {t['user_tag']}/{t['observation_tag']} "
                                f"alternate with reply turns {t['assistant_tag']}/{t['function_tag']})")
            content = turn[t["content_tag"]]
            messages.append((side[role], self._call_text(origin, i, content) if side[role] == FUNCTION else content))
        if not messages or len(messages) % 2:
            raise DataError(f"{origin}: a conversation needs prompt/reply pairs ({len(messages)} turns)")
        return messages, system, self._tools(origin, record)


HANDLERS = {cls.__name__: cls for cls in (GeneralPretrainHandler, AlpacaStyleInstructionHandler,
                                          SharegptStyleInstructionHandler, R1AlpacaStyleInstructionHandler)}


def build_handler(name: str, tokenizer, *, json_keys, prompt_type, map_keys, append_eod: bool,
                  additional_keys=None):
    if name not in HANDLERS:
        raise DataError(f"unknown --handler-name {name!r}; choose one of {', '.join(HANDLERS)}")
    if name == "R1AlpacaStyleInstructionHandler":
        return R1AlpacaStyleInstructionHandler(tokenizer, prompt_type, map_keys, append_eod, additional_keys)
    if additional_keys:
        raise DataError(f"--dataset-additional-keys applies to R1AlpacaStyleInstructionHandler, not {name}")
    if name == "GeneralPretrainHandler":
        if prompt_type is not None or map_keys:
            raise DataError("--prompt-type and --map-keys apply to the instruction handlers, "
                            "not GeneralPretrainHandler")
        return GeneralPretrainHandler(tokenizer, json_keys, append_eod)
    return HANDLERS[name](tokenizer, prompt_type, map_keys, append_eod)
