"""The `wallbreaker` command. Every engine option of `LLM(...)` is a flag of the verbs that run the engine."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Callable

from .errors import WallbreakerError

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    def register(fn):
        COMMANDS[name] = fn
        return fn
    return register


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    from .config import EngineConfig
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "model":
            p.add_argument("--model", "-m", default=None,
                           help="a .gguf file, a Hugging Face folder, or a packaged model name (default: smollm2)")
        elif f.type in ("bool", bool):
            p.add_argument(flag, default=f.default, action=argparse.BooleanOptionalAction)
        else:
            kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
            p.add_argument(flag, type=kind, default=f.default, help=f"(default: {f.default})")


def engine_options(args: argparse.Namespace) -> dict:
    from .config import EngineConfig
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "model"}


def add_sampling_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def sampling_params(args: argparse.Namespace):
    from .sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=args.stop)


def load_llm(args: argparse.Namespace):
    from .llm import LLM
    return LLM(args.model, **engine_options(args))


@command("generate")
def cmd_generate(args: argparse.Namespace) -> int:
    llm = load_llm(args)
    params = sampling_params(args)
    outputs = llm.generate(args.prompts, params)
    for out in outputs:
        completion = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": completion.text, "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason, "metrics": out.metrics}))
        else:
            print(out.prompt + completion.text)
            m = out.metrics
            print(f"[{m['num_prompt_tokens']} prompt tokens, {m['num_generated_tokens']} generated; "
                  f"TTFT {m.get('ttft_s', 0) * 1000:.0f} ms, decode {m.get('decode_tokens_per_s', 0):.1f} tokens/s; "
                  f"model loaded in {llm.load_time_s:.1f} s]", file=sys.stderr)
    return 0


@command("chat")
def cmd_chat(args: argparse.Namespace) -> int:
    llm = load_llm(args)
    params = sampling_params(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        try:
            user = input("> " if interactive else "")
        except EOFError:
            return 0
        if not user.strip():
            continue
        if user.strip() in ("/exit", "/quit"):
            return 0
        messages.append({"role": "user", "content": user})
        reply, m = [], {}
        for delta in llm.stream_chat(messages, params):
            print(delta.text, end="", flush=True)
            reply.append(delta.text)
            if delta.output is not None:
                m = delta.output.metrics
        print()
        print(f"[{m['num_generated_tokens']} tokens, {m.get('decode_tokens_per_s', 0):.1f} tokens/s]",
              file=sys.stderr)
        messages.append({"role": "assistant", "content": "".join(reply)})


@command("serve")
def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .server.app import build_app
        from .server.run import serve
    except ImportError as e:
        raise WallbreakerError(f"the server needs its extra ({e.name} is missing); install with: "
                               "pip install 'wallbreaker[server]'") from e
    from .server.config import API_KEY_ENV, ServerConfig
    config = ServerConfig(
        host=args.host, port=args.port, served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None, protect_metrics=args.protect_metrics,
        max_queue=args.max_queue, request_timeout=args.request_timeout or None,
        max_request_bytes=args.max_request_bytes, max_connections=args.max_connections,
        header_timeout=args.header_timeout,
        allowed_hosts=tuple(args.allowed_hosts.split(",")) if args.allowed_hosts else None)
    llm = load_llm(args)
    serve(build_app(llm, config), log_level=args.log_level)
    return 0


@command("inspect")
def cmd_inspect(args: argparse.Namespace) -> int:
    from .measure.inspect_model import describe
    print(describe(args.model_path, json_output=args.json))
    return 0


@command("roofline")
def cmd_roofline(args: argparse.Namespace) -> int:
    from .measure.roofline_report import run
    return run(args)


@command("bench")
def cmd_bench(args: argparse.Namespace) -> int:
    from .measure.bench import run
    return run(args)


@command("perplexity")
def cmd_perplexity(args: argparse.Namespace) -> int:
    from .measure.perplexity import perplexity
    try:
        text = open(args.file, encoding="utf-8").read()
    except OSError as e:
        raise WallbreakerError(f"cannot read {args.file}: {e.strerror}") from None
    llm = load_llm(args)
    result = perplexity(llm, text, ctx=args.ctx, chunks=args.chunks, score=args.score)
    print(f"[{result.windows} windows of {result.ctx} tokens, {result.tokens_scored} tokens scored "
          f"({result.score}), mean NLL {result.nll:.5f}]", file=sys.stderr)
    print(result.line())
    return 0


@command("quantize")
def cmd_quantize(args: argparse.Namespace) -> int:
    from .quant.pipeline import QuantizeConfig
    from .quant.run import is_gguf_path, quantize_to
    gguf_out = is_gguf_path(args.out)
    cfg = QuantizeConfig(
        method=args.method, bits=args.bits,
        group_size=args.group_size or (32 if gguf_out else QuantizeConfig.group_size),
        sym=args.sym if args.sym is not None else (gguf_out and args.bits == 8), act_order=args.act_order,
        nsamples=args.nsamples, seqlen=args.seqlen, seed=args.seed, calib=args.calib, damp=args.damp,
        true_sequential=args.true_sequential,
        awq_grid=args.awq_grid, awq_clip=args.awq_clip, mixed_quantizer=args.mixed_quantizer,
        sensitivity_samples=args.sensitivity_samples)
    qm = quantize_to(args.model, args.out, cfg)
    print(f"[{cfg.method}: {len(qm.quantized)} tensors, {qm.average_bits:.3f} bits per weight on average, "
          f"groups of {cfg.group_size}, {'symmetric' if cfg.sym else 'asymmetric'}]", file=sys.stderr)
    print(args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wallbreaker", description="LLM inference at the memory wall.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete prompts")
    add_engine_flags(p)
    add_sampling_flags(p, max_tokens=64)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument("prompts", nargs="+")

    p = sub.add_parser("chat", help="interactive chat, tokens streamed as they come")
    add_engine_flags(p)
    add_sampling_flags(p, max_tokens=512)
    p.add_argument("--system", default=None, help="a system message")

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $WALLBREAKER_API_KEY, "
                        "which keeps the key out of `ps`)")
    p.add_argument("--protect-metrics", action="store_true", help="require the API key on /health and /metrics too")
    p.add_argument("--served-model-name", default=None, help="(default: the model file's stem; 'default' also works)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="sequences that may wait beyond --max-num-seqs before requests get 429 (default: 1024)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before a request is aborted (408); 0 = never (default: 600)")
    p.add_argument("--max-request-bytes", type=int, default=16 * 2**20,
                   help="larger request bodies get 413 (default: 16 MiB)")
    p.add_argument("--max-connections", type=int, default=256,
                   help="concurrent connections beyond which new ones get 503 (default: 256)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers (default: 10)")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names to answer ('*': any; default: loopback names when bound "
                        "to loopback, any when bound to 0.0.0.0)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    p = sub.add_parser("perplexity", help="perplexity over a text file (llama-perplexity's windows and scoring)")
    add_engine_flags(p)
    p.add_argument("--file", required=True, help="a UTF-8 text file")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (default: 512)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many windows (default: all)")
    p.add_argument("--score", choices=["half", "all"], default="half",
                   help="half: the second half of each window, as llama-perplexity (default); all: every token")

    from .quant.pipeline import METHODS, QuantizeConfig
    q = {f.name: f.default for f in dataclasses.fields(QuantizeConfig)}
    p = sub.add_parser("quantize", help="quantize a model and write it out (GGUF or folder)")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--bits", type=float, required=True, help="2..8; for mixed, the target average (e.g. 3.5)")
    p.add_argument("--group-size", type=int, default=None,
                   help=f"(default: {q['group_size']}; 32 for a .gguf output)")
    p.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None,
                   help="symmetric grid (default: asymmetric, except --bits 8 to GGUF: Q8_0)")
    p.add_argument("--act-order", action="store_true", help="GPTQ: columns in order of decreasing activation")
    p.add_argument("--calib", default=None, help="calibration text (default: WikiText-2 valid.txt)")
    p.add_argument("--nsamples", type=int, default=q["nsamples"],
                   help=f"calibration sequences (default: {q['nsamples']})")
    p.add_argument("--seqlen", type=int, default=q["seqlen"],
                   help=f"tokens per calibration sequence (default: {q['seqlen']})")
    p.add_argument("--seed", type=int, default=q["seed"])
    p.add_argument("--damp", type=float, default=q["damp"], help="GPTQ damping, fraction of the mean diagonal")
    p.add_argument("--true-sequential", action=argparse.BooleanOptionalAction, default=q["true_sequential"],
                   help="GPTQ: capture each Linear's inputs after the ones before it are quantized "
                        f"(default: {'on' if q['true_sequential'] else 'off'})")
    p.add_argument("--awq-grid", type=int, default=q["awq_grid"],
                   help=f"AWQ: alpha in {{0, 1/n, ..., 1}} (default: {q['awq_grid']})")
    p.add_argument("--awq-clip", action=argparse.BooleanOptionalAction, default=q["awq_clip"],
                   help="AWQ: also clip each group's range to its best on calibration error "
                        f"(default: {'on' if q['awq_clip'] else 'off'})")
    p.add_argument("--mixed-quantizer", choices=["gptq", "rtn"], default=q["mixed_quantizer"],
                   help=f"mixed: how each tensor is rounded at its width (default: {q['mixed_quantizer']})")
    p.add_argument("--sensitivity-samples", type=int, default=q["sensitivity_samples"],
                   help=f"mixed: sequences for sensitivities (default: {q['sensitivity_samples']})")
    p.add_argument("model", help="a .gguf file, a Hugging Face folder, or a packaged model name")
    p.add_argument("out", help="OUT.gguf (Q4_0, Q4_1, Q8_0) or a folder")

    from .measure.bench import add_arguments as add_bench_arguments
    from .measure.roofline_report import add_arguments as add_roofline_arguments
    p = sub.add_parser("bench", help="latency and throughput beside llama.cpp and transformers; JSON and a plot")
    add_engine_flags(p)
    add_bench_arguments(p)

    p = sub.add_parser("roofline", help="measured bandwidth, the decode tokens/s it allows, and what the engine reaches")
    add_engine_flags(p)
    add_roofline_arguments(p)

    p = sub.add_parser("inspect", help="architecture, tensors, formats, bytes per token")
    p.add_argument("model_path", nargs="?", default=None)
    p.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except WallbreakerError as e:
        print(f"wallbreaker: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
