"""The `wallbreaker` command. Every engine option of `LLM(...)` is a flag of the verbs that run the engine."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import types
import typing
from typing import Callable

from .errors import WallbreakerError

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    def register(fn):
        COMMANDS[name] = fn
        return fn
    return register


# What a flag does, where its field's name and default do not say it all.
HELP = {
    "model": "a .gguf file, a Hugging Face folder, or a packaged model name (default: smollm2)",
    "mmproj": "llama.cpp's vision projector GGUF for a GGUF text model (Gemma 3, SmolVLM, Qwen2.5-VL, "
              "Qwen3-VL), as llama-server's --mmproj "
              "(default: an mmproj*.gguf beside the model, if there is exactly one)",
    "dtype": "float32: the exact reference path; auto: packed weights through our kernels (a pooling model: "
             "its checkpoint's precision); packed: our kernels for every model, float weights Q8_0 at load",
    "num_threads": "torch threads (default: prefill on torch's count, decode on the count measured fastest now; "
                   "under tensor parallelism, the cores per rank)",
    "kv_cache_memory_gb": "the KV pool, GiB (default: half the free memory after the weights and 1 GB, at most 4, "
                          "no more than needed)",
    "kv_cache_disk_dir": "the prefix cache's disk tier and saved sessions (default: ~/.cache/wallbreaker/kv)",
    "kv_cache_disk_gb": "GiB of KV blocks kept on disk across restarts, least recently used evicted "
                        "(default: 0, off)",
    "kv_cache_sessions_gb": "GiB the saved sessions may take on disk; a save past it is refused (default: 8; "
                            "0: saving off)",
    "max_model_len": "tokens a sequence may reach (default: the model's context, capped at what the pool holds)",
    "speculative_method": "ngram (prompt lookup) or draft (--speculative-model)",
    "num_speculative_tokens": "drafts a step at most (K)",
    "speculative_adaptive": "choose K each step from measured costs (--no-speculative-adaptive: always K)",
    "tensor_parallel_size": "ranks to split the model across",
    "batch_invariant": "every token's logits independent of the rest of its step: the same request gives the "
                       "same answer whatever the prefix cache, chunking, batch, speculation or preemption "
                       "(default: on; --no-batch-invariant: the float32 path's decode is faster)",
    "enable_lora": "let requests run with LoRA adapters (PEFT folders or GGUF LoRA files; serve: --lora-modules)",
    "max_loras": "LoRA adapters loaded at once; past it the least recently used idle one is evicted",
    "max_lora_rank": "the highest LoRA rank an adapter may have",
    "temperature": "0 is greedy",
    "top_k": "0 or -1: off",
    "max_tokens": "tokens to generate at most",
    "stop": "a stop string (repeatable)",
    "stop_token_ids": "a token id that ends the output (repeatable)",
    "ignore_eos": "keep generating past the model's end-of-sequence token",
    "include_stop_str_in_output": "keep the stop string that ended the output",
    "skip_special_tokens": "leave special tokens (<|im_end|>, tool-call markers) out of the text",
    "method": "how to round (mixed: a width per tensor to meet --bits on average)",
    "bits": "2..8; for mixed, the target average (e.g. 3.5)",
    "group_size": "inputs per scale (default: 128; 32 for a .gguf output)",
    "sym": "symmetric grid (default: asymmetric, except --bits 8 to GGUF: Q8_0)",
    "act_order": "GPTQ: columns in order of decreasing activation",
    "calib": "calibration text (default: WikiText-2 valid.txt)",
    "nsamples": "calibration sequences",
    "seqlen": "tokens per calibration sequence",
    "damp": "GPTQ damping, fraction of the mean diagonal",
    "true_sequential": "GPTQ: capture each Linear's inputs after the ones before it are quantized",
    "awq_grid": "AWQ: alpha in {0, 1/n, ..., 1}",
    "awq_clip": "AWQ: also clip each group's range to its best on calibration error",
    "mixed_quantizer": "mixed: how each tensor is rounded at its width",
    "sensitivity_samples": "mixed: sequences the sensitivities are measured on",
    "batch": "calibration sequences per layer call",
}


def _flag_type(hint) -> tuple[type, bool]:
    """(the type of one value, whether the flag repeats) of a field's type hint, None dropped."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) in (
        typing.Union, types.UnionType) else [hint]
    for a in args:
        if typing.get_origin(a) is list:
            return typing.get_args(a)[0], True
    return (args[0] if args[0] in (bool, int, float) else str), False


