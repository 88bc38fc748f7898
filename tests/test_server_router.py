"""The model router behind `wallbreaker serve --models-dir` / `--model NAME=PATH` (server/router.py):
each request gets the model it names (the same greedy text as `LLM(that model)`), loaded on first use,
unloaded after its keep_alive or to make room, through the official `openai` and `ollama` clients."""
from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import ollama
import openai
import pytest
import torch

from server_apps import running_server
from server_process import ServerProcess, free_port
from wallbreaker import LLM, SamplingParams
from wallbreaker.cli import build_parser, model_router
from wallbreaker.errors import WallbreakerError
from wallbreaker.server.app import build_app
from wallbreaker.server.model_sources import FOREVER, ModelSource, catalog, parse_keep_alive
from wallbreaker.server.router import ModelRouter, model_bytes

OPTIONS = dict(dtype="float32", max_model_len=128, max_num_seqs=4, kv_cache_memory_gb=0.002)
PROMPT = "The capital of France is"
MAX_TOKENS = 8


# -- the models ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models_dir(tiny_of, tiny_bert_embedding, tmp_path_factory) -> Path:
    """A folder as `--models-dir` finds it: GGUF files, a Hugging Face folder, an embedding model's folder."""
    d = tmp_path_factory.mktemp("models")
    (d / "llama.gguf").symlink_to(tiny_of("llama").gguf_path)
    (d / "gemma3.gguf").symlink_to(tiny_of("gemma3").gguf_path)
    (d / "qwen2").symlink_to(tiny_of("qwen2").hf_dir)
    (d / "embedder").symlink_to(tiny_bert_embedding)
    (d / "notes.txt").write_text("not a model")
    return d


@pytest.fixture(scope="module")
def expected(models_dir) -> dict[str, str]:
    """Each generating model's greedy completion of PROMPT, from its own `LLM`."""
    out = {}
    for name in ("llama", "gemma3", "qwen2"):
        path = models_dir / (name if name == "qwen2" else f"{name}.gguf")
        with LLM(str(path), **OPTIONS) as llm:
            out[name] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].outputs[0].text
    assert len(set(out.values())) == 3, out  # the models tell apart
    return out


def dir_sources(models_dir: Path) -> list[ModelSource]:
    return [s for s in catalog([], str(models_dir)) if s.name in ("llama", "gemma3", "qwen2", "embedder", "corrupt")]


class Loads:
    """The router's load function, counting loads and able to hold one back."""

    def __init__(self, delay: dict[str, threading.Event] | None = None,
                 load: Callable[[ModelSource], LLM] = lambda source: LLM(source.model, **OPTIONS)):
        self.count: dict[str, int] = {}
        self.delay = delay or {}
        self.load = load
        self.lock = threading.Lock()

    def __call__(self, source: ModelSource) -> LLM:
        with self.lock:
            self.count[source.name] = self.count.get(source.name, 0) + 1
        if source.name in self.delay:
            assert self.delay[source.name].wait(60)
        return self.load(source)


@contextmanager
def served(sources: list[ModelSource], load: Callable[[ModelSource], LLM] | None = None,
           **router_options) -> Iterator[tuple[str, ModelRouter]]:
    router = ModelRouter(sources, load or Loads(), **router_options)
    app = build_app(router, port=free_port())
    with running_server(app) as url:
        yield url, router


def complete(url: str, model: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0).choices[0].text


def loaded(url: str) -> list[str]:
    return sorted(m.model for m in ollama.Client(host=url).ps().models)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- tests ---------------------------------------------------------------------------------------
def test_keep_alive_reads_ollamas_durations():
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400 and parse_keep_alive("300ms") == 0.3
    assert parse_keep_alive(0) == 0 and parse_keep_alive("0") == 0 and parse_keep_alive(45) == 45
    assert parse_keep_alive(-1) == FOREVER and parse_keep_alive("-1m") == FOREVER
    for bad in ("soon", "5 minutes", "", True):
        with pytest.raises(ValueError):
            parse_keep_alive(bad)


