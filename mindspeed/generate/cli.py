"""`python -m mindspeed.generate --load DIR --tokenizer-model TOK [--prompt TEXT]`: what a trained
or converted model says, with MindSpeed-LLM's inference flags. With --prompt one answer (streamed,
then the speed); without, an interactive loop (`--task chat` keeps the conversation). Launch with
`torchrun --nproc_per_node N` for tensor parallelism over N processes.

Every input that cannot work is refused in one line (exit 2) before the model is built."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch

import mindspeed
from mindspeed.adaptor_core import MindSpeedConfigError
from mindspeed.backends import BackendUnavailableError
from mindspeed.errors import ArgumentError, CheckpointError, InferenceError, OneLineParser, positive_int, report
from mindspeed.generate import lora_adapters, tokenizers
from mindspeed.generate.engine import Generation, Generator, Sampling
from mindspeed.generate.loading import load_model, quiet_frameworks, rank, start_processes, stop_processes, world_size
from mindspeed.generate.model_source import read_source
from mindspeed.training.model import DTYPES

USER_ERRORS = (ArgumentError, InferenceError, CheckpointError, MindSpeedConfigError, BackendUnavailableError)
QUIT = ("exit", "quit")


def build_parser(prog: str = "python -m mindspeed.generate") -> OneLineParser:
    p = OneLineParser(prog=prog, allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="a checkpoint directory of either trainer, or the converter's")
    p.add_argument("--tokenizer-model", required=True,
                   help="a Hugging Face tokenizer directory (or its tokenizer.json), or the PREFIX.tokenizer.json "
                        "of `python -m mindspeed.data`")
    p.add_argument("--prompt", default=None, help="generate once for this text (default: interactive)")
    p.add_argument("--task", default="greedy", choices=["greedy", "chat"],
                   help="greedy: the most likely token each step; chat: sampled with --top-k/--top-p/--temperature "
                        "(interactively, the conversation is kept)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--top-k", type=int, default=0, help="chat: sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=0.0, help="chat: nucleus sampling mass (0: off)")
    p.add_argument("--temperature", type=float, default=1.0, help="chat: logits divided by it")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed")
    p.add_argument("--seq-length", type=positive_int, default=None,
                   help="prompt plus new tokens at most (default: the run's --seq-length, or the converted "
                        "model's max_position_embeddings)")
    p.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    p.add_argument("--output-json", default=None, help='with --prompt: write {"prompt", "tokens", "text"} here')
    p.add_argument("--use-ema", action="store_true",
                   help="the checkpoint's EMA of the weights (--optimizer-selection fused_ema_adamw) instead of them")
    lora_adapters.add_flags(p)
    return p


def sampling_of(opts) -> Sampling:
    sampled = (opts.top_k != 0, opts.top_p != 0.0, opts.temperature != 1.0)
    if opts.task == "greedy":
        if any(sampled):
            raise ArgumentError("--top-k/--top-p/--temperature sample the next token: add --task chat "
                                "(--task greedy takes the most likely one)")
        return Sampling()
    if opts.top_k < 0 or not 0.0 <= opts.top_p <= 1.0 or not opts.temperature > 0:
        raise ArgumentError("--top-k must be >= 0, --top-p within [0, 1] and --temperature > 0")
    if opts.top_k > 0 and opts.top_p > 0:
        raise ArgumentError("--top-k and --top-p both filter the candidates: give one of them")
    return Sampling(greedy=False, top_k=opts.top_k, top_p=opts.top_p, temperature=opts.temperature)


@dataclass
class Session:
    generator: Generator
    tokenizer: object
    eod: int
    opts: object
    sampling: Sampling

    def answer(self, prompt_ids: list[int], stream) -> Generation:
        """Generate for prompt_ids, writing the text to `stream` (rank 0) as the tokens come."""
        shown = ""

        def show(tokens: list[int]) -> None:
            nonlocal shown
            text = self.text(tokens)
            if stream is not None and text.startswith(shown):
                stream.write(text[len(shown):])
                stream.flush()
                shown = text
        return self.generator.generate(prompt_ids, self.opts.max_new_tokens, self.sampling, stop=self.eod,
                                       on_token=show)

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.detokenize([t for t in tokens if t != self.eod])


def prepare(opts):
    """Everything checked before any process group: (model source, tokenizer, sampling, prompt ids)."""
    sampling = sampling_of(opts)
    if opts.output_json and opts.prompt is None:
        raise ArgumentError("--output-json writes one answer: give --prompt too")
    source = read_source(opts.load, world_size())
    args = source.args
    if opts.seq_length:
        args.seq_length = opts.seq_length
    args.max_position_embeddings = max(args.max_position_embeddings or 0, args.seq_length)
    tokenizer = tokenizers.load(opts.tokenizer_model)
    if tokenizer.vocab_size > source.vocab_size:
        raise InferenceError(f"--tokenizer-model {opts.tokenizer_model} has {tokenizer.vocab_size} tokens, the model "
                             f"of {opts.load} only {source.vocab_size}: not the tokenizer it was trained with")
    prompt_ids = None
    if opts.prompt is not None:
        prompt_ids = _prompt_ids(opts, tokenizer, [], args.seq_length)
    return source, tokenizer, sampling, prompt_ids


def _prompt_ids(opts, tokenizer, history: list[dict], seq_length: int) -> list[int]:
    text = tokenizers.chat_prompt(tokenizer, history, opts.prompt) if opts.task == "chat" else opts.prompt
    ids = tokenizers.encode(tokenizer, text)
    if not ids:
        raise InferenceError("the prompt is empty after tokenization: give some text")
    if len(ids) >= seq_length:
        raise InferenceError(f"the prompt is {len(ids)} tokens, the sequence length is {seq_length}: "
                             "shorten the prompt or give a larger --seq-length")
    return ids


def main(argv=None) -> int:
    try:
        opts = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        source, tokenizer, sampling, prompt_ids = prepare(opts)
        # the device shim only (Megatron-Core's own kernels), and the LoRA feature for --lora-load
        applied = mindspeed.adapt(["--optimization-level", "0", *lora_adapters.as_flags(lora_adapters.settings(opts))])
        args = source.args
        args.device_name = applied.device
        with quiet_frameworks():
            start_processes(args)
            try:
                model = load_model(args, opts.ckpt_step, applied.part("lora"), use_ema=opts.use_ema)[0]
                session = Session(_generator(args, model, source.vocab_size, opts.seed), tokenizer,
                                  tokenizer.eod, opts, sampling)
                if prompt_ids is not None:
                    _once(session, prompt_ids)
                else:
                    _interactive(session, args.seq_length)
            finally:
                stop_processes()
                applied.close()
    except USER_ERRORS as err:
        if rank() == 0:
            report(str(err))
        return 2
    return 0


def _generator(args, model, vocab_size: int, seed: int) -> Generator:
    return Generator(model, max_length=args.seq_length, vocab_size=vocab_size,
                     padded_vocab_size=args.padded_vocab_size, hidden_size=args.hidden_size,
                     params_dtype=DTYPES[args.params_dtype], device=args.device_name, seed=seed)


def _once(session: Session, prompt_ids: list[int]) -> None:
    out = sys.stdout if rank() == 0 else None
    result = session.answer(prompt_ids, out)
    if out:
        out.write("\n")
        _speed(result, session.generator.path)
        if session.opts.output_json:
            with open(session.opts.output_json, "w", encoding="utf-8") as f:
                json.dump({"prompt": session.opts.prompt, "tokens": result.tokens,
                           "text": session.text(result.tokens)}, f, ensure_ascii=False)


def _speed(result: Generation, path: str) -> None:
    print(f"> {len(result.tokens)} new tokens after a {result.prompt_tokens}-token prompt in {result.seconds:.2f}s: "
          f"{result.tokens_per_s:.1f} tokens/s ({path})", flush=True)


def _interactive(session: Session, seq_length: int) -> None:
    """Lines from stdin (read on rank 0, sent to the other ranks) until EOF or exit/quit."""
    history: list[dict] = []
    opts = session.opts
    while True:
        line = _read_line()
        if line is None or line.strip() in QUIT:
            return
        opts.prompt = line
        try:
            ids = _prompt_ids(opts, session.tokenizer, history, seq_length)
        except InferenceError as err:
            if rank() == 0:
                report(f"{err} (the conversation starts over)")
            history.clear()
            continue
        result = session.answer(ids, sys.stdout if rank() == 0 else None)
        if rank() == 0:
            print(flush=True)
            _speed(result, session.generator.path)
        if opts.task == "chat":
            history += [{"role": "user", "content": line},
                        {"role": "assistant", "content": session.text(result.tokens)}]


def _read_line() -> str | None:
    line = None
    if rank() == 0:
        sys.stdout.write(">>> ")
        sys.stdout.flush()
        raw = sys.stdin.readline()
        line = raw.rstrip("\n") if raw else None
    if world_size() > 1:
        box = [line]
        torch.distributed.broadcast_object_list(box, src=0)
        line = box[0]
    return line
