"""The roofline accounting, the machine profile cache, and the `roofline` and `bench` verbs (no timing
assertions: this machine is shared)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from wallbreaker import LLM
from wallbreaker.layers.linear import module_bytes
from wallbreaker.measure.machine import MachineProfile, Sample, load_profile, measure, store_profile
from wallbreaker.measure.roofline import decode_bound_tokens_per_s, decode_cost_of, llm_cost, request_roofline_fraction

BANDWIDTH = 27e9
FLOPS = {"float32": 1.5e11, "bfloat16": 4e11, "q4": 2e11, "q8": 2e11}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache folder, so no test reads or overwrites the real machine.json."""
    monkeypatch.setenv("WALLBREAKER_CACHE", str(tmp_path))
    return tmp_path


def stored(bandwidth: float = BANDWIDTH) -> MachineProfile:
    threads = str(torch.get_num_threads())
    profile = MachineProfile(bandwidth={threads: {"read": Sample(bandwidth, bandwidth * 0.8),
                                                  "copy": Sample(bandwidth, bandwidth * 0.8)}},
                             flops={k: Sample(v, v) for k, v in FLOPS.items()}, buffer_mib=512)
    store_profile(profile)
    return profile


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wallbreaker.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_smollm2_decode_bytes_are_resident_weights_plus_kv_arithmetic(packaged_model):
    packaged_model("smollm2")
    llm = LLM(None, max_num_seqs=2, max_model_len=256)
    cost = llm_cost(llm)
    kv_itemsize = llm.kv_cache.tensor.element_size()
    per_position = 30 * 2 * 3 * 64 * kv_itemsize  # layers x K,V x KV heads x head dim
    assert cost.weight_bytes == module_bytes(llm.model)  # tied table: read in full as the head
    assert cost.row_bytes == 0
    for batch, context in ((1, 128), (8, 1024), (64, 4096)):
        assert cost.bytes_per_step(batch, context) == module_bytes(llm.model) + batch * context * per_position


def test_an_untied_embedding_table_is_read_by_rows(tiny_llama):
    llm = LLM(str(tiny_llama.gguf_path), dtype="float32", max_num_seqs=2)
    cfg = tiny_llama.config
    assert not cfg.tie_word_embeddings
    cost = decode_cost_of(llm.model, torch.float32)
    table = cfg.vocab_size * cfg.hidden_size * 4
    assert cost.weight_bytes == module_bytes(llm.model) - table
    assert cost.row_bytes == cfg.hidden_size * 4
    assert cost.bytes_per_step(3, 0) - cost.bytes_per_step(1, 0) == 2 * cost.row_bytes
    assert cost.params == sum(m.weight.numel() for m in llm.model.modules()
                              if type(m).__name__ == "Linear")


def test_a_mixture_of_experts_reads_only_its_active_experts(tiny_of):
    """Qwen3-MoE's 2 of 4 experts: half the expert bytes at batch 1, all of them for a large batch;
    each token multiplies half the expert weights."""
    llm = LLM(str(tiny_of("qwen3moe").gguf_path), dtype="float32", max_num_seqs=2)
    cost = decode_cost_of(llm.model, torch.float32)
    experts = [e for layer in llm.model.layers for e in (*layer.mlp.gate_up, *layer.mlp.down)]
    assert cost.experts == (4, 2) and cost.expert_bytes == sum(module_bytes(e) for e in experts) > 0
    assert cost.bytes_per_step(1, 0) == pytest.approx(cost.weight_bytes - cost.expert_bytes / 2 + cost.row_bytes)
    assert cost.weights_read(64) == pytest.approx(cost.weight_bytes)
    expert_params = sum(e.weight.numel() for e in experts)
    assert cost.params == pytest.approx(sum(m.weight.numel() for m in llm.model.modules()
                                            if type(m).__name__ == "Linear") - expert_params / 2)


def test_inspect_shows_experts_and_the_bytes_a_token_reads(tiny_of):
    info = json.loads(run_cli("inspect", str(tiny_of("qwen3moe").gguf_path), "--json").stdout)
    assert (info["experts"], info["experts_active_per_token"]) == (4, 2)
    assert info["weight_bytes_read_per_token"] == pytest.approx(
        info["weight_bytes_stored"] - info["expert_bytes_stored"] / 2 - 512 * 64 * 4, rel=1e-9)  # the untied table: by rows


