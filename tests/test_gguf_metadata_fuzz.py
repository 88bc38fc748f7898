"""Loading GGUF metadata fuzzed key by key: a typed error or a working model, nothing else.

Real small files (the tiny llama and gemma3 GGUFs of tiny_models.py) are rewritten with every
numeric metadata key set in turn to 0, -1, 2**31 and 2**63 (float keys also to NaN and infinity),
each stored in a GGUF type that holds the value; every string key made 1 MiB long or invalid UTF-8;
the first item of every array given those values too. For each file `LLM(path, dtype="float32")`
and a 2-token greedy `generate` (and a chat turn) must either work or raise a
`wallbreaker.errors.WallbreakerError` other than the loader's last-resort safety net, within a
per-case time limit; the cases run in one subprocess whose address space is capped and whose
peak RSS must stay under MAX_RSS, so that a memory bomb fails the test instead of the machine.
Only a loader's errors count (ModelFormatError, UnsupportedModelError): a file the loader lets
through must work. `test_hf_config_fuzz` does the same to a Hugging Face folder's config.json.
"""
from __future__ import annotations

import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from gguf import GGUFValueType as VType

CASE_SECONDS = 10  # one case: rewrite, load, generate
MAX_RSS = 3 * 2**30  # the subprocess's peak resident memory over all cases
ADDRESS_SPACE = 8 * 2**30  # RLIMIT_AS of the subprocess: torch reserves ~1 GB of it at import
INTS = (0, -1, 2**31, 2**63)
FLOATS = (0.0, -1.0, 2.0**31, 2.0**63, math.nan, math.inf)
HUGE = "x" * 2**20
INT_TYPES = {VType.UINT8, VType.INT8, VType.UINT16, VType.INT16, VType.UINT32, VType.INT32, VType.UINT64,
             VType.INT64, VType.BOOL}
FLOAT_TYPES = {VType.FLOAT32, VType.FLOAT64}


def _int_type(value: int, original: VType) -> VType:
    """The GGUF type to store `value` in: the key's own where it holds it, else a 64-bit one."""
    if value == 0 and original != VType.BOOL:
        return original
    if value < 0:
        return VType.INT64
    return VType.UINT32 if value < 2**32 else VType.UINT64


def metadata_cases(fields: dict[str, tuple[Any, VType, VType | None]]) -> Iterator[tuple[str, dict]]:
    """(label, changes) for every key of a file's metadata."""
    for key, (value, vtype, sub) in fields.items():
        if vtype in INT_TYPES:
            for v in INTS:
                yield f"{key}={v}", {key: (v, _int_type(v, vtype), None)}
        elif vtype in FLOAT_TYPES:
            for v in FLOATS:
                yield f"{key}={v}", {key: (v, VType.FLOAT64 if v == 2.0**63 else VType.FLOAT32, None)}
        elif vtype == VType.STRING:
            yield f"{key}=1MiB", {key: (HUGE, VType.STRING, None)}
            yield f"{key}=invalid UTF-8", {key: (b"\xff\xfe" + str(value).encode()[:64], VType.STRING, None)}
        elif vtype == VType.ARRAY and sub in INT_TYPES:
            for v in INTS:
                items = [v, *value[1:]]
                kind = VType.INT64 if v < 0 or max(items) < 2**63 else VType.UINT64
                yield f"{key}[0]={v}", {key: (items, VType.ARRAY, kind)}
        elif vtype == VType.ARRAY and sub in FLOAT_TYPES:
            for v in FLOATS:
                yield f"{key}[0]={v}", {key: ([v, *value[1:]], VType.ARRAY, VType.FLOAT32)}
        elif vtype == VType.ARRAY and sub == VType.STRING:
            yield f"{key}[0]=1MiB", {key: ([HUGE, *value[1:]], VType.ARRAY, VType.STRING)}
            yield f"{key}[0]=invalid UTF-8", {key: ([b"\xff\xfe" + value[0].encode(), *value[1:]], VType.ARRAY, VType.STRING)}