def test_models_dir_finds_gguf_files_folders_and_packaged_models(models_dir):
    names = [s.name for s in catalog(["mine=" + str(models_dir / "llama.gguf")], str(models_dir))]
    assert names[:5] == ["mine", "embedder", "gemma3", "llama", "qwen2"]  # --model first, then the folder's
    assert "notes" not in names
    assert "smollm2" in names  # the packaged models by name (the test environment installs SmolLM2)


def test_serve_flags_make_a_router(models_dir):
    args = build_parser().parse_args(["serve", "--models-dir", str(models_dir), "--model", "x=" + str(models_dir / "llama.gguf"),
                                      "--keep-alive", "30s", "--max-memory-gb", "2", "--dtype", "float32"])
    router = model_router(args)
    assert router.keep_alive == 30 and router.max_memory_bytes == 2 * 2**30
    assert {"x", "llama", "qwen2", "embedder"} <= set(router.names)
    assert build_parser().parse_args(["serve", "--model", "a.gguf"]).model == ["a.gguf"]
    with pytest.raises(WallbreakerError, match="memory budget must be positive"):
        model_router(build_parser().parse_args(["serve", "--models-dir", str(models_dir), "--max-memory-gb", "0"]))
    with pytest.raises(WallbreakerError, match="no such file"):
        catalog(["x=/nowhere/model.gguf", "y=smollm2"])
    with pytest.raises(WallbreakerError, match="--keep-alive"):
        model_router(build_parser().parse_args(["serve", "--models-dir", str(models_dir), "--keep-alive", "soon"]))


def test_each_request_gets_the_model_it_names(models_dir, expected, tiny_bert_embedding):
    """OpenAI's and Ollama's clients, chat and embedding models side by side; /v1/models and
    /api/tags list every model, /api/ps the loaded ones with their expiry."""
    loads = Loads()
    with served(dir_sources(models_dir), loads) as (url, router):
        assert sorted(m.id for m in openai.OpenAI(base_url=f"{url}/v1", api_key="x").models.list()) == \
            ["embedder", "gemma3", "llama", "qwen2"]
        assert loaded(url) == []
        for name in ("llama", "qwen2", "gemma3", "llama"):
            assert complete(url, name) == expected[name], name
        client = ollama.Client(host=url)
        for name in ("qwen2", "llama"):
            answer = client.generate(model=f"{name}:latest", prompt=PROMPT, raw=True,
                                     options={"temperature": 0, "num_predict": MAX_TOKENS})
            assert answer.response == expected[name] and answer.load_duration == 0  # loaded already
        vector = openai.OpenAI(base_url=f"{url}/v1", api_key="x").embeddings.create(model="embedder", input="hello")
        with LLM(str(tiny_bert_embedding), dtype="float32") as reference:
            want = reference.embed(["hello"])[0]
        assert torch.allclose(torch.tensor(vector.data[0].embedding), torch.tensor(want), atol=1e-5)
        assert loads.count == {"llama": 1, "qwen2": 1, "gemma3": 1, "embedder": 1}  # each loaded once, kept
        ps = client.ps().models
        assert sorted(m.model for m in ps) == ["embedder:latest", "gemma3:latest", "llama:latest", "qwen2:latest"]
        assert all(m.expires_at is not None and m.size > 0 for m in ps)
        tags = sorted(m.model for m in client.list().models)
        assert tags == ["embedder:latest", "gemma3:latest", "llama:latest", "qwen2:latest"]


def test_show_and_tags_read_unloaded_models_without_loading_them(models_dir, tiny_of):
    loads = Loads()
    with served(dir_sources(models_dir), loads) as (url, _):
        client = ollama.Client(host=url)
        shown = client.show("gemma3")
        assert shown.modelinfo["general.architecture"] == tiny_of("gemma3").config.architecture
        assert shown.template and "tools" in shown.capabilities
        families = {m.model: m.details.family for m in client.list().models}
        assert families["llama:latest"] == tiny_of("llama").config.architecture
        assert loads.count == {} and loaded(url) == []