def test_the_bound_grows_with_batch_and_falls_with_context(tiny_llama):
    llm = LLM(str(tiny_llama.gguf_path), max_num_seqs=2)
    cost = llm_cost(llm)
    for context in (1, 128, 1024, 4096):
        bounds = [cost.bound(BANDWIDTH, FLOPS, b, context) for b in (1, 2, 4, 8, 16, 32, 64)]
        assert bounds == sorted(bounds)
    for batch in (1, 8, 64):
        bounds = [cost.bound(BANDWIDTH, FLOPS, batch, c) for c in (1, 128, 1024, 4096)]
        assert bounds == sorted(bounds, reverse=True)
    crossover = cost.crossover_batch(BANDWIDTH, FLOPS, 128)
    if crossover is not None:
        compute = cost.compute_bound(FLOPS, 128)
        assert cost.memory_bound(BANDWIDTH, crossover, 128) == pytest.approx(compute)


def test_roofline_fraction_needs_a_stored_bandwidth(tiny_llama, cache):
    llm = LLM(str(tiny_llama.gguf_path), max_num_seqs=2)
    metrics = {"num_prompt_tokens": 10, "num_generated_tokens": 20, "decode_tokens_per_s": 50.0}
    assert request_roofline_fraction(llm, metrics) is None
    assert decode_bound_tokens_per_s(llm, 1, 20) is None
    stored()
    bound = decode_bound_tokens_per_s(llm, 1, 20)
    assert bound == pytest.approx(llm_cost(llm).bound(BANDWIDTH, FLOPS, 1, 20))
    assert request_roofline_fraction(llm, metrics) == pytest.approx(50.0 / bound)
    assert request_roofline_fraction(llm, {**metrics, "decode_tokens_per_s": 0.0}) is None


def test_machine_profile_round_trips_through_its_json(cache):
    profile = measure([1], buffer_mib=4, repeats=1, gemm_size=64)
    assert profile.read_bandwidth(1) > 0 and set(profile.flops) == {"float32", "bfloat16", "q4", "q8",
                                                                    "attention_float32", "attention_bfloat16"}
    store_profile(profile)
    again = load_profile()
    assert again.to_json() == profile.to_json()