def _run(cases: Iterator[tuple[str, Any]], write: Any, path: Path) -> None:
    """For each (label, case): write it to `path`, load it, generate; print one JSON line."""
    from wallbreaker import LLM, SamplingParams
    from wallbreaker.errors import WallbreakerError
    from wallbreaker.formats import UNEXPECTED

    class Timeout(BaseException):
        pass

    def alarm(signum: int, frame: Any) -> None:
        raise Timeout(f"over {CASE_SECONDS} s")

    signal.signal(signal.SIGALRM, alarm)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    for label, case in cases:
        write(path, case)
        start = time.perf_counter()
        signal.alarm(CASE_SECONDS)
        try:
            llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory_gb=0.01, max_num_seqs=4)
            assert llm.generate(["Hello"], greedy, use_tqdm=False)[0].outputs[0].token_ids
            try:
                llm.chat([{"role": "user", "content": "Hi"}], greedy, use_tqdm=False)
            except WallbreakerError as e:  # a template that renders past max_model_len, say
                outcome = f"ok, chat: {type(e).__name__}: {e}"
            else:
                outcome = "ok"
            del llm
        except WallbreakerError as e:
            net = UNEXPECTED in str(e) and not isinstance(e.__cause__, WallbreakerError)
            outcome = f"{'NET ' if net else ''}{type(e).__name__}: {e}"
            if "\n" in str(e):
                outcome = "MULTILINE " + outcome
        except BaseException as e:  # noqa: BLE001 - anything else is what this test is for
            outcome = f"UNTYPED {type(e).__name__}: {' '.join(str(e).split())}"
        finally:
            signal.alarm(0)
        print(json.dumps({"case": label, "outcome": outcome[:300], "seconds": round(time.perf_counter() - start, 3),
                          "maxrss": peak_rss()}), flush=True)


def peak_rss() -> int:
    """Bytes at this process's peak (VmHWM): ru_maxrss would count the test runner it was started from."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024


def run_cases(sources: list[str], work: str) -> None:
    """The subprocess: every metadata case of every source GGUF."""
    from test_model_loading_errors import GGUFContents

    for source in sources:
        contents = GGUFContents.read(Path(source))
        name = Path(source).parent.name
        _run(((f"{name}: {label}", changes) for label, changes in metadata_cases(contents.fields)),
             contents.write, Path(work) / "case.gguf")


CONFIG_VALUES = (0, -1, 2**31, 2**63, 1.5, math.nan, "x" * 2**20, None, True, [], {}, [1, 2])


def config_cases(config: dict[str, Any]) -> Iterator[tuple[str, dict]]:
    """(label, config.json) with every key, and every key of its rope parameters, set to each value."""
    paths = [(k,) for k in config] + [("rope_scaling",), ("quantization_config",), ("text_config",)]
    for key, value in config.items():
        if isinstance(value, dict):
            paths += [(key, k) for k in value]
            paths += [(key, k, kk) for k, v in value.items() if isinstance(v, dict) for kk in v]
    for path in paths:
        for v in CONFIG_VALUES:
            edited = json.loads(json.dumps(config))
            node = edited
            for p in path[:-1]:
                node = node[p]
            node[path[-1]] = v
            if path == ("text_config",):
                edited["model_type"] = "gemma3"
            yield f"config.json {'.'.join(path)}={repr(v)[:24]}", edited


def run_config_cases(folder: str, work: str) -> None:
    """The subprocess: every config.json case of the Hugging Face folder `folder`."""
    import shutil

    copy = Path(work) / "hf"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    _run(config_cases(config), lambda path, c: (path / "config.json").write_text(json.dumps(c)), copy)


def _subprocess(call: str) -> list[dict]:
    """Run `call` (of this module) in a fresh interpreter whose address space is capped."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    tests = str(Path(__file__).parent)
    code = f"import sys; sys.path.insert(0, {tests!r})\nimport test_gguf_metadata_fuzz as f\nf.{call}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                            preexec_fn=cap, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _check(results: list[dict], elapsed: float) -> None:
    bad = [r for r in results if not r["outcome"].startswith(("ok", "ModelFormatError", "UnsupportedModelError"))]
    assert not bad, "\n".join(f"{r['case']}: {r['outcome']}" for r in bad)
    slow = [r for r in results if r["seconds"] > CASE_SECONDS / 2]
    assert not slow, slow
    peak = max(r["maxrss"] for r in results)
    assert peak < MAX_RSS, f"peak RSS {peak / 2**30:.2f} GiB"
    ok = sum(r["outcome"].startswith("ok") for r in results)
    print(f"\n{len(results)} cases ({ok} working models) in {elapsed:.1f} s, peak RSS {peak / 2**20:.0f} MiB")


@pytest.mark.slow
@pytest.mark.parametrize("kinds", [("llama", "gemma3"), ("qwen3moe", "phi3-longrope")])
def test_gguf_metadata_fuzz(tiny_of, kinds) -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        results = _subprocess(f"run_cases({[str(tiny_of(k).gguf_path) for k in kinds]!r}, {work!r})")
    assert len(results) > 200
    _check(results, time.perf_counter() - start)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gemma3", "qwen3moe", "phi3-longrope"])
def test_hf_config_fuzz(tiny_of, kind) -> None:
    """The same over a Hugging Face folder's config.json: every key (nested rope parameters too)
    set to numbers out of range, a 1 MiB string, null, a boolean, an empty list and object."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        results = _subprocess(f"run_config_cases({str(tiny_of(kind).hf_dir)!r}, {work!r})")
    assert len(results) > 200
    _check(results, time.perf_counter() - start)