def test_unknown_model_is_a_404_naming_the_models_served(models_dir):
    with served(dir_sources(models_dir)) as (url, _):
        with pytest.raises(openai.NotFoundError) as e:
            complete(url, "claude-opus-4")
        assert "'claude-opus-4' does not exist" in str(e.value) and "'llama'" in str(e.value)
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=url).generate(model="nope", prompt="hi")
        assert e.value.status_code == 404 and "'qwen2'" in e.value.error


def test_a_single_model_answers_any_name(models_dir, expected):
    with served([ModelSource("llama", str(models_dir / "llama.gguf"))]) as (url, _):
        assert complete(url, "claude-opus-4") == expected["llama"]
        assert complete(url, "gpt-4o") == expected["llama"]


def test_keep_alive_zero_unloads_after_the_request(models_dir, expected):
    with served(dir_sources(models_dir)) as (url, router):
        client = ollama.Client(host=url)
        answer = client.generate(model="llama", prompt=PROMPT, raw=True, keep_alive=0,
                                 options={"temperature": 0, "num_predict": MAX_TOKENS})
        assert answer.response == expected["llama"]
        assert answer.load_duration > 0  # it waited for the load
        assert wait_for(lambda: loaded(url) == [])
        client.generate(model="qwen2", keep_alive="1h")  # no prompt: loads it
        assert loaded(url) == ["qwen2:latest"]
        client.generate(model="qwen2", keep_alive=0)  # no prompt, keep_alive 0: unloads it
        assert wait_for(lambda: loaded(url) == [])


def test_a_stream_holds_its_model_until_its_last_chunk(models_dir, expected):
    """keep_alive 0 unloads once the response has been sent: a slow stream is not cut short."""
    def slow_load(source: ModelSource) -> LLM:
        llm = LLM(source.model, **OPTIONS)
        step = llm.engine.step

        def slow_step():
            time.sleep(0.1)
            return step()
        llm.engine.step = slow_step
        return llm
    with served(dir_sources(models_dir), slow_load) as (url, _):
        pieces, seen_loaded = [], []
        for part in ollama.Client(host=url).generate(model="llama", prompt=PROMPT, raw=True, keep_alive=0, stream=True,
                                                     options={"temperature": 0, "num_predict": MAX_TOKENS}):
            pieces.append(part.response)
            if len(pieces) == 2:
                seen_loaded = loaded(url)
        assert "".join(pieces) == expected["llama"] and seen_loaded == ["llama:latest"]
        assert wait_for(lambda: loaded(url) == [])


def test_an_idle_model_is_unloaded_after_keep_alive(models_dir, expected):
    with served(dir_sources(models_dir), keep_alive=3.0) as (url, router):
        assert complete(url, "gemma3") == expected["gemma3"]
        assert loaded(url) == ["gemma3:latest"]
        assert wait_for(lambda: loaded(url) == [], timeout_s=20)
        assert complete(url, "gemma3") == expected["gemma3"]  # loaded again


def test_a_budget_below_two_models_evicts_the_least_recently_used(models_dir, expected):
    """Alternating requests under a budget that holds one model at a time: each load unloads the
    other, and every answer stays right."""
    sizes = {}
    for name in ("llama", "gemma3"):
        with LLM(str(models_dir / f"{name}.gguf"), **OPTIONS) as llm:
            sizes[name] = model_bytes(llm)
    budget = int(max(sizes.values()) * 1.5)
    assert budget < sum(sizes.values())
    loads = Loads()
    with served(dir_sources(models_dir), loads, max_memory_bytes=budget) as (url, router):
        for name in ("llama", "gemma3", "llama", "gemma3", "llama"):
            assert complete(url, name) == expected[name], name
            assert loaded(url) == [f"{name}:latest"]
        assert loads.count == {"llama": 3, "gemma3": 2}


