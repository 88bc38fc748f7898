"""Tensor parallelism on gloo, with worker processes on this machine: the same greedy tokens and
logits as one process; weights read in slices; a dead worker fails the engine, naming its rank,
and leaves no process behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import gguf
import psutil
import pytest
import torch
from test_dequant import random_bytes

from wallbreaker import LLM, SamplingParams
from wallbreaker.config import ModelConfig
from wallbreaker.errors import InvalidRequestError
from wallbreaker.formats import open_model
from wallbreaker.formats.gguf_file import GGUFTensor
from wallbreaker.formats.gguf_model import _weight_ref
from wallbreaker.layers.linear import QuantLinear
from wallbreaker.layers.parallel import RowParallelLinear
from wallbreaker.layers.shard import check_splittable, even_range, head_shard

Q = gguf.GGMLQuantizationType
PROMPTS = ["The quick brown fox", "Hello, world! How are", "Numbers: 0 1 2 3", "Once upon a time there",
           "def main(): return", "Unicode: café, naïve", "The attention of each head", "IT'S LOUD, DON'T"]
TEXT = "A paged cache keeps keys and values in fixed blocks, so that many sequences can share one pool."
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
FORKED = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)  # copy-on-write of a shared tail
MIXED = [GREEDY] * 6 + [FORKED] * 2


@pytest.fixture(autouse=True)
def one_thread():
    """One thread per process, as each rank gets on 2 cores: OpenMP threads on a machine shared with
    other test runs can slow the single-process reference a hundredfold."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run(llm: LLM, params: list[SamplingParams]) -> tuple[list[list[list[int]]], torch.Tensor]:
    outs = llm.generate(PROMPTS, params)
    return [[c.token_ids for c in o.outputs] for o in outs], llm.logits(TEXT)


def assert_same_as_one_process(model, tp: int, params: list[SamplingParams] = MIXED, **options) -> None:
    tokens, logits = run(LLM(model, dtype="float32", **options), params)
    with LLM(model, dtype="float32", tensor_parallel_size=tp, **options) as llm:
        tp_tokens, tp_logits = run(llm, params)
    assert tp_tokens == tokens
    torch.testing.assert_close(tp_logits, logits, rtol=0, atol=1e-4)


# -- which rows and columns a rank holds --------------------------------------------------------
def test_uneven_kv_heads_split_by_whole_query_groups():
    # SmolLM2: 9 query heads in 3 groups over 2 ranks -> 1 + 2 KV heads, each with its 3 query heads
    shards = [head_shard(9, 3, r, 2) for r in range(2)]
    assert [(s.q, s.kv) for s in shards] == [(range(0, 3), range(0, 1)), (range(3, 9), range(1, 3))]


def test_fewer_kv_heads_than_ranks_are_replicated():
    shards = [head_shard(4, 2, r, 4) for r in range(4)]
    assert [s.kv for s in shards] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [s.q for s in shards] == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    shards = [head_shard(4, 2, r, 3) for r in range(3)]  # KV head 0 on two ranks, KV head 1 on one
    assert [(s.q, s.kv) for s in shards] == [(range(0, 1), range(0, 1)), (range(1, 2), range(0, 1)),
                                             (range(2, 4), range(1, 2))]


def test_more_ranks_than_heads_is_a_clear_error():
    cfg = ModelConfig("llama", 512, 64, 128, 2, 4, 2, 16)
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size=8"):
        check_splittable(cfg, 8)


