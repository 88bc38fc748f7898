"""The GGUF writer agrees with llama.cpp's conventions, as transformers' GGUF loader reads them."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_models import TinyModel

from wallbreaker.config import ModelConfig
from wallbreaker.formats.gguf_writer import write_gguf
from wallbreaker.formats.names import llama_permute

Q = gguf.GGMLQuantizationType
TEXTS = [
    "Hello, world! How are you today?",
    " leading space,  double  spaces\tand\ttabs\n\nnew lines",
    "numbers 12345 and 3.14159, it's 12:30",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "café naïve 日本語 🙂",
    "IT'S DON'T\tand\tthe\ttab. Years 2024, 12345678.\nEach line ends here.\n(and this)",
]


@pytest.fixture(params=["llama", "qwen2", "gemma3"])
def tiny(request: pytest.FixtureRequest) -> TinyModel:
    return request.getfixturevalue(f"tiny_{request.param}")


@pytest.fixture
def allow_gguf_without_accelerate(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers refuses GGUF files unless `accelerate` is installed, which it does not use for
    these float32 CPU loads; the test environment has no `accelerate`."""
    import transformers.modeling_utils

    monkeypatch.setattr(transformers.modeling_utils, "is_accelerate_available", lambda: True)


def _field(reader: gguf.GGUFReader, key: str):
    field = reader.get_field(key)
    assert field is not None, key
    return field.contents()


def _transformers_from_gguf(tiny: TinyModel) -> torch.nn.Module:
    """transformers' reading of the GGUF, plus the Gemma 3 keys its loader ignores.

    transformers' GGUF config mapping for gemma3 takes neither the sliding pattern, the local RoPE
    base nor the attention scale (llama.cpp hardcodes all three); they are read back from the file.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, name = tiny.gguf_path.parent, tiny.gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if tiny.arch == "gemma3":
        reader = gguf.GGUFReader(tiny.gguf_path)
        pattern = _field(reader, "gemma3.attention.sliding_window_pattern")
        config.layer_types = ["sliding_attention" if s else "full_attention" for s in pattern]
        config.rope_parameters["sliding_attention"]["rope_theta"] = _field(reader, "gemma3.rope.freq_base_swa")
        config.query_pre_attn_scalar = round(_field(reader, "gemma3.attention.scale") ** -2)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32).eval()


@pytest.mark.usefixtures("allow_gguf_without_accelerate")
def test_transformers_reads_written_gguf_as_the_hf_model(tiny: TinyModel) -> None:
    ids = torch.randint(3, tiny.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = tiny.load_hf()(ids).logits
        got = _transformers_from_gguf(tiny)(ids).logits
    assert want.std() > 0.5
    assert (got - want).abs().max().item() < 1e-4


def test_transformers_builds_the_same_tokenizer_from_gguf(tiny: TinyModel) -> None:
    from transformers import AutoTokenizer

    from_gguf = AutoTokenizer.from_pretrained(tiny.gguf_path.parent, gguf_file=tiny.gguf_path.name)
    from_hf = AutoTokenizer.from_pretrained(tiny.hf_dir)
    # GemmaTokenizer, which transformers picks for gemma3 files, appends its own "<mask>" token
    vocab = {token: i for token, i in from_gguf.get_vocab().items() if i < tiny.config.vocab_size}
    assert vocab == from_hf.get_vocab() and len(vocab) == tiny.config.vocab_size
    for text in TEXTS:
        assert from_gguf(text).input_ids == from_hf(text).input_ids, text
    assert from_gguf.chat_template == from_hf.chat_template


def _tiny_config(arch: str = "llama") -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_1, Q.F16, Q.BF16])
def test_quantized_tensor_round_trip(tmp_path: Path, qtype: Q) -> None:
    x = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))
    norm = 1 + 0.1 * torch.randn(64)
    path = write_gguf(tmp_path / "q.gguf", _tiny_config(), {"blk.0.ffn_up.weight": x, "blk.0.attn_norm.weight": norm},
                      {}, tensor_types={"blk.0.ffn_up.weight": qtype, "blk.0.attn_norm.weight": qtype})

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    up = tensors["blk.0.ffn_up.weight"]
    assert up.tensor_type == qtype
    want = gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), qtype), qtype)
    np.testing.assert_array_equal(gguf.quants.dequantize(up.data, qtype).reshape(96, 64), want)
    assert tensors["blk.0.attn_norm.weight"].tensor_type == Q.F32
    np.testing.assert_array_equal(tensors["blk.0.attn_norm.weight"].data, norm.numpy())
    assert _field(reader, "general.file_type") == {
        Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
        Q.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
        Q.BF16: gguf.LlamaFileType.MOSTLY_BF16,
    }[qtype]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q_and_k_are_permuted_only_for_llama(tmp_path: Path, arch: str) -> None:
    config = _tiny_config(arch)
    q, k = torch.randn(64, 64), torch.randn(32, 64)
    path = write_gguf(tmp_path / "p.gguf", config, {"blk.0.attn_q.weight": q, "blk.0.attn_k.weight": k}, {})
    stored = {t.name: torch.from_numpy(np.array(t.data)) for t in gguf.GGUFReader(path).tensors}
    if arch == "llama":
        q, k = llama_permute(q, config.num_heads), llama_permute(k, config.num_kv_heads)
    assert torch.equal(stored["blk.0.attn_q.weight"], q)
    assert torch.equal(stored["blk.0.attn_k.weight"], k)


def test_rejects_unknown_names_and_unsupported_types(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not canonical"):
        write_gguf(tmp_path / "a.gguf", _tiny_config(), {"model.embed_tokens.weight": torch.zeros(64, 64)}, {})
    with pytest.raises(ValueError, match="Q4_K"):
        write_gguf(tmp_path / "b.gguf", _tiny_config(), {"blk.0.ffn_up.weight": torch.zeros(96, 256)}, {},
                   tensor_types={"blk.0.ffn_up.weight": Q.Q4_K})