def test_sixteen_concurrent_requests_over_three_models_all_complete(models_dir, expected):
    names = ["llama", "qwen2", "gemma3"]
    with served(dir_sources(models_dir)) as (url, _):
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda i: (names[i % 3], complete(url, names[i % 3])), range(16)))
    assert len(answers) == 16
    assert all(text == expected[name] for name, text in answers)


def test_a_slow_load_blocks_no_other_model(models_dir, expected):
    """While one model loads, requests to another are served; requests for the loading model wait
    for that one load."""
    release = threading.Event()
    loads = Loads(delay={"qwen2": release})
    with served(dir_sources(models_dir), loads) as (url, _):
        with ThreadPoolExecutor(2) as pool:
            slow = [pool.submit(complete, url, "qwen2") for _ in range(2)]
            assert wait_for(lambda: loads.count.get("qwen2") == 1)
            assert complete(url, "llama") == expected["llama"]
            assert complete(url, "gemma3") == expected["gemma3"]
            assert not any(f.done() for f in slow)
            release.set()
            assert [f.result(timeout=60) for f in slow] == [expected["qwen2"]] * 2
        assert loads.count["qwen2"] == 1


def test_a_corrupt_file_gets_its_error_while_the_others_are_served(models_dir, expected, tmp_path):
    (tmp_path / "corrupt.gguf").write_bytes(b"GGUF" + os.urandom(200))
    sources = dir_sources(models_dir) + [ModelSource("corrupt", str(tmp_path / "corrupt.gguf"))]
    with served(sources) as (url, _):
        with ThreadPoolExecutor(4) as pool:
            good = [pool.submit(complete, url, name) for name in ("llama", "qwen2", "gemma3")]
            with pytest.raises(openai.InternalServerError) as e:
                complete(url, "corrupt")
            assert "'corrupt' could not be loaded" in str(e.value)
            assert [f.result(timeout=60) for f in good] == [expected[n] for n in ("llama", "qwen2", "gemma3")]
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=url).chat(model="corrupt", messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 500 and "could not be loaded" in e.value.error
        assert complete(url, "llama") == expected["llama"]
        tags = httpx.get(f"{url}/api/tags").json()["models"]
        assert "corrupt:latest" in [m["name"] for m in tags]  # listed, as what it is


def test_serve_models_dir_end_to_end(models_dir, expected, tmp_path):
    """The `wallbreaker serve` command with --models-dir: healthy with nothing loaded, each API's
    `model` field picks the model, the log tells the loads."""
    log = tmp_path / "serve.log"
    server = ServerProcess(models_dir / "llama.gguf", "--models-dir", str(models_dir), "--max-model-len", "128",
                           "--max-num-seqs", "4", "--kv-cache-memory-gb", "0.002", "--keep-alive", "1h", log_path=log)
    try:
        names = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
        assert {"llama", "qwen2", "gemma3", "embedder", "smollm2"} <= set(names)
        assert complete(server.url, "qwen2") == expected["qwen2"]
        answer = httpx.post(f"{server.url}/v1/messages", json={
            "model": "gemma3", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).json()
        assert answer["model"] == "gemma3" and answer["type"] == "message"
        tokens = httpx.post(f"{server.url}/tokenize", json={"model": "llama", "prompt": PROMPT}).json()["tokens"]
        with LLM(str(models_dir / "llama.gguf"), **OPTIONS) as llm:
            assert tokens == llm.tokenizer.encode(PROMPT, True)
        metrics = httpx.get(f"{server.url}/metrics").text
        assert "wallbreaker_kv_blocks_total" in metrics
        assert loaded(server.url) == ["gemma3:latest", "llama:latest", "qwen2:latest"]
    finally:
        server.stop()
    text = log.read_text()
    assert "serving " in text and "loading model 'qwen2'" in text and "loaded model 'gemma3'" in text


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_smollm2_answers_and_its_memory_is_handed_back(packaged_model, models_dir, expected):
    """The packaged SmolLM2 beside a tiny model: its answer is `LLM("smollm2")`'s, and once unloaded
    (keep_alive 0) the process's resident memory is back within 100 MB of where it was before the load."""
    smollm2 = str(packaged_model("smollm2"))
    options = dict(max_num_seqs=4, max_model_len=256, kv_cache_memory_gb=0.05)
    sources = [ModelSource("smollm2", "smollm2"), ModelSource("llama", str(models_dir / "llama.gguf"))]

    def load(source: ModelSource) -> LLM:
        return LLM(source.model, **(options if source.name == "smollm2" else OPTIONS))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with served(sources, load) as (url, _):
        assert complete(url, "llama") == expected["llama"]  # the server's own code paths, warmed up
        gc.collect()
        before = _rss_bytes()
        client = ollama.Client(host=url)
        answer = client.chat(model="smollm2", messages=messages, keep_alive=0,
                             options={"temperature": 0, "num_predict": 16})
        assert wait_for(lambda: loaded(url) == ["llama:latest"])
        gc.collect()
        after = _rss_bytes()
    assert after - before < 100e6, f"{(after - before) / 1e6:.0f} MB more resident after the unload"
    with LLM(smollm2, **options) as llm:
        want = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0].text
    assert answer.message.content == want


def test_the_packaged_models_side_by_side(packaged_model, minilm, tmp_path):
    """The issue's four: SmolLM2, Qwen2.5-Coder-0.5B and Gemma 3 270M (packed, as `serve` runs them)
    and all-MiniLM-L6-v2 in one --models-dir, each answering as its own `LLM`; then, under a budget
    below two of them, alternating requests evict and reload and every answer stays right."""
    aliases = ("smollm2", "qwen2.5-coder-0.5b", "gemma3-270m")
    d = tmp_path / "models"
    d.mkdir()
    for alias in aliases:
        (d / f"{alias}.gguf").symlink_to(packaged_model(alias))
    (d / "minilm").symlink_to(minilm)
    options = dict(max_num_seqs=2, max_model_len=512, kv_cache_memory_gb=0.02)
    messages = [{"role": "user", "content": "Name one prime number."}]
    want, sizes = {}, {}
    for alias in aliases:
        with LLM(str(d / f"{alias}.gguf"), **options) as llm:
            want[alias] = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
            sizes[alias] = model_bytes(llm)
    with LLM(str(minilm)) as llm:
        vector = llm.embed(["a prime number"])[0]
    sources = [s for s in catalog([], str(d)) if s.name in (*aliases, "minilm")]

    def load(source: ModelSource) -> LLM:
        return LLM(source.model, **({} if source.name == "minilm" else options))

    def chat(url: str, model: str) -> str:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        return client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                              temperature=0).choices[0].message.content

    with served(sources, load) as (url, _):
        for alias in aliases:
            assert chat(url, alias) == want[alias], alias
            answer = ollama.Client(host=url).chat(model=alias, messages=messages,
                                                  options={"temperature": 0, "num_predict": 12})
            assert answer.message.content == want[alias], alias
        got = openai.OpenAI(base_url=f"{url}/v1", api_key="x").embeddings.create(model="minilm", input="a prime number")
        assert torch.allclose(torch.tensor(got.data[0].embedding), torch.tensor(vector), atol=1e-5)
        assert loaded(url) == sorted(f"{n}:latest" for n in (*aliases, "minilm"))
    pair = ("smollm2", "gemma3-270m")
    loads = Loads(load=load)
    with served(sources, loads, max_memory_bytes=int(max(sizes[n] for n in pair) * 1.3)) as (url, _):
        for alias in (*pair, *pair):
            assert chat(url, alias) == want[alias], alias
            assert loaded(url) == [f"{alias}:latest"]
    assert loads.count == {"smollm2": 2, "gemma3-270m": 2}
