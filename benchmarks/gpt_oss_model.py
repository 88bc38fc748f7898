"""A random-weight GGUF of gpt-oss-20b's shape with its experts in MXFP4, for the speed comparison with
llama.cpp (issue 51 item 5).

The Hugging Face folder is written as OpenAI's checkpoint stores it, tensor by tensor with safetensors
(no model is built, so memory stays at one shard: 2.3 GB for the embedding and head): experts as MXFP4 (`*_blocks`, random e2m1 codes;
`*_scales`, e8m0 of 2^-8 to 2^-5, about a trained model's weight size) with
`quantization_config: {quant_method: mxfp4}`, everything else bfloat16. llama.cpp's own
`convert_hf_to_gguf.py` then writes the GGUF: it copies MXFP4 experts as they are whatever the out
type (conversion/gpt_oss.py `repack_mxfp4`) and writes the rest as `--outtype` says; Q8_0 (router,
norms, biases and sinks F32) is what ggml-org's gpt-oss-20b GGUF holds, so both engines read the file
a user would run.

Every per-layer shape is gpt-oss-20b's (width 2880, 64 query heads and 8 KV heads of 64, 32 experts of
2880 with 4 a token, sliding window 128 on every other layer, YaRN factor 32, sinks, SwiGLU limit 7),
and so are the vocabulary (201088, SmolLM2's tokenizer padded by the converter) and the head; only the
layer count is cut (8 of 24 by default) so that the folder and the GGUF fit this machine's disk and
memory. A token's cost is then the same per layer; the untied head weighs more in the whole (about
half of a decode step's bytes at 8 layers, a quarter at 24).

    python benchmarks/gpt_oss_model.py --dir /work/oss-models            # gpt-oss-20b-L8-mxfp4.gguf
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

# tests/ for the converter's fetcher and SmolLM2's tokenizer (see hybrid_models.py)
sys.path[0] = str(Path(__file__).resolve().parent.parent / "tests")

FULL_LAYERS = 24
SCALES = (119, 123)  # e8m0 exponents drawn from [lo, hi): 2^-8 .. 2^-5
# the modules OpenAI's quantization_config leaves in bfloat16
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def gpt_oss_20b(num_layers: int):
    """openai/gpt-oss-20b's config.json as transformers' GptOssConfig names it, with `num_layers`
    layers (sliding, full, sliding, ... as the real one), and SmolLM2's special tokens."""
    from transformers import GptOssConfig
    return GptOssConfig(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=num_layers,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                         for i in range(num_layers)],
        max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0, attention_bias=True,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0})


def _random(name: str, shape: tuple[int, ...], g: torch.Generator) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors for transformers' parameter `name` of `shape`: MXFP4 blocks and
    scales for the experts' weights ([experts, in, out] -> [experts, out, in / 32, 16] and
    [experts, out, in / 32]), bfloat16 otherwise (norms near 1, sinks of logit size, 0.02 elsewhere)."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        experts, cin, cout = shape
        return {name + "_blocks": torch.randint(0, 256, (experts, cout, cin // 32, 16), generator=g, dtype=torch.uint8),
                name + "_scales": torch.randint(*SCALES, (experts, cout, cin // 32), generator=g, dtype=torch.uint8)}
    if "norm" in name:
        return {name: (1 + 0.1 * torch.randn(shape, generator=g)).bfloat16()}
    scale = 1.0 if name.endswith("sinks") else 0.02
    out = torch.empty(shape, dtype=torch.bfloat16)
    for rows in torch.split(torch.arange(shape[0]), 16384):  # the 201088-row tables in float32 pieces
        out[rows] = (torch.randn((len(rows), *shape[1:]), generator=g) * scale).bfloat16()
    return {name: out}


def save_folder(config, out: Path, seed: int = 0) -> Path:
    """`config`'s random MXFP4 checkpoint in `out`: one safetensors shard a layer, one for the rest."""
    from safetensors.torch import save_file
    from tiny_recurrent import smollm2_tokenizer
    from transformers import AutoModelForCausalLM
    if (out / "config.json").is_file():
        return out
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        part = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(f"model-{part}.safetensors", []).append(name)
    g = torch.Generator().manual_seed(seed)
    weight_map = {}
    for shard, names in groups.items():
        tensors = {k: v for n in names for k, v in _random(n, shapes[n], g).items()}
        save_file(tensors, tmp / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    config.save_pretrained(tmp)
    saved = json.loads((tmp / "config.json").read_text())
    saved["architectures"] = ["GptOssForCausalLM"]  # the converter picks its model class by this
    saved["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (tmp / "config.json").write_text(json.dumps(saved, indent=2))
    smollm2_tokenizer().save_pretrained(tmp)
    tmp.rename(out)
    return out


def build(out_dir: Path, num_layers: int = 8, outtype: str = "q8_0") -> Path:
    """`out_dir/gpt-oss-20b-L<layers>-mxfp4.gguf` (MXFP4 experts, the rest `outtype`), made once; the
    Hugging Face folder beside it is removed after."""
    from llamacpp_converter import convert, converter_dir

    from wallbreaker.formats.packaged import cache_dir
    gguf = out_dir / f"gpt-oss-20b-L{num_layers}-mxfp4.gguf"
    if gguf.is_file():
        return gguf
    folder = save_folder(gpt_oss_20b(num_layers), out_dir / f"gpt-oss-20b-L{num_layers}-hf")
    convert(converter_dir(cache_dir()), folder, outtype, gguf)
    shutil.rmtree(folder)
    return gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="where the files go (outside the repository)")
    parser.add_argument("--layers", type=int, default=8, help=f"of the real model's {FULL_LAYERS}")
    parser.add_argument("--outtype", default="q8_0", help="the non-expert weights' type")
    args = parser.parse_args()
    if not 1 <= args.layers <= FULL_LAYERS:
        parser.error(f"--layers must be 1 to {FULL_LAYERS}")
    args.dir.mkdir(parents=True, exist_ok=True)
    print(build(args.dir, args.layers, args.outtype))


if __name__ == "__main__":
    main()