def add_dataclass_flags(p: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                        choices: dict[str, tuple] | None = None, **defaults: object) -> None:
    """A --flag per field of the dataclass `cls`, typed and defaulted by the field (`defaults`
    overrides a default; a field without one is a required flag). The dataclass validates values."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind, repeats = _flag_type(hints[f.name])
        default = defaults.get(f.name, f.default)
        required = default is dataclasses.MISSING
        text = HELP.get(f.name, "")
        if not required and not repeats and "default" not in text:
            text = f"{text} (default: {default})".strip()
        kw: dict = {"help": text or None}
        if required:
            kw["required"] = True
        else:
            kw["default"] = default
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = kind
            if repeats:
                kw["action"] = "append"
            if choices and f.name in choices:
                kw["choices"] = choices[f.name]
        p.add_argument("--" + f.name.replace("_", "-"), **kw)


def add_engine_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = (), **defaults: object) -> None:
    """Every field of EngineConfig (but `skip`) as a flag of a verb, or of a benchmark script, that
    runs the engine; `defaults` overrides EngineConfig's."""
    from .config import EngineConfig
    if "model" not in skip:
        p.add_argument("--model", "-m", default=defaults.pop("model", None), help=HELP["model"])
    add_dataclass_flags(p, EngineConfig, skip=("model", *skip), **defaults)


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig fields among parsed engine flags, as LLM(model, **options) takes them."""
    from .config import EngineConfig
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
            if f.name != "model" and hasattr(args, f.name)}


# The CLI prints one completion a prompt, without logprobs.
_SAMPLING_SKIP = ("n", "logprobs")


def add_sampling_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    from .sampling_params import SamplingParams
    add_dataclass_flags(p, SamplingParams, skip=_SAMPLING_SKIP, max_tokens=max_tokens, temperature=0.0)


def sampling_params(args: argparse.Namespace):
    from .sampling_params import SamplingParams
    return SamplingParams(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingParams)
                             if f.name not in _SAMPLING_SKIP})


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


@command("embed")
def cmd_embed(args: argparse.Namespace) -> int:
    """One JSON line a text: {"index", "text", "embedding"}; with --query, the texts reranked instead:
    {"index", "relevance_score", "text"} best first. Texts from stdin, one a line, with "-"."""
    texts = [line.rstrip("\n") for line in sys.stdin] if args.texts == ["-"] else args.texts
    llm = load_llm(args)
    if args.query is not None:
        for r in llm.rerank(args.query, texts, truncate_prompt_tokens=args.truncate_prompt_tokens):
            print(json.dumps({"index": r["index"], "relevance_score": r["relevance_score"], "text": r["document"]},
                             ensure_ascii=False))
        return 0
    vectors = llm.embed(texts, dimensions=args.dimensions, truncate_prompt_tokens=args.truncate_prompt_tokens)
    for i, (text, vector) in enumerate(zip(texts, vectors)):
        print(json.dumps({"index": i, "text": text, "embedding": vector}, ensure_ascii=False))
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
        header_timeout=args.header_timeout, grammar_compile_timeout=args.grammar_compile_timeout,
        allowed_hosts=tuple(args.allowed_hosts.split(",")) if args.allowed_hosts else None,
        allowed_origins=tuple(o for o in (args.allowed_origins or "").split(",") if o.strip()))
    models = args.model or []
    adapters = lora_modules(args.lora_modules or [])
    if adapters:
        args.enable_lora = True
    if args.models_dir is None and len(models) <= 1 and not any("=" in m and not os.path.exists(m) for m in models):
        args.model = models[0] if models else None  # one model, loaded now: every name means it
        llm = load_llm(args)
        for m in adapters:
            llm.engine.load_lora_adapter(m.name, m.path)
        serve(build_app(llm, config), log_level=args.log_level)
        return 0
    serve(build_app(model_router(args, adapters), config), log_level=args.log_level)
    return 0


def lora_modules(specs: list[str]):
    """`serve --lora-modules` (repeatable): NAME=PATH, or vLLM's JSON form {"name", "path",
    "base_model_name"} (the base among several models served)."""
    from .server.lora_adapters import LoRAModule
    out = []
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                d = json.loads(spec)
                out.append(LoRAModule(str(d["name"]), str(d["path"]), d.get("base_model_name")))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise WallbreakerError(f"--lora-modules: a JSON module needs \"name\" and \"path\", got {spec!r}") \
                    from None
            continue
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise WallbreakerError(f"--lora-modules takes NAME=PATH (a PEFT folder or a GGUF LoRA file), got {spec!r}")
        out.append(LoRAModule(name, path))
    return out


def model_router(args: argparse.Namespace, adapters=()):
    """`serve --models-dir DIR` / `--model NAME=PATH ...`: the models, loaded as requests name them."""
    from .llm import LLM
    from .server.model_sources import catalog, parse_keep_alive
    from .server.router import ModelRouter
    if args.served_model_name:
        raise WallbreakerError("--served-model-name names the one model served; with several, name each "
                               "with --model NAME=PATH")
    try:
        keep_alive = parse_keep_alive(args.keep_alive)
    except ValueError as e:
        raise WallbreakerError(f"--keep-alive: {e}") from None
    options = engine_options(args)
    if options.get("tensor_parallel_size", 1) > 1:
        raise WallbreakerError("--tensor-parallel-size serves one model: leave out --models-dir and NAME=PATH")
    kv_gb = options.get("kv_cache_memory_gb")
    return ModelRouter(catalog(args.model or [], args.models_dir), lambda source: LLM(source.model, **options),
                       keep_alive=keep_alive,
                       max_memory_bytes=None if args.max_memory_gb is None else int(args.max_memory_gb * 2**30),
                       extra_bytes=int(kv_gb * 2**30) if kv_gb else 0, lora_modules=adapters)


@command("inspect")
def cmd_inspect(args: argparse.Namespace) -> int:
    from .measure.inspect_model import describe
    print(describe(args.model_path, json_output=args.json))
    return 0


@command("roofline")
def cmd_roofline(args: argparse.Namespace) -> int:
    from .measure.roofline_report import run
    return run(args, engine_options(args))


@command("bench")
def cmd_bench(args: argparse.Namespace) -> int:
    from .measure.bench import run
    return run(args, engine_options(args))


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
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(QuantizeConfig)}
    if fields["group_size"] is None:  # GGUF's blocks are 32 wide
        fields["group_size"] = 32 if gguf_out else QuantizeConfig.group_size
    if fields["sym"] is None:  # 8 bits to GGUF is Q8_0, symmetric
        fields["sym"] = gguf_out and args.bits == 8
    cfg = QuantizeConfig(**fields)
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

    p = sub.add_parser("embed", help="embeddings of texts (or, with --query, the texts reranked), JSON lines")
    add_engine_flags(p)
    p.add_argument("--dimensions", type=int, default=None, help="keep the first N values (Matryoshka), renormalized")
    p.add_argument("--truncate-prompt-tokens", type=int, default=None,
                   help="cut longer texts to N tokens (-1: the model's limit); default: a longer text is an error")
    p.add_argument("--query", default=None, help="rerank the texts by relevance to this query")
    p.add_argument("texts", nargs="+", help='texts, or "-" to read one a line from stdin')

    p = sub.add_parser("chat", help="interactive chat, tokens streamed as they come")
    add_engine_flags(p)
    add_sampling_flags(p, max_tokens=512)
    p.add_argument("--system", default=None, help="a system message")

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    add_engine_flags(p, skip=("model",))
    p.add_argument("--model", "-m", action="append", default=None,
                   help="a .gguf file, a Hugging Face folder, or a packaged model name (default: smollm2); "
                        "repeat as NAME=PATH to serve several, each loaded when a request names it")
    p.add_argument("--lora-modules", action="append", default=None, metavar="NAME=PATH",
                   help="serve a LoRA adapter (a PEFT folder or a GGUF LoRA file) as model NAME: the base model with "
                        "that adapter, on every API (repeatable; implies --enable-lora). With several models, vLLM's "
                        "JSON form names the base: '{\"name\": N, \"path\": P, \"base_model_name\": B}'. With one, "
                        "POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time")
    p.add_argument("--models-dir", default=None,
                   help="serve every model in DIR (*.gguf files by their stem, Hugging Face folders by their name) "
                        "and the installed packaged models by name, each loaded when a request names it")
    p.add_argument("--keep-alive", default="5m",
                   help="with several models: how long an idle model stays loaded (a duration, e.g. 30s, 5m, 1h; "
                        "0: unload after each request; negative: forever); a request's keep_alive overrides it "
                        "(default: 5m)")
    p.add_argument("--max-memory-gb", type=float, default=None,
                   help="with several models: GiB the loaded models may hold (weights, KV pools); loading past it "
                        "unloads the least recently used idle ones (default: the free memory at start, less 1 GB)")
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
    p.add_argument("--grammar-compile-timeout", type=float, default=5.0,
                   help="seconds a JSON schema, regex or grammar may take to compile before a 400 (default: 5)")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names to answer ('*': any; default: loopback names when bound "
                        "to loopback, any when bound to 0.0.0.0)")
    p.add_argument("--allowed-origins", default=None,
                   help="comma-separated Origin patterns of web pages allowed to call the server ('*': any; "
                        "default: the server's own pages and pages on localhost)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    p = sub.add_parser("perplexity", help="perplexity over a text file (llama-perplexity's windows and scoring)")
    add_engine_flags(p)
    p.add_argument("--file", required=True, help="a UTF-8 text file")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (default: 512)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many windows (default: all)")
    p.add_argument("--score", choices=["half", "all"], default="half",
                   help="half: the second half of each window, as llama-perplexity (default); all: every token")

    from .quant.pipeline import METHODS, QuantizeConfig
    p = sub.add_parser("quantize", help="quantize a model and write it out (GGUF or folder)")
    add_dataclass_flags(p, QuantizeConfig, choices={"method": METHODS, "mixed_quantizer": ("gptq", "rtn")},
                        group_size=None, sym=None)
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