def test_even_splits_keep_block_boundaries():
    assert [even_range(1536, 2, r, 32) for r in range(2)] == [range(0, 768), range(768, 1536)]
    assert [even_range(96, 2, r, 32) for r in range(2)] == [range(0, 32), range(32, 96)]
    assert [even_range(10, 3, r, 32) for r in range(3)] == [range(0, 3), range(3, 6), range(6, 10)]


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K])
def test_gguf_slices_equal_the_slice_of_the_whole(qtype):
    cfg = ModelConfig("llama", 100, 64, 128, 1, 4, 2, 16)
    raw = random_bytes(qtype, 64, 512).reshape(-1)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight"):  # q rows are un-permuted per head
        ref = _weight_ref(GGUFTensor(name, qtype, (64, 512), raw), cfg)
        full = ref.load()
        assert torch.equal(ref.load_slice(0, 16, 48), full[16:48])
        for lo, hi in [(64, 320), (256, 512), (40, 100)]:  # on block boundaries, and not
            assert torch.equal(ref.load_slice(1, lo, hi), full[:, lo:hi])
        if ref.blocks is not None:  # the stored blocks the kernels read: rows, and whole-block columns
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            blocks = ref.blocks()
            assert torch.equal(ref.blocks_part(0, 16, 48), blocks[16:48])
            assert torch.equal(ref.blocks_part(1, 256, 512), blocks[:, 256 // block * size:])
            assert ref.blocks_part(1, 40, 100) is None  # cuts a block: the caller requantizes


def test_safetensors_slices_equal_the_slice_of_the_whole(tiny_qwen2):
    weights = open_model(tiny_qwen2.hf_dir).weights
    for name in ("blk.0.attn_q.weight", "blk.0.attn_q.bias", "output_norm.weight"):
        full = weights[name].load()
        assert torch.equal(weights[name].load_slice(0, 16, 48), full[16:48])
    full = weights["blk.1.ffn_down.weight"].load()
    assert torch.equal(weights["blk.1.ffn_down.weight"].load_slice(1, 32, 96), full[:, 32:96])


# -- two ranks against one process ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_two_ranks_give_the_same_tokens_and_logits(arch, request):
    tiny = request.getfixturevalue(f"tiny_{arch}")
    assert_same_as_one_process(tiny.gguf_path, 2)


def test_experts_split_by_columns_give_the_same_tokens_and_logits(tiny_of):
    """Every rank holds its share of every expert's FFN columns; one all-reduce sums the experts."""
    assert_same_as_one_process(tiny_of("qwen3moe").gguf_path, 2)


@pytest.mark.slow
def test_mixtral_folder_splits_its_experts(tiny_of):
    assert_same_as_one_process(tiny_of("mixtral").hf_dir, 2)


def test_hugging_face_folder_loads_in_slices(tiny_qwen2):
    assert_same_as_one_process(tiny_qwen2.hf_dir, 2)


@pytest.mark.parametrize("arch", ["lfm2", "granite"])
def test_hybrid_models_split_their_recurrent_layers(recurrent_folder, arch):
    """LFM2's convolutions by channels, Granite-4.0-H's Mamba2 heads by whole groups (2 over 2 ranks);
    every rank's state pool holds its share of each state under the same slots (forks share one)."""
    assert_same_as_one_process(recurrent_folder(arch), 2)


def test_a_mamba2_group_split_across_ranks_is_normed_across_them(tmp_path):
    """One group of B and C for 8 heads: each rank holds 4 heads, and the gated norm over the group's
    channels sums its squares across both."""
    from tiny_mamba import granite_config, save_model
    assert_same_as_one_process(save_model(granite_config(mamba_n_groups=1), tmp_path / "hf"), 2, GREEDY)


@pytest.mark.slow
def test_three_ranks_replicate_the_kv_heads(tiny_llama):
    assert_same_as_one_process(tiny_llama.gguf_path, 3)  # 2 KV heads over 3 ranks, query heads 1 + 1 + 2


def test_packed_weights_keep_their_block_shards_and_their_accuracy(tiny_llama):
    path = tiny_llama.quantized_gguf(Q.Q4_0)
    reference = torch.log_softmax(LLM(path, dtype="float32").logits(TEXT), -1)

    def kl(logits: torch.Tensor) -> float:
        return float((reference.exp() * (reference - torch.log_softmax(logits, -1))).sum(-1).mean())

    one = kl(LLM(path, dtype="auto").logits(TEXT))
    with LLM(path, dtype="auto", tensor_parallel_size=2) as llm:
        layer = llm.model.layers[0]
        assert isinstance(layer.mlp.down, RowParallelLinear) and isinstance(layer.mlp.down.inner, QuantLinear)
        assert isinstance(layer.attn.qkv, QuantLinear) and layer.attn.qkv.qtypes == [int(Q.Q4_0)] * 3
        two = kl(llm.logits(TEXT))
    assert two < 2 * one + 1e-4  # partial sums differ from one process's, but are no less accurate


def test_smollm2_two_ranks_match_one_process(packaged_model):
    packaged_model("smollm2")  # 9 query heads, 3 KV heads: ranks hold 1 and 2 KV heads
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert_same_as_one_process(None, 2, [greedy] * len(PROMPTS), max_model_len=128)


# -- front doors ---------------------------------------------------------------------------------
def test_cli_flag_runs_two_ranks(tiny_llama, capsys):
    from wallbreaker.cli import main
    argv = ["generate", "-m", str(tiny_llama.gguf_path), "--dtype", "float32", "--max-tokens", "6", "--json",
            PROMPTS[0]]
    assert main(argv) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(argv + ["--tensor-parallel-size", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == one["token_ids"]


@pytest.mark.slow
def test_server_is_a_drop_in(tiny_llama):
    pytest.importorskip("fastapi")
    from server_apps import app_client

    from wallbreaker.server.app import build_app
    body = {"model": "default", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
    expected = LLM(tiny_llama.gguf_path, dtype="float32").generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6))
    with LLM(tiny_llama.gguf_path, dtype="float32", tensor_parallel_size=2, max_model_len=64) as llm:
        with app_client(build_app(llm)) as client:
            response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected[0].outputs[0].text


@pytest.mark.slow
def test_torchrun_makes_rank_0_the_engine(tiny_llama):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "wallbreaker.cli", "generate", "-m", str(tiny_llama.gguf_path), "--dtype", "float32",
           "--max-tokens", "6", "--json", "--tensor-parallel-size", "2", PROMPTS[0]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # only rank 0 prints
    expected = LLM(tiny_llama.gguf_path, dtype="float32").generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6))
    assert lines[0]["token_ids"] == expected[0].outputs[0].token_ids


# -- failures ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_idle_engine_outlives_the_collective_timeout(tiny_llama):
    with LLM(tiny_llama.gguf_path, dtype="float32", tensor_parallel_size=2, tensor_parallel_timeout_s=1.0) as llm:
        first = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids
        time.sleep(2.5)  # workers wait for the next step on the control group, which has no such timeout
        assert llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids == first


KILL_SCRIPT = textwrap.dedent("""
    import sys
    from wallbreaker import LLM, SamplingParams, WallbreakerError
    try:
        llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=3, tensor_parallel_timeout_s=float(sys.argv[2]))
        while True:
            for delta in llm.stream("The quick brown fox", SamplingParams(max_tokens=400, ignore_eos=True)):
                print("token", flush=True)
    except WallbreakerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
""")


@pytest.mark.slow
def test_killed_worker_fails_the_engine_naming_it_and_leaves_no_process(tiny_llama, tmp_path):
    timeout = 10.0
    script = tmp_path / "generate_forever.py"
    script.write_text(KILL_SCRIPT)
    engine = subprocess.Popen([sys.executable, str(script), str(tiny_llama.gguf_path), str(timeout)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline().strip() == "token"  # generating
        workers = psutil.Process(engine.pid).children()
        ranks = {int(p.cmdline()[p.cmdline().index("--rank") + 1]): p for p in workers}
        assert sorted(ranks) == [1, 2]
        killed_at = time.monotonic()
        os.kill(ranks[1].pid, signal.SIGKILL)
        _, err = engine.communicate(timeout=timeout + 20)
        elapsed = time.monotonic() - killed_at
    finally:
        if engine.poll() is None:
            engine.kill()
    assert engine.returncode == 1
    assert "worker rank 1 was killed by SIGKILL" in err
    assert elapsed < timeout
    time.sleep(0.5)
    assert not [p.pid for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_two_ranks_on_int8_pages_give_the_same_tokens(tiny_of, kind):
    """Each rank quantizes its own KV heads' pages, per token and head as one process does, less its
    own heads' biases (qwen2)."""
    assert_same_as_one_process(tiny_of(kind).gguf_path, 2, kv_cache_dtype="int8")
