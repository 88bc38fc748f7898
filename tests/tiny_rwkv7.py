"""A tiny random-weight RWKV-7 made as BlinkDL's `.pth` state dict (what PyPI `rwkv`, the reference,
loads) and written as the Hugging Face folder of fla-hub's `RWKV7ForCausalLM` layout (what llama.cpp's
converter reads), with SmolLM2's tokenizer (as wallbreaker writes it); and that converter's GGUF with SmolLM2's tokenizer in
place of the RWKV World one it writes, so that the folder (SmolLM2's tokenizer.json) and the GGUF encode alike
(the World tokenizer itself: tests/test_rwkv_world_tokenizer.py).

The BlinkDL -> fla mapping is this file's own; the reference's numbers come from `rwkv`'s forward. Every
builder takes an `Rwkv7Shape` (the tiny one by default), so benchmarks/hybrid_models.py makes a real-shape
model with the same code the tests check."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from tiny_recurrent import VOCAB

HIDDEN, HEAD, LAYERS, FFN = 64, 32, 2, 128
RANKS = {"w": 16, "a": 16, "v": 8, "g": 32}  # decay, in-context learning rate, value residual, gate
VOCAB_FILE = "rwkv_vocab_v20230424.txt"  # the converter requires it; it writes its first vocab - 1 lines


@dataclasses.dataclass(frozen=True)
class Rwkv7Shape:
    """An RWKV-7's sizes: width, head size, layers, FFN width, LoRA ranks (keys of RANKS), vocabulary."""
    hidden: int = HIDDEN
    head: int = HEAD
    layers: int = LAYERS
    ffn: int = FFN
    ranks: dict[str, int] = dataclasses.field(default_factory=lambda: dict(RANKS))
    vocab: int = VOCAB


TINY = Rwkv7Shape()


