"""Chat templates (`--prompt-type`): a conversation -> (prompt ids, reply ids) per turn.

The named templates render turns the way MindSpeed-LLM's (LLaMA-Factory's) templates of the same
name do: turn 0 is prefix + system + user, later user turns start with the separator, a reply ends
with the end-of-sequence token (or the template's own stop token, e.g. <|im_end|> for qwen/chatml).
Each piece is tokenized on its own, so prompt and reply ids never share a token and the prompt can
be masked from the loss exactly. `--prompt-type tokenizer` renders with the tokenizer's own
`chat_template` (Jinja, via `apply_chat_template`) and splits it at the turn boundaries.

Tool use (MindSpeed-LLM's ShareGPT roles): a prompt turn may be a tool result (`observation`,
rendered in the template's tool format, else as a user turn) and a reply turn a function call
(`function`: "Action: NAME\nAction Input: ARGS" ended like a reply, so it is learned); a `tools`
list is described after the system prompt (`tools_text`, MindSpeed's wording of upstream's default
tool prompt).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from mindspeed.data.errors import DataError

BOS, EOS = "<bos>", "<eos>"      # markers in a format: the tokenizer's (or the template's) special ids
USER, ASSISTANT, SYSTEM = "user", "assistant", "system"
OBSERVATION, FUNCTION = "observation", "function"      # a tool's result (prompt side), a call (reply side)
Messages = Sequence[tuple[str, str]]        # (role, content): user/observation and assistant/function alternating


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    user: tuple
    assistant: tuple = ("{content}", EOS)
    system: tuple = ("{content}",)
    prefix: tuple = ()
    separator: tuple = ()
    default_system: str = ""
    stop_token: str | None = None       # ends replies instead of the tokenizer's eos
    system_in_user: bool = False        # llama2: the system block goes inside the first [INST]
    observation: tuple | None = None    # a tool result turn; None: rendered as a user turn
    function: tuple = ("{content}", EOS)   # a function call turn (its text from function_call_text)

    def check(self, tokenizer) -> None:
        if self.stop_token is not None and tokenizer.token_id(self.stop_token) is None:
            raise DataError(f"--prompt-type {self.name} ends replies with {self.stop_token}, which the "
                            f"tokenizer {tokenizer.name!r} does not have as one token")
        if EOS in self.assistant and self.stop_token is None and tokenizer.eos_id is None:
            raise DataError(f"--prompt-type {self.name} ends replies with the eos token; "
                            f"tokenizer {tokenizer.name!r} has none")

    def _ids(self, tokenizer, parts, content: str = "") -> list[int]:
        ids: list[int] = []
        for part in parts:
            if part == BOS:
                ids += [] if tokenizer.bos_id is None else [tokenizer.bos_id]
            elif part == EOS:
                ids.append(tokenizer.token_id(self.stop_token) if self.stop_token else tokenizer.eos_id)
            else:
                text = part.replace("{content}", content)   # not str.format: content may hold braces
                ids += tokenizer.encode(text) if text else []
        return ids

    def encode_turns(self, tokenizer, messages: Messages, system: str | None,
                     tools: list | None = None) -> list[tuple[list, list]]:
        system = (system or self.default_system) + (tools_text(tools) if tools else "")
        pairs = []
        for turn in range(0, len(messages), 2):
            (asker, question), (replier, answer) = messages[turn], messages[turn + 1]
            prompt = []
            if turn == 0:
                prompt += self._ids(tokenizer, self.prefix)
                if system and self.system_in_user:
                    question = "".join(p.replace("{content}", system) for p in self.system) + question
                elif system:
                    prompt += self._ids(tokenizer, self.system, system)
            else:
                prompt += self._ids(tokenizer, self.separator)
            ask = self.observation if asker == OBSERVATION and self.observation else self.user
            prompt += self._ids(tokenizer, ask, question)
            pairs.append((prompt, self._ids(tokenizer, self.function if replier == FUNCTION else self.assistant,
                                            answer)))
        return pairs


def function_call_text(name: str, arguments) -> str:
    """A function call turn's text (upstream's default function format)."""
    return f"Action: {name}\nAction Input: {json.dumps(arguments, ensure_ascii=False)}"


def tools_text(tools: list) -> str:
    """The tool descriptions appended to the system prompt, with how to call one."""
    lines = ["", "Tools you may call:"]
    for tool in tools:
        lines.append(f"- {tool['name']}: {tool.get('description', '')}")
        parameters = tool.get("parameters") or {}
        required = set(parameters.get("required", []))
        for name, spec in (parameters.get("properties") or {}).items():
            need = ", required" if name in required else ""
            lines.append(f"  {name} ({spec.get('type', '')}{need}): {spec.get('description', '')}")
    names = ", ".join(tool["name"] for tool in tools)
    lines += ["To call a tool, answer with", f"Action: the tool name (one of {names})",
              "Action Input: its arguments as a JSON object", ""]
    return "\n".join(lines)


_IM = "<|im_start|>{role}\n{content}<|im_end|>\n"
_IM_USER = _IM.replace("{role}", "user") + "<|im_start|>assistant\n"
_IM_TOOL = _IM.replace("{role}", "tool") + "<|im_start|>assistant\n"
_LLAMA3_HEADER = "<|start_header_id|>{role}<|end_header_id|>\n\n"
# qwen_r1 (MindSpeed-RL's template for R1-style RL): qwen with this instruction leading every user turn
R1_INSTRUCTION = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
                  "The assistant first thinks about the reasoning process in the mind and then provides the user "
                  "with the answer. The reasoning process and answer are enclosed within <think> </think> and "
                  "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think>"
                  "<answer> answer here </answer>. Put your final answer within \\boxed{}.\n")

TEMPLATES = {t.name: t for t in (
    ChatTemplate("empty", user=("{content}",), assistant=("{content}",)),
    ChatTemplate("default", user=("Human: {content}\nAssistant:",), system=("{content}\n",), separator=("\n",)),
    ChatTemplate("alpaca", user=("### Instruction:\n{content}\n\n### Response:\n",), separator=("\n\n",),
                 default_system="Below is an instruction that describes a task. "
                                "Write a response that appropriately completes the request.\n\n"),
    ChatTemplate("llama2", user=(BOS, "[INST] {content} [/INST]"), system=("<<SYS>>\n{content}\n<</SYS>>\n\n",),
                 system_in_user=True),
    ChatTemplate("llama3", prefix=(BOS,),
                 user=(_LLAMA3_HEADER.replace("{role}", "user") + "{content}<|eot_id|>"
                       + _LLAMA3_HEADER.replace("{role}", "assistant"),),
                 system=(_LLAMA3_HEADER.replace("{role}", "system") + "{content}<|eot_id|>",),
                 observation=(_LLAMA3_HEADER.replace("{role}", "tool") + "{content}<|eot_id|>"
                              + _LLAMA3_HEADER.replace("{role}", "assistant"),),
                 stop_token="<|eot_id|>"),
    ChatTemplate("chatml", user=(_IM_USER,), system=(_IM.replace("{role}", "system"),), separator=("\n",),
                 observation=(_IM_TOOL,), stop_token="<|im_end|>"),
    ChatTemplate("qwen", user=(_IM_USER,), system=(_IM.replace("{role}", "system"),), separator=("\n",),
                 observation=(_IM_TOOL,), default_system="You are a helpful assistant.", stop_token="<|im_end|>"),
    ChatTemplate("qwen_r1", user=(_IM_USER.replace("{content}", R1_INSTRUCTION + "{content}"),),
                 system=(_IM.replace("{role}", "system"),), separator=("\n",), observation=(_IM_TOOL,),
                 default_system="You are a helpful assistant.", stop_token="<|im_end|>"),
)}
ALIASES = {"none": "empty"}
TOKENIZER_TEMPLATE = "tokenizer"
PROMPT_TYPES = sorted(TEMPLATES) + sorted(ALIASES) + [TOKENIZER_TEMPLATE]


class TokenizerChatTemplate:
    """The tokenizer's own chat_template, cut into prompt / reply text at each assistant turn."""

    name = TOKENIZER_TEMPLATE

    def check(self, tokenizer) -> None:
        if not tokenizer.has_chat_template():
            raise DataError(f"--prompt-type tokenizer: tokenizer {tokenizer.name!r} has no chat_template; "
                            f"choose one of {', '.join(sorted(TEMPLATES))}")

    def encode_turns(self, tokenizer, messages: Messages, system: str | None,
                     tools: list | None = None) -> list[tuple[list, list]]:
        if tools or any(role in (OBSERVATION, FUNCTION) for role, _ in messages):
            raise DataError("--prompt-type tokenizer: tool turns and tools need a named --prompt-type "
                            f"(one of {', '.join(sorted(TEMPLATES))}) that renders them")
        conversation = [{"role": SYSTEM, "content": system}] if system else []
        done, pairs = "", []
        for turn in range(0, len(messages), 2):
            conversation.append({"role": USER, "content": messages[turn][1]})
            asked = tokenizer.render_chat(conversation, add_generation_prompt=True)
            conversation.append({"role": ASSISTANT, "content": messages[turn + 1][1]})
            answered = tokenizer.render_chat(conversation, add_generation_prompt=False)
            if not (asked.startswith(done) and answered.startswith(asked)):
                raise DataError(f"--prompt-type tokenizer: the chat_template of {tokenizer.name!r} does not "
                                "render a conversation as a prefix of its continuation, so prompt and reply "
                                "cannot be told apart; choose a named --prompt-type")
            pairs.append((tokenizer.encode(asked[len(done):]), tokenizer.encode(answered[len(asked):])))
            done = answered
        return pairs


def get_template(name: str | None):
    if name is None:
        raise DataError(f"instruction handlers need --prompt-type (one of {', '.join(PROMPT_TYPES)})")
    name = ALIASES.get(name, name)
    if name == TOKENIZER_TEMPLATE:
        return TokenizerChatTemplate()
    if name not in TEMPLATES:
        raise DataError(f"unknown --prompt-type {name!r}; choose one of {', '.join(PROMPT_TYPES)}")
    return TEMPLATES[name]
