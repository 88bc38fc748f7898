"""Structured output: the engine's grammar engine (llguidance) beside xgrammar, on our sampler path,
in one run. Three measurements, medians of --runs:

1. Compiling: a JSON schema into a grammar and the matcher's first mask, cold (no cache), for a
   small schema (10 properties, as in the server's acceptance test) and a large one (648: nested
   objects, enums, bounded integers and strings, arrays, patterns, anyOf). Also the one-off
   preparation of the tokenizer (each engine's view of the 49,152 tokens).
2. The mask per token: every token of 16 real outputs (sampled under each schema with llguidance)
   replayed through both engines' matchers side by side, timing the mask each writes into our
   bitmask row (bit t % 32 of word t // 32) and the token's acceptance, and counting the positions
   where the two masks are the same bits. Plus the sampler applying 16 such rows to the logits.
3. End to end: 16 concurrent chat requests under the small schema (temperature 0.8, seeds 0..15)
   through `LLM.chat`, with llguidance (the engine as it is) and with xgrammar (its matcher put in
   the engine's place by a 60-line adapter here), each run followed by its unconstrained twin: the
   same seeds and each sequence's token count (ignore_eos), so that every step has the same batch.
   Reports decode tokens/s of both and the time inside the engine's mask building (the matchers)
   and the sampler's bitmask, per step.

    .venv/bin/python benchmarks/structured_output.py --plot benchmarks/results/structured_output.png

xgrammar is not a dependency (llguidance is): `pip install xgrammar` into the venv to measure it;
without it the script measures llguidance alone.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time
from pathlib import Path

import torch

from wallbreaker import LLM, SamplingParams
from wallbreaker.cli import add_engine_flags, engine_options
from wallbreaker.engine.structured_output import StructuredOutputs, _TokenizerView
from wallbreaker.layers import sampler as sampler_module
from wallbreaker.measure.machine import describe_machine, machine_facts
from wallbreaker.measure.reporting import bar_plot, markdown_table, median, percentile, write_json
from wallbreaker.sampling_params import StructuredOutputsParams

RESULTS = Path(__file__).parent / "results"
MAX_WHITESPACE = 40  # JSON_WHITESPACE's bound, for xgrammar's max_whitespace_cnt

# the schema the tests validate outputs against (tests/test_server_structured_real_model.py)
SMALL = json.loads((Path(__file__).parents[1] / "tests" / "data" / "person_schema.json").read_text())
ASK = "Describe user number {i} of a web site as JSON: name, age, role, address, tags."


def large_schema(sections: int = 24) -> dict:
    """A configuration-file schema: `sections` objects of 16 fields each, of every common kind."""
    def section(k: int) -> dict:
        props = {
            f"title_{k}": {"type": "string", "minLength": 1, "maxLength": 40},
            f"enabled_{k}": {"type": "boolean"},
            f"level_{k}": {"enum": [f"level{j}_{k}" for j in range(12)]},
            f"count_{k}": {"type": "integer", "minimum": 0, "maximum": 10 ** (k % 6 + 1)},
            f"ratio_{k}": {"type": "number", "minimum": 0, "maximum": 1},
            f"code_{k}": {"type": "string", "pattern": f"^[A-Z]{{2}}-[0-9]{{{k % 4 + 2}}}$"},
            f"tags_{k}": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1,
                          "maxItems": k % 5 + 2},
            f"owner_{k}": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 30}, "email": {"type": "string", "format": "email"},
                "team": {"enum": ["core", "infra", "web", "data"]}}, "required": ["name", "team"],
                "additionalProperties": False},
            f"limits_{k}": {"type": "object", "properties": {
                "cpu": {"type": "integer", "minimum": 1, "maximum": 64},
                "memory_mb": {"type": "integer", "minimum": 128, "maximum": 65536},
                "burst": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 100}]}},
                "required": ["cpu", "memory_mb"], "additionalProperties": False},
            f"mode_{k}": {"anyOf": [{"const": "off"}, {"type": "object", "properties": {
                "schedule": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"},
                "repeat": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["schedule"],
                "additionalProperties": False}]},
            f"ports_{k}": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 65535},
                           "maxItems": 8},
            f"note_{k}": {"type": "string", "maxLength": 200},
            f"region_{k}": {"enum": ["eu-west", "eu-north", "us-east", "us-west", "ap-south", "ap-east"]},
            f"retries_{k}": {"type": "integer", "minimum": 0, "maximum": 9},
            f"labels_{k}": {"type": "array", "items": {"type": "object", "properties": {
                "key": {"type": "string", "maxLength": 16}, "value": {"type": "string", "maxLength": 32}},
                "required": ["key", "value"], "additionalProperties": False}, "maxItems": 4},
            f"version_{k}": {"type": "string", "pattern": "^v[0-9]+\\.[0-9]+\\.[0-9]+$"},
        }
        return {"type": "object", "properties": props, "required": list(props)[:8], "additionalProperties": False}
    sects = {f"section_{k}": section(k) for k in range(sections)}
    return {"type": "object", "properties": sects, "required": list(sects), "additionalProperties": False}


def count_properties(schema) -> int:
    if isinstance(schema, dict):
        return len(schema.get("properties", {})) + sum(count_properties(v) for v in schema.values())
    if isinstance(schema, list):
        return sum(count_properties(v) for v in schema)
    return 0


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


# -- xgrammar behind the engine's matcher interface --------------------------------------------
class XgrammarEngine:
    """xgrammar's compiler over the same tokenizer, and grammars the engine can hold in place of
    llguidance's: `matcher()` gives what `Sequence.grammar` needs (fill, accept, is_stopped, is_error,
    valid_prefix, rollback, fork)."""

    def __init__(self, tokenizer, stop_token_ids: list[int]):
        import xgrammar as xgr
        self.xgr = xgr
        view = _TokenizerView(tokenizer)
        special = set(view.special_token_ids)
        # raw bytes per token; xgrammar takes an empty token as a special one (never inside the text)
        vocab = [b"" if i in special else t for i, t in enumerate(view.tokens)]
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=stop_token_ids)
        self.stop_token_ids = stop_token_ids
        self.words = (len(vocab) + 31) // 32

    def compiler(self, cache: bool = False):
        return self.xgr.GrammarCompiler(self.info, cache_enabled=cache)

    def compile(self, compiler, schema: dict, compact: bool = False):
        if compact:
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE)

    def matcher(self, compiled) -> "XgrammarMatcher":
        return XgrammarMatcher(self.xgr.GrammarMatcher(compiled, terminate_without_stop_token=True))


class XgrammarMatcher:
    def __init__(self, m):
        self._m = m

    def fork(self):
        return XgrammarMatcher(self._m.fork())

    def fill(self, bits: torch.Tensor) -> None:
        self._m.fill_next_token_bitmask(bits.view(1, -1), 0)

    def accept(self, token: int) -> bool:
        return self._m.accept_token(token)

    def valid_prefix(self, tokens) -> int:
        n = 0
        for t in tokens:
            if not self._m.accept_token(t):
                break
            n += 1
        self._m.rollback(n)
        return n

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    @property
    def is_stopped(self) -> bool:
        return self._m.is_terminated()

    is_error = False
    error = ""


class _XgrammarGrammar:
    def __init__(self, key: str, engine: XgrammarEngine, compiled):
        self.key, self._engine, self._compiled = key, engine, compiled

    def matcher(self):
        return self._engine.matcher(self._compiled)


# -- 1. compiling ------------------------------------------------------------------------------
def compile_times(structured: StructuredOutputs, xg: XgrammarEngine | None, schemas: dict, runs: int) -> dict:
    """Cold compile + the first mask, seconds, per engine and schema."""
    out: dict = {}
    bits = torch.empty(structured.words, dtype=torch.int32)
    warm = StructuredOutputsParams(json={"type": "object", "properties": {"w": {"type": "integer"}}})
    structured._build(warm)  # first use: each library's lazy set-up, not a compile
    if xg is not None:
        xg.matcher(xg.compile(xg.compiler(), warm.json)).fill(bits)
    for name, schema in schemas.items():
        spec = StructuredOutputsParams(json=schema)
        out[f"llguidance/{name}"] = [timed(lambda: structured._build(spec))[1] for _ in range(runs)]
        if xg is not None:
            compiler = xg.compiler(cache=False)

            def xgr_build():
                m = xg.matcher(xg.compile(compiler, schema))
                m.fill(bits)
            out[f"xgrammar/{name}"] = [timed(xgr_build)[1] for _ in range(runs)]
    return out


# -- 2. the mask per token ---------------------------------------------------------------------
def replay(matchers: dict, outputs: list[list[int]], words: int, stop: set[int]) -> tuple[dict, int, int]:
    """Each output's tokens through fresh matchers of every engine, side by side: the seconds of
    every mask and every acceptance per engine, and at how many positions of how many all engines'
    masks are the same bits. An output stops where an engine refuses its token."""
    times = {e: {"mask_s": [], "accept_s": [], "refused": 0} for e in matchers}
    same = positions = 0
    bits = {e: torch.empty(words, dtype=torch.int32) for e in matchers}
    for tokens in outputs:
        live = {e: make() for e, make in matchers.items()}
        for t in tokens:
            if t in stop:
                break
            for e, m in live.items():
                start = time.perf_counter()
                m.fill(bits[e])
                times[e]["mask_s"].append(time.perf_counter() - start)
            rows = list(bits.values())
            positions += 1
            same += all(torch.equal(rows[0], r) for r in rows[1:])
            refused = [e for e in live if not (int(bits[e][t // 32]) >> (t % 32)) & 1]
            for e, m in live.items():
                if e in refused:
                    continue
                start = time.perf_counter()
                if not m.accept(t):
                    refused.append(e)
                times[e]["accept_s"].append(time.perf_counter() - start)
            for e in refused:
                times[e]["refused"] += 1
            if refused:
                break
    return times, same, positions


def apply_time(vocab_words: int, vocab: int, model_vocab: int, rows: int, runs: int) -> float:
    """Seconds for the sampler to apply `rows` mask rows to [rows, model_vocab] logits."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (rows, vocab_words), dtype=torch.int32, generator=g)
    logits = torch.randn(rows, model_vocab, generator=g)
    mask = sampler_module.TokenMask(list(range(rows)), bits)
    times = []
    for _ in range(runs):
        x = logits.clone()
        times.append(timed(lambda: sampler_module.apply_token_mask(x, mask))[1])
    return statistics.median(times)


