"""Tiny random-weight recurrent and hybrid models (LFM2, Granite-4.0-H, Mamba2, Qwen3-Next, Mamba,
Falcon-Mamba), built by transformers from a config, written as a Hugging Face folder with SmolLM2's
tokenizer (one that llama.cpp's converter knows), and converted to GGUF by llama.cpp's own
`convert_hf_to_gguf.py`; and the checks against transformers that every architecture's tests share.
Each architecture's folder is built once a session (conftest.py's `recurrent_folder`); the engine's
behaviours on them are tests/test_recurrent_engine.py."""
from __future__ import annotations

from pathlib import Path

import torch

from wallbreaker import LLM, SamplingParams
from wallbreaker.formats.packaged import packaged_model_path

VOCAB = 49152  # SmolLM2's
TEXT = ("A recurrent layer keeps a fixed-size state per sequence instead of a cache that grows with the context; "
        "the quick brown fox jumps over the lazy dog. def main(): return x + y, and a paged cache keeps keys "
        "and values in fixed blocks so that many sequences share one pool.")
PROMPTS = ["The quick brown fox", "Once upon a time there was"]
GREEDY_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
TIE = 1e-3  # the reference's top two logits this close: either token is right


def smollm2_tokenizer():
    """SmolLM2's tokenizer as transformers builds it from the embedded GGUF."""
    from transformers import AutoTokenizer
    gguf = packaged_model_path("smollm2")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def save_random_model(hf_config, out: Path, seed: int = 0) -> Path:
    """A random-weight model of `hf_config` (a transformers config with vocab_size VOCAB) saved with
    SmolLM2's tokenizer into `out`. Norm weights are moved away from their initial values so that
    a norm left out shows in the logits."""
    from transformers import AutoModelForCausalLM
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    smollm2_tokenizer().save_pretrained(tmp)
    tmp.rename(out)
    return out


def load_reference(folder: Path):
    """transformers' model from `folder`, float32, on its own torch path: refused where a fused-kernel
    package is importable, which transformers would run instead."""
    from transformers import AutoModelForCausalLM
    assert no_fused_kernels() == [], "a fused-kernel package would replace the reference's torch path"
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def no_fused_kernels() -> list[str]:
    """The fused-kernel packages transformers would prefer over its torch path, where importable."""
    import importlib.util
    return [m for m in ("mamba_ssm", "causal_conv1d", "fla") if importlib.util.find_spec(m) is not None]


ARCHITECTURES = ("lfm2", "granite", "mamba2", "qwen3_next", "mamba", "falcon_mamba")


def save_tiny_model(arch: str, out: Path) -> Path:
    """The tiny random model of `arch` (one of ARCHITECTURES) as a Hugging Face folder in `out`."""
    if arch in ("granite", "mamba2", "mamba", "falcon_mamba"):
        import tiny_mamba  # it imports this module
        configs = {"granite": tiny_mamba.granite_config, "mamba2": tiny_mamba.mamba2_config,
                   "mamba": tiny_mamba.mamba_config, "falcon_mamba": tiny_mamba.falcon_mamba_config}
        return tiny_mamba.save_model(configs[arch](), out)
    return save_random_model(tiny_config(arch), out)


def tiny_config(model_type: str):
    """A tiny transformers config of `model_type` at hidden size 64, with SmolLM2's vocabulary
    (the Mamba2 family's, with Granite's variants, live in tiny_mamba.py).

    lfm2: two convolutions and two attention layers; an FFN width that `block_auto_adjust_ff_dim`
    changes (2/3 of 300 = 200, rounded up to 224), so that a loader ignoring it fails."""
    import transformers as tf
    if model_type == "lfm2":
        return tf.Lfm2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=300, block_multiple_of=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            layer_types=["conv", "full_attention", "conv", "full_attention"], tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if model_type == "qwen3_next":
        return tf.Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_experts=4, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
            partial_rotary_factor=0.25, max_position_embeddings=512)
    raise ValueError(model_type)


def assert_greedy_matches(model, prompt: list[int], ours: list[int]) -> None:
    """`ours` is the reference's greedy continuation, up to a tie: at the first token that differs,
    the reference's two best logits must be within TIE of each other."""
    ids = list(prompt)
    with torch.no_grad():
        for i, token in enumerate(ours):
            top = torch.topk(model(torch.tensor([ids])).logits[0, -1], 2)
            if token != int(top.indices[0]):
                assert float(top.values[0] - top.values[1]) < TIE and token == int(top.indices[1]), \
                    f"token {i}: ours {token}, transformers {int(top.indices[0])} (not a tie)"
                return
            ids.append(token)


def logits_error(llm: LLM, reference, ids: list[int]) -> float:
    """Our float32 logits against transformers', relative to the range of theirs."""
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    return ((llm.logits(ids) - expected).abs().max() / (expected.max() - expected.min())).item()


def assert_matches_reference(llm: LLM, reference, ids: list[int]) -> None:
    """Our float32 logits over `ids` are the reference's (to 1e-4 of their range), and the greedy
    tokens after each of PROMPTS its greedy tokens, up to a tie."""
    assert logits_error(llm, reference, ids) < 1e-4
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    for p, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)):
        assert len(out.outputs[0].token_ids) == GREEDY_TOKENS
        assert_greedy_matches(reference, p, out.outputs[0].token_ids)


def assert_generates(llm: LLM) -> None:
    """PROMPTS, as text, each get GREEDY_TOKENS tokens (a quantized model: it runs, not that it matches)."""
    assert [len(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)] == [GREEDY_TOKENS] * len(PROMPTS)


def assert_any_chunking_gives_one_pass_logits(llm: LLM, ids: list[int], chunks: tuple[int, ...] = (1, 5, 7)) -> None:
    full = llm.logits(ids)
    for chunk in chunks:
        assert (llm.logits(ids, chunk_size=chunk) - full).abs().max().item() < 1e-4, chunk


# -- engines on the tiny models -------------------------------------------------------------------
def make_llm(path: Path | str, **options) -> LLM:
    return LLM(str(path), **{"dtype": "float32", "kv_cache_memory_gb": 0.05, **options})


def holds_only_checkpoints(llm: LLM) -> bool:
    """Once every request is done, the only state slots taken are the prefix cache's checkpoints."""
    stats = llm.stats()
    return stats["state_slots_used"] == stats["state_checkpoints"]


def run_mixer(mixer, x: torch.Tensor, spans: list) -> torch.Tensor:
    """A recurrent mixer over rows `x` with these StateSpans as its step's state metadata."""
    from types import SimpleNamespace
    from wallbreaker.layers.recurrent import StateMetadata
    return mixer(x, SimpleNamespace(state=StateMetadata(spans)))


def mixer_reference_output(theirs, x: torch.Tensor) -> torch.Tensor:
    """transformers' mixer over the rows `x` as one sequence."""
    with torch.no_grad():
        return theirs(x[None])[0]


def assert_mixer_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Within 1e-5 of the reference's largest magnitude."""
    assert ours.shape == theirs.shape
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-5