@pytest.mark.slow
def test_inspect_shows_the_decode_bound_once_a_bandwidth_is_stored(tiny_llama, cache):
    env = {"WALLBREAKER_CACHE": str(cache)}
    assert "decode bound" not in run_cli("inspect", str(tiny_llama.gguf_path), env=env).stdout
    stored()
    result = run_cli("inspect", str(tiny_llama.gguf_path), "--json", env=env)
    info = json.loads(result.stdout)
    assert info["decode_bound_tokens_per_s"]["batch 1"]["context 128"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("verb", ["roofline", "bench"])
def test_verb_help_works(verb):
    result = run_cli(verb, "--help")
    assert result.returncode == 0, result.stderr
    assert "--model" in result.stdout


def test_roofline_verb_prints_bounds_and_the_fraction_reached(tiny_llama, cache):
    result = run_cli("roofline", "--model", str(tiny_llama.gguf_path), "--buffer-mib", "4", "--repeats", "1",
                     "--gemm-size", "64", "--prompt-tokens", "8", "--decode-tokens", "4",
                     "--json", str(cache / "roofline.json"), env={"WALLBREAKER_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    assert "Memory bound" in result.stdout and "of the batch-1 bound" in result.stdout
    assert "Kernel tuning (" in result.stdout  # this CPU's key, and the picks (here: off)
    assert not (cache / "machine.json").exists()  # cache-sized buffers are not stored
    report = json.loads((cache / "roofline.json").read_text())
    assert report["run"]["roofline_fraction"] > 0


def test_bench_smoke_run_writes_json_and_a_plot(tiny_llama, cache):
    out, png = cache / "bench.json", cache / "bench.png"
    result = run_cli("bench", "--model", str(tiny_llama.gguf_path), "--runs", "1", "--baselines", "none",
                     "--prefill-tokens", "16", "--decode-tokens", "4", "--decode-prompt-tokens", "4",
                     "--concurrency", "2", "--concurrent-prompt-tokens", "8", "--concurrent-tokens", "4",
                     "--json", str(out), "--plot", str(png), env={"WALLBREAKER_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    medians = report["medians"]["wallbreaker"]
    assert {"prefill_tps", "ttft_ms", "decode_tps", "gen_tps@2", "decode_tps@2"} <= set(medians)
    assert all(v > 0 for v in medians.values())
    assert png.stat().st_size > 0
    assert "| decode tokens/s (batch 1)" in result.stdout


def test_llama_speculative_summary_is_parsed():
    from wallbreaker.measure.baselines.llama_cpp import parse_speculative
    log = ("encoded    9 tokens in    0.412 seconds, speed:   21.845 t/s\n"
           "decoded  130 tokens in    7.101 seconds, speed:   18.307 t/s\n\n"
           "n_draft   = 3\nn_predict = 130\nn_drafted = 99\nn_accept  = 96\naccept    = 96.970%\n")
    parsed = parse_speculative(log)
    assert parsed["decode_tokens_per_s"] == pytest.approx(18.307)
    assert parsed["acceptance_rate"] == pytest.approx(96 / 99)


def test_inspect_describes_an_encoder_without_kv_or_decode_figures(tiny_bert_embedding, cache):
    """An encoder only pools: no KV cache, no decode bound, even with a bandwidth stored."""
    env = {"WALLBREAKER_CACHE": str(cache)}
    stored()
    text = run_cli("inspect", str(tiny_bert_embedding), env=env).stdout
    assert "an encoder: it pools (mean)" in text and "bytes per token" not in text and "decode bound" not in text
    info = json.loads(run_cli("inspect", str(tiny_bert_embedding), "--json", env=env).stdout)
    assert info["pooling"]["task"] == "embed" and "kv_bytes_per_token" not in info
    assert "decode_bound_tokens_per_s" not in info


def test_a_hybrids_state_is_counted_in_the_bytes_a_step_moves(tmp_path):
    """Granite-4.0-H (Mamba2 mixers beside attention): the cost counts K/V of its attention layers
    only, and each sequence's state twice (read, written anew), as large as the pool's slots are."""
    from tiny_mamba import granite_config, save_model
    from wallbreaker import LLM
    from wallbreaker.measure.roofline import llm_cost
    llm = LLM(str(save_model(granite_config(), tmp_path / "granite")), dtype="float32", kv_cache_memory_gb=0.05)
    cost = llm_cost(llm)
    cfg = llm.model_config
    assert 0 < cfg.num_attention_layers < cfg.num_layers
    assert len(cost.layer_windows) == cfg.num_attention_layers
    assert cost.state_bytes == llm.stats()["state_bytes_per_sequence"] > 0
    step = cost.bytes_per_step(2, 100)
    assert step == cost.weights_read(2) + 2 * (cost.row_bytes + cost.kv_bytes(100) + 2 * cost.state_bytes)
    assert cost.break_even_context == 2 * cost.state_bytes / cost.kv_bytes(1)


@pytest.mark.real_model
def test_roofline_on_smollm2_never_reports_a_run_above_its_bound(packaged_model, cache):
    """The compute bound printed with the prefill was one 2048^3 product's rate, timed beside a busy
    neighbour and counting the output head for every prompt token: a prefill reached 101-183% of it.
    The prefill bound is now the prompt's own products timed at its shapes, the best of many trials."""
    import re
    packaged_model("smollm2")
    result = run_cli("roofline", "--buffer-mib", "256", "--repeats", "3", "--gemm-size", "512",
                     "--prompt-tokens", "128", "--decode-tokens", "16", "--no-store",
                     "--json", str(cache / "roofline.json"), env={"WALLBREAKER_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    percents = [int(p) for p in re.findall(r"(\d+)% of the", result.stdout)]
    assert len(percents) == 2 and all(0 < p <= 100 for p in percents), result.stdout
    run = json.loads((cache / "roofline.json").read_text())["run"]
    assert 0 < run["roofline_fraction"] <= 1 and 0 < run["prefill_bound_fraction"] <= 1
    assert run["prefill_bound_tokens_per_s"] >= run["prefill_tokens_per_s"]
