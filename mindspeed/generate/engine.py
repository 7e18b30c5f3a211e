"""Token generation on Megatron-Core's GPTModel with a KV cache (the prompt is encoded once, then
one token per step) and Megatron-Core's TextGenerationController sampling (greedy, top-k, top-p,
temperature). The steps run through mindspeed.generate.lean_decoder where it covers the model
(the same weights without Megatron's layer Python), else through Megatron-Core's
GPTInferenceWrapper and StaticInferenceContext. Without the cache (`use_cache=False`, for
comparison) every step recomputes the whole prefix, by the same path. On cpu the steps after the
first run without the device shim's torch-function mode when it has nothing to rewrite there
(mindspeed.backends.torch.mode_free_steps)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core import parallel_state
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController)

from mindspeed.backends.torch.mode_free_steps import ModeFreeSteps
from mindspeed.generate import lean_decoder


@dataclass(frozen=True)
class Sampling:
    greedy: bool = True
    top_k: int = 0
    top_p: float = 0.0
    temperature: float = 1.0

    def params(self) -> SamplingParams:
        if self.greedy:
            return SamplingParams(top_k=1)
        return SamplingParams(top_k=self.top_k, top_p=self.top_p, temperature=self.temperature)


@dataclass
class Generation:
    tokens: list[int]          # the new tokens (the end-of-document token, if one ended it, included)
    prompt_tokens: int
    seconds: float             # prefill and decoding

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


class Generator:
    """Generates from one model (TP-sharded over the launch's processes), one sequence at a time."""

    def __init__(self, model, *, max_length: int, vocab_size: int, padded_vocab_size: int, hidden_size: int,
                 params_dtype: torch.dtype, device: str, seed: int = 1234, use_cache: bool = True,
                 lean: bool = True):
        self.model, self.max_length, self.vocab_size, self.device = model, max_length, vocab_size, device
        self.use_cache = use_cache
        self.lean, why_not = None, "not asked for" if not lean else lean_decoder.unsupported(model)
        if why_not is None:
            self.lean = lean_decoder.LeanDecoder(model, max_length, parallel_state.get_tensor_model_parallel_group(),
                                                 parallel_state.get_tensor_model_parallel_world_size())
        self.path = "the lean decoder" if why_not is None else f"Megatron-Core's inference path (lean decoder: {why_not})"
        self.context = StaticInferenceContext(max_batch_size=1, max_sequence_length=max_length)
        config = InferenceWrapperConfig(hidden_size=hidden_size, params_dtype=params_dtype,
                                        inference_batch_times_seqlen_threshold=-1,
                                        padded_vocab_size=padded_vocab_size, inference_max_requests=1,
                                        inference_max_seq_length=max_length)
        self.wrapper = GPTInferenceWrapper(model, config, self.context)
        self.sampler = TextGenerationController(self.wrapper, tokenizer=None)
        self.sampler.sampling_rng.manual_seed(seed)
        model.eval()

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling, stop: int | None = None,
                 on_token: Callable[[list[int]], None] | None = None) -> Generation:
        """Up to max_new_tokens after `prompt` (fewer at `stop` or at max_length); on_token(new
        tokens so far) after each one."""
        budget = min(max_new_tokens, self.max_length - len(prompt))
        buffer = torch.zeros(1, self.max_length, dtype=torch.long, device=self.device)
        buffer[0, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        params, out = sampling.params(), []
        start = time.perf_counter()
        with torch.inference_mode():
            if self.lean is not None:
                step = self._lean_steps(buffer, len(prompt))
            else:
                step = self._cached_steps(buffer, len(prompt)) if self.use_cache else self._recomputed_steps(buffer)
            later_step = ModeFreeSteps(self.device)      # the prefill is a step of its own kind
            length = len(prompt)
            for _ in range(budget):
                logits = step(length) if length == len(prompt) else later_step(step, length)
                token = self._pick(logits, params)
                out.append(token)
                buffer[0, length] = token
                length += 1
                if on_token is not None:
                    on_token(out)
                if token == stop:
                    break
        return Generation(tokens=out, prompt_tokens=len(prompt), seconds=time.perf_counter() - start)

    def _lean_steps(self, buffer: torch.Tensor, prompt_length: int):
        self.lean.reset()

        def step(length: int) -> torch.Tensor:
            first = 0 if length == prompt_length or not self.use_cache else length - 1
            return self.lean.logits(buffer[:, first:length], first, cache=self.use_cache)
        return step

    def _cached_steps(self, buffer: torch.Tensor, prompt_length: int):
        self.wrapper.prep_model_for_inference()        # eval mode, an empty cache
        inputs = self.wrapper.prep_inference_input(buffer)

        def step(length: int) -> torch.Tensor:
            first = 0 if length == prompt_length else length - 1
            window = self.wrapper.get_batch_for_context_window(inputs, first, length)
            logits = self.wrapper.run_one_forward_step(window)
            if length == prompt_length:
                self.context.enable_decode_mode()
            return logits[:, -1]
        return step

    def _recomputed_steps(self, buffer: torch.Tensor):
        # Megatron's own causal mask (True above the diagonal), built once: its default one is
        # made on 'cuda' for every new length
        causal = torch.ones(self.max_length, self.max_length, dtype=torch.bool, device=self.device).triu(1)

        def step(length: int) -> torch.Tensor:
            tokens = buffer[:, :length]
            positions = torch.arange(length, device=self.device).unsqueeze(0)
            mask = causal[:length, :length].view(1, 1, length, length)
            return self.model(tokens, positions, mask, runtime_gather_output=True)[:, -1]
        return step

    def _pick(self, logits: torch.Tensor, params: SamplingParams) -> int:
        """The next token from the last position's logits (padding rows left out); every TP rank
        takes rank 0's, so sampled sequences agree across ranks."""
        logits = logits[:, :self.vocab_size].float()
        token = self.sampler.sample_from_logits(logits, params, vocab_size=self.vocab_size).view(1).long()
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            torch.distributed.broadcast(token, parallel_state.get_tensor_model_parallel_src_rank(),
                                        group=parallel_state.get_tensor_model_parallel_group())
        return int(token.item())