def blinkdl_state_dict(seed: int = 0, shape: Rwkv7Shape = TINY,
                       dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights in BlinkDL's names and shapes, at magnitudes like a trained model's (decays in
    (0, 1) spread out, mixes in [0, 1], a normalized key's scale near 1). Each tensor is drawn in float32
    and then cast to `dtype`, so a large shape in bfloat16 never holds its float32 copy whole."""
    g = torch.Generator().manual_seed(seed)
    C, H, N, FFN = shape.hidden, shape.hidden // shape.head, shape.head, shape.ffn

    def rand(*size, scale=1.0, shift=0.0):
        return (torch.randn(*size, generator=g) * scale + shift).to(dtype)

    def unit(*size):
        return torch.rand(*size, generator=g).to(dtype)

    sd = {"emb.weight": rand(shape.vocab, C, scale=0.5), "head.weight": rand(shape.vocab, C, scale=0.2),
          "ln_out.weight": rand(C, scale=0.1, shift=1.0), "ln_out.bias": rand(C, scale=0.1),
          "blocks.0.ln0.weight": rand(C, scale=0.1, shift=1.0), "blocks.0.ln0.bias": rand(C, scale=0.1)}
    for i in range(shape.layers):
        b, att, ffn = f"blocks.{i}.", f"blocks.{i}.att.", f"blocks.{i}.ffn."
        for ln in ("ln1", "ln2"):
            sd[b + ln + ".weight"], sd[b + ln + ".bias"] = rand(C, scale=0.1, shift=1.0), rand(C, scale=0.1)
        for x in "rwkvag":
            sd[att + "x_" + x] = unit(1, 1, C)
        for x, rank in shape.ranks.items():
            if x == "v" and i == 0:
                continue  # the first layer's value is v_first itself
            sd[att + x + "1"], sd[att + x + "2"] = rand(C, rank, scale=0.3), rand(rank, C, scale=0.3)
            if x != "g":
                sd[att + x + "0"] = rand(1, 1, C, scale=1.0, shift=-1.0 if x == "w" else 0.0)
        sd[att + "k_k"], sd[att + "k_a"] = unit(1, 1, C) * 0.5 + 0.5, unit(1, 1, C)
        sd[att + "r_k"] = rand(H, N, scale=0.3)
        for proj in ("receptance", "key", "value", "output"):
            sd[att + proj + ".weight"] = rand(C, C, scale=C ** -0.5)
        sd[att + "ln_x.weight"], sd[att + "ln_x.bias"] = rand(C, scale=0.1, shift=1.0), rand(C, scale=0.1)
        sd[ffn + "x_k"] = unit(1, 1, C)
        sd[ffn + "key.weight"], sd[ffn + "value.weight"] = rand(FFN, C, scale=C ** -0.5), rand(C, FFN, scale=FFN ** -0.5)
    return sd


def fla_state_dict(sd: dict[str, torch.Tensor], shape: Rwkv7Shape = TINY) -> dict[str, torch.Tensor]:
    """BlinkDL's names -> fla-hub's (LoRA pairs as nn.Linear weights, their bias the x0 vector)."""
    out = {"model.embeddings.weight": sd["emb.weight"], "lm_head.weight": sd["head.weight"],
           "model.norm.weight": sd["ln_out.weight"], "model.norm.bias": sd["ln_out.bias"],
           "model.layers.0.pre_norm.weight": sd["blocks.0.ln0.weight"],
           "model.layers.0.pre_norm.bias": sd["blocks.0.ln0.bias"]}
    for i in range(shape.layers):
        b, att, ffn, m = f"blocks.{i}.", f"blocks.{i}.att.", f"blocks.{i}.ffn.", f"model.layers.{i}."
        for ours, theirs in (("attn_norm", "ln1"), ("ffn_norm", "ln2"), ("attn.g_norm", "att.ln_x")):
            out[f"{m}{ours}.weight"], out[f"{m}{ours}.bias"] = sd[b + theirs + ".weight"], sd[b + theirs + ".bias"]
        for x in "rwkvag":
            out[f"{m}attn.x_{x}"] = sd[att + "x_" + x]
        for x in RANKS:
            if att + x + "1" not in sd:
                continue
            out[f"{m}attn.{x}_lora.lora.0.weight"] = sd[att + x + "1"].T.contiguous()
            out[f"{m}attn.{x}_lora.lora.2.weight"] = sd[att + x + "2"].T.contiguous()
            if x != "g":
                out[f"{m}attn.{x}_lora.lora.2.bias"] = sd[att + x + "0"].flatten()
        out[f"{m}attn.k_k"], out[f"{m}attn.k_a"] = sd[att + "k_k"].flatten(), sd[att + "k_a"].flatten()
        out[f"{m}attn.r_k"] = sd[att + "r_k"]
        for ours, theirs in (("r_proj", "receptance"), ("k_proj", "key"), ("v_proj", "value"), ("o_proj", "output")):
            out[f"{m}attn.{ours}.weight"] = sd[att + theirs + ".weight"]
        out[f"{m}ffn.x_k"] = sd[ffn + "x_k"]
        out[f"{m}ffn.key.weight"], out[f"{m}ffn.value.weight"] = sd[ffn + "key.weight"], sd[ffn + "value.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def fla_config(shape: Rwkv7Shape = TINY) -> dict:
    """config.json as fla-hub writes it for RWKV7ForCausalLM."""
    r = shape.ranks
    return {"architectures": ["RWKV7ForCausalLM"], "model_type": "rwkv7", "vocab_size": shape.vocab,
            "hidden_size": shape.hidden, "head_dim": shape.head, "num_hidden_layers": shape.layers,
            "intermediate_size": shape.ffn, "hidden_act": "sqrelu", "norm_eps": 1e-5, "norm_bias": True,
            "norm_first": True, "decay_low_rank_dim": r["w"], "a_low_rank_dim": r["a"], "v_low_rank_dim": r["v"],
            "gate_low_rank_dim": r["g"], "tie_word_embeddings": False, "attn_mode": "chunk",
            "bos_token_id": 1, "eos_token_id": 2, "value_dim": [shape.hidden] * shape.layers, "fuse_norm": False}


def save_tiny_rwkv7(out: Path, shape: Rwkv7Shape = TINY, dtype: torch.dtype = torch.float32,
                    reference: bool = True) -> tuple[Path, Path]:
    """(the fla-layout folder, BlinkDL's `.pth` path without its suffix, as `rwkv.model.RWKV` takes it;
    written only with `reference`: a real shape's is gigabytes no benchmark reads)."""
    from safetensors.torch import save_file
    folder, pth = out / "hf", out / "blinkdl"
    if not (folder / "config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        sd = blinkdl_state_dict(shape=shape, dtype=dtype)
        if reference:
            torch.save(sd, str(pth) + ".pth")
        tmp = out / "hf.partial"
        tmp.mkdir(parents=True)
        save_file(fla_state_dict(sd, shape), str(tmp / "model.safetensors"))
        del sd
        (tmp / "config.json").write_text(json.dumps(fla_config(shape), indent=2))
        from wallbreaker.formats.gguf_model import read_gguf_model
        from wallbreaker.formats.packaged import packaged_model_path
        read_gguf_model(packaged_model_path("smollm2")).tokenizer.save_hf(tmp)  # far faster than transformers'
        import rwkv
        lines = (Path(rwkv.__file__).parent / VOCAB_FILE).read_text(encoding="utf-8").splitlines(keepends=True)
        (tmp / VOCAB_FILE).write_text("".join(lines[:shape.vocab - 1]), encoding="utf-8")
        tmp.rename(folder)
    return folder, pth


def with_tokenizer_of(gguf_in: Path, tokenizer_gguf: Path, gguf_out: Path) -> Path:
    """`gguf_in` with its `tokenizer.*` keys replaced by those of `tokenizer_gguf` (by the gguf package)."""
    import gguf
    if gguf_out.is_file():
        return gguf_out
    src, tok = gguf.GGUFReader(gguf_in), gguf.GGUFReader(tokenizer_gguf)
    arch = src.get_field("general.architecture").contents()
    w = gguf.GGUFWriter(str(gguf_out) + ".partial", arch)
    for reader, keep in ((src, lambda k: not k.startswith("tokenizer.")), (tok, lambda k: k.startswith("tokenizer."))):
        for key, f in reader.fields.items():
            if keep(key) and not key.startswith("GGUF.") and key != "general.architecture":
                sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for t in src.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(gguf_out) + ".partial", gguf_out)
    return gguf_out


def blinkdl_reference(pth: Path):
    """PyPI `rwkv`'s RWKV-7 (x070) on CPU, float32, its pure-PyTorch path (no CUDA kernel)."""
    os.environ.update(RWKV_V7_ON="1", RWKV_JIT_ON="0", RWKV_CUDA_ON="0")
    from rwkv.model import RWKV
    return RWKV(str(pth), strategy="cpu fp32")