# -- 3. end to end -----------------------------------------------------------------------------
class StepTimer:
    """Time inside the engine's mask building (matchers, step_mask) and the sampler's bitmask."""

    def __init__(self, llm: LLM):
        self.mask_s = self.apply_s = 0.0
        self.mask_calls = 0
        structured = llm.engine.structured
        step_mask, apply = structured.step_mask, sampler_module.apply_token_mask

        def timed_step_mask(seqs):
            start = time.perf_counter()
            out = step_mask(seqs)
            self.mask_s += time.perf_counter() - start
            self.mask_calls += out is not None
            return out

        def timed_apply(logits, mask):
            start = time.perf_counter()
            apply(logits, mask)
            self.apply_s += time.perf_counter() - start
        structured.step_mask = timed_step_mask
        sampler_module.apply_token_mask = timed_apply

    def reset(self):
        self.mask_s = self.apply_s = 0.0
        self.mask_calls = 0


def e2e_run(llm: LLM, timer: StepTimer, conversations, params: list[SamplingParams]) -> tuple[dict, list]:
    counters = llm.engine.counters
    before = dict(counters)
    timer.reset()
    start = time.perf_counter()
    outs = llm.chat(conversations, params)
    wall = time.perf_counter() - start
    decode_s = counters["decode_time_s"] - before["decode_time_s"]
    decode_tokens = counters["decode_tokens"] - before["decode_tokens"]
    steps = counters["steps"] - before["steps"]
    tokens = [o.outputs[0].token_ids for o in outs]
    return {"wall_s": wall, "decode_s": decode_s, "decode_tokens_per_s": decode_tokens / decode_s, "steps": steps,
            "tokens": sum(map(len, tokens)),
            "decode_ms_per_step": 1000 * decode_s / max(1, steps - 1),
            "mask_ms_per_step": 1000 * timer.mask_s / timer.mask_calls if timer.mask_calls else None,
            "apply_ms_per_step": 1000 * timer.apply_s / timer.mask_calls if timer.mask_calls else None}, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--compile-runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--large-sections", type=int, default=24)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    add_engine_flags(ap, max_num_seqs=16)
    args = ap.parse_args()
    llm = LLM(args.model, **engine_options(args))
    facts = machine_facts()
    tok = llm.tokenizer
    structured = llm.engine.structured
    stop = sorted(structured.stop_token_ids)
    LARGE = large_schema(args.large_sections)
    schemas = {"small": SMALL, "large": LARGE}
    sizes = {k: {"properties": count_properties(v), "bytes": len(json.dumps(v))} for k, v in schemas.items()}

    fresh = StructuredOutputs(tok, frozenset(stop))
    _, llg_tok_s = timed(fresh._llg_tokenizer)
    try:
        import xgrammar  # noqa: F401
        xg, xgr_tok_s = timed(lambda: XgrammarEngine(tok, stop))
        xgr_version = importlib.metadata.version("xgrammar")
    except ImportError:
        xg, xgr_tok_s, xgr_version = None, None, None
        print("xgrammar is not installed: llguidance alone")
    engines = ["llguidance"] + (["xgrammar"] if xg is not None else [])
    versions = {"llguidance": importlib.metadata.version("llguidance"), "xgrammar": xgr_version}
    print(f"vocabulary {tok.vocab_size} tokens; tokenizer prepared in {llg_tok_s * 1000:.0f} ms (llguidance)"
          + (f", {xgr_tok_s * 1000:.0f} ms (xgrammar)" if xg else ""), flush=True)

    # 1. compiling
    compiles = compile_times(structured, xg, schemas, args.compile_runs)
    for k, v in compiles.items():
        print(f"compile {k}: {statistics.median(v) * 1000:.1f} ms", flush=True)

    # 3. end to end (first: its outputs are what 2 replays)
    timer = StepTimer(llm)
    conversations = [[{"role": "user", "content": ASK.format(i=i)}] for i in range(args.seqs)]

    def params(spec, i, **kw):
        return SamplingParams(**{"temperature": 0.8, "seed": i, "max_tokens": args.max_tokens,
                                 "structured_outputs": spec, **kw})
    small_spec = StructuredOutputsParams(json=SMALL)
    original_compile = structured.compile
    xgr_grammar = None
    if xg is not None:
        xgr_grammar = _XgrammarGrammar(small_spec.key, xg, xg.compile(xg.compiler(), SMALL))
    e2e_run(llm, timer, conversations[:2], [params(None, i, max_tokens=4) for i in range(2)])  # warm-up
    _, first = e2e_run(llm, timer, conversations, [params(small_spec, i) for i in range(args.seqs)])
    # Each constrained run is followed by its unconstrained twin: the same seeds and each sequence's
    # token count (ignore_eos), so that every step has the same batch. (On the default path a seed's
    # tokens may vary with the batch and the prefix cache, so the lengths are taken run by run.)
    samples: dict[str, list[dict]] = {e: [] for e in engines}
    twins: dict[str, list[dict]] = {e: [] for e in engines}
    valid = {e: 0 for e in engines}
    complete = {e: 0 for e in engines}
    for rep in range(args.runs):
        for kind in engines[rep % len(engines):] + engines[:rep % len(engines)]:  # each goes first in turn
            structured.compile = (lambda spec: xgr_grammar) if kind == "xgrammar" else original_compile
            result, outs = e2e_run(llm, timer, conversations, [params(small_spec, i) for i in range(args.seqs)])
            structured.compile = original_compile
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            twin, _ = e2e_run(llm, timer, conversations, [params(None, i, max_tokens=n, ignore_eos=True)
                                                          for i, n in enumerate(lengths)])
            result["vs_unconstrained"] = twin["decode_s"] / result["decode_s"]
            samples[kind].append(result)
            twins[kind].append(twin)
            valid[kind] += sum(_valid(o.outputs[0].text, SMALL) for o in outs)
            complete[kind] += sum(o.outputs[0].finish_reason == "stop" for o in outs)
            print(f"run {rep + 1} {kind}: {result['decode_tokens_per_s']:.1f} decode tokens/s "
                  f"(unconstrained {twin['decode_tokens_per_s']:.1f}), matchers {result['mask_ms_per_step']:.2f} "
                  f"ms/step, bitmask {result['apply_ms_per_step']:.2f} ms/step", flush=True)
    e2e = {k: {m: median([s[m] for s in runs]) for m in runs[0]} for k, runs in samples.items()}
    e2e_twins = {k: {m: median([s[m] for s in runs]) for m in runs[0]} for k, runs in twins.items()}

    # 2. the mask per token: the outputs above, and the large schema's (a prefix of 96 tokens each)
    large_spec = StructuredOutputsParams(json=LARGE)
    large_outs = llm.chat([[{"role": "user", "content": f"Write configuration number {i} of a service as JSON."}]
                           for i in range(args.seqs)], [params(large_spec, i, max_tokens=96)
                                                        for i in range(args.seqs)])
    replays = {"small": [o.outputs[0].token_ids for o in first], "large": [o.outputs[0].token_ids for o in large_outs]}
    mask_stats: dict = {}
    agreement: dict = {}
    for name, outputs in replays.items():
        grammar = structured.compile(StructuredOutputsParams(json=schemas[name]))
        matchers = {"llguidance": grammar.matcher}
        if xg is not None:
            compiled = xg.compile(xg.compiler(), schemas[name])
            matchers["xgrammar"] = lambda compiled=compiled: xg.matcher(compiled)
        times, same, positions = replay(matchers, outputs, structured.words, set(stop))
        agreement[name] = {"same_masks": same, "positions": positions}
        for e, v in times.items():
            mask_stats[f"{e}/{name}"] = {
                "tokens": len(v["mask_s"]), "refused": v["refused"],
                "mask_median_us": 1e6 * statistics.median(v["mask_s"]),
                "mask_mean_us": 1e6 * statistics.mean(v["mask_s"]),
                "mask_p99_us": 1e6 * percentile(v["mask_s"], 99), "mask_max_us": 1e6 * max(v["mask_s"]),
                "accept_median_us": 1e6 * statistics.median(v["accept_s"])}
    model_vocab = llm.model_config.vocab_size if hasattr(llm, "model_config") else tok.vocab_size
    apply_16 = apply_time(structured.words, tok.vocab_size, model_vocab, args.seqs, 50)

    # report
    name = llm.model_path.name
    print(f"\n{name}; vocabulary {tok.vocab_size}; machine: {describe_machine(facts)}")
    print(f"llguidance {versions['llguidance']}, xgrammar {versions['xgrammar']}; medians\n")
    print(f"Compiling (cold, with the first mask), ms; small: {sizes['small']['properties']} properties, "
          f"large: {sizes['large']['properties']} properties ({sizes['large']['bytes']:,} bytes of schema)")
    print(markdown_table(["engine", "tokenizer (once)", "small schema", "large schema"],
                         [[e, (llg_tok_s if e == "llguidance" else xgr_tok_s) * 1000,
                           statistics.median(compiles[f"{e}/small"]) * 1000,
                           statistics.median(compiles[f"{e}/large"]) * 1000] for e in engines]))
    print(f"\nThe mask of one sequence, one token (µs), over the tokens of {args.seqs} sampled outputs; "
          f"the sampler applies {args.seqs} rows in {apply_16 * 1e6:.0f} µs")
    print(markdown_table(["engine / schema", "tokens", "mask median", "mask mean", "mask p99", "mask max",
                          "accept median", "refused"],
                         [[k, v["tokens"], v["mask_median_us"], v["mask_mean_us"], v["mask_p99_us"], v["mask_max_us"],
                           v["accept_median_us"], v["refused"]] for k, v in mask_stats.items()]))
    if xg is not None:
        print("the two engines' masks are the same bits at " + ", ".join(
            f"{a['same_masks']} of {a['positions']} positions ({name} schema)" for name, a in agreement.items()))
    print(f"\n{args.seqs} concurrent chat requests under the small schema, temperature 0.8, seeds 0..{args.seqs - 1}, "
          f"each run beside its unconstrained twin (the same seeds and lengths); {args.runs} runs")
    print(markdown_table(["engine", "tokens", "decode tokens/s", "unconstrained", "constrained / unconstrained",
                          "ms/step", "matchers ms/step", "bitmask ms/step", "complete", "valid JSON"],
                         [[k, int(v["tokens"]), v["decode_tokens_per_s"], e2e_twins[k]["decode_tokens_per_s"],
                           f"{v['vs_unconstrained']:.3f}", v["decode_ms_per_step"], v["mask_ms_per_step"],
                           v["apply_ms_per_step"], f"{complete[k]}/{args.seqs * args.runs}",
                           f"{valid[k]}/{args.seqs * args.runs}"] for k, v in e2e.items()], 2))
    report = {"model": name, "machine": facts, "versions": versions, "config": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("json", "plot")},
        "schema_sizes": sizes, "tokenizer_s": {"llguidance": llg_tok_s, "xgrammar": xgr_tok_s},
        "compile_s": compiles, "mask": mask_stats, "mask_agreement": agreement, "apply_16_rows_s": apply_16,
        "e2e_samples": samples, "e2e_twin_samples": twins, "e2e": e2e, "e2e_twins": e2e_twins,
        "complete": complete, "valid": valid,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out = args.json or RESULTS / "structured_output.json"
    write_json(out, report)
    print(f"wrote {out}")
    if args.plot:
        bar_plot({"compile, large schema": {e: statistics.median(compiles[f"{e}/large"]) * 1000 for e in engines},
                  "compile, small schema": {e: statistics.median(compiles[f"{e}/small"]) * 1000 for e in engines},
                  "mask per token, mean": {e: mask_stats[f"{e}/small"]["mask_mean_us"] for e in engines},
                  f"decode, {args.seqs} sequences": {"unconstrained": e2e_twins["llguidance"]["decode_tokens_per_s"],
                                                     **{k: v["decode_tokens_per_s"] for k, v in e2e.items()}}},
                 args.plot, f"Structured output on {name}",
                 {"compile, large schema": "ms", "compile, small schema": "ms", "mask per token, mean": "µs",
                  f"decode, {args.seqs} sequences": "tokens/s"})
        print(f"wrote {args.plot}")


def _valid(text: str, schema: dict) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


if __name__ == "__main__":
    main()
