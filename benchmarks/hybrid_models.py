"""Random-weight GGUFs of real hybrid models' shapes, for the speed comparison with llama.cpp
(issue 34): transformers builds the model from the real config (random weights, its own init), it is
saved as a Hugging Face folder with SmolLM2's tokenizer (the converter pads the vocabulary to the
config's with [PAD] tokens), and llama.cpp's own `convert_hf_to_gguf.py` writes the GGUF (Q8_0), so
both engines read the very file a user would have converted. Everything is written outside the
repository (`--dir`); no weights are downloaded.

measure/random_model.py writes random GGUFs itself, block by block, but only of llama's layout:
a hybrid's metadata (per-layer KV head counts, the convolution's taps) and its unquantizable
tensors (a [channels, 3] convolution) are the converter's to get right, so it is the converter here.

    python benchmarks/hybrid_models.py --dir ~/hybrid-models              # every shape
    python benchmarks/hybrid_models.py --dir ~/hybrid-models lfm2-350m    # one

Then `wallbreaker bench -m ~/hybrid-models/lfm2-350m-q8_0.gguf --llama-cpp-dir ...` side by side.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

# tests/ for the converter's fetcher and SmolLM2's tokenizer, in place of benchmarks/ itself, whose
# kernels.py would shadow the `kernels` package transformers imports
sys.path[0] = str(Path(__file__).resolve().parent.parent / "tests")


def lfm2_350m():
    """LiquidAI/LFM2-350M's config.json: 16 layers, attention at 2, 5, 8, 10, 12 and 14 (6), short
    convolutions elsewhere (10); FFN 6656 before the auto-adjust (4608 after)."""
    from transformers import Lfm2Config
    return Lfm2Config(vocab_size=65536, hidden_size=1024, intermediate_size=6656, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=128000,
                      norm_eps=1e-5, conv_L_cache=3, conv_bias=False, block_multiple_of=256,
                      block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
                      full_attn_idxs=[2, 5, 8, 10, 12, 14], rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1000000.0},
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=7, pad_token_id=0)


def granite_4_h_1b():
    """ibm-granite/granite-4.0-h-1b's shape: 40 layers of width 1536, four of them attention without
    RoPE (12 heads, 4 KV heads) and 36 Mamba2 (48 heads of 64, state 128, one group, 4 taps); a dense
    SwiGLU of 4096 (no experts); vocabulary 100352, tied. Written from memory: no config could be
    fetched here (no model hub), and public descriptions differ on details (mamba_n_groups 1 or 8,
    where the attention layers sit), so this is a model of about that shape, not a verified copy.
    Where the attention layers sit does not change the cost of a step; they are put at 10, 13, 17
    and 27. Eight groups instead of one would add 2 x 7 x 128 columns to each in_proj (6448 -> 8240),
    about 7% more weight bytes a step; the state is the same size."""
    from transformers import GraniteMoeHybridConfig
    attention = {10, 13, 17, 27}
    return GraniteMoeHybridConfig(
        vocab_size=100352, hidden_size=1536, intermediate_size=4096, shared_intermediate_size=4096,
        num_hidden_layers=40, num_attention_heads=12, num_key_value_heads=4,
        layer_types=["attention" if i in attention else "mamba" for i in range(40)],
        mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False, num_local_experts=0,
        num_experts_per_tok=0, embedding_multiplier=12.0, attention_multiplier=0.0078125,
        residual_multiplier=0.22, logits_scaling=6.0, position_embedding_type="nope", rms_norm_eps=1e-5,
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=100257, eos_token_id=100257,
        pad_token_id=100256)


def mamba_1_4b():
    """state-spaces/mamba-1.4b-hf's shape (issue 51 item 5): 48 Mamba (v1) layers of width 2048, inner
    4096, state 16, 4 taps, dt rank 128; vocabulary 50280 (GPT-NeoX's), tied. From the published
    config's values as transformers' MambaConfig names them."""
    from transformers import MambaConfig
    return MambaConfig(vocab_size=50280, hidden_size=2048, state_size=16, num_hidden_layers=48, expand=2,
                       conv_kernel=4, time_step_rank=128, use_bias=False, use_conv_bias=True,
                       layer_norm_epsilon=1e-5, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                       pad_token_id=0)


def blinkdl_lora_rank(hidden: int, exponent: float, multiplier: float) -> int:
    """BlinkDL's RWKV-7 LoRA rank for width `hidden`: max(32, round(multiplier * hidden ** exponent / 32)
    * 32), as RWKV-LM's RWKV-v7 train_temp/src/model.py sizes D_DECAY_LORA (0.5, 1.8), D_AAA_LORA
    (0.5, 1.8), D_MV_LORA (0.5, 1.3) and D_GATE_LORA (0.8, 0.6) and as llama.cpp's converter fills in a
    config's missing ranks (conversion/rwkv.py `calc_lora_rank`). PyPI `rwkv` has no formula: it takes
    the ranks from the weights' shapes."""
    return max(32, int(round(multiplier * hidden ** exponent / 32) * 32))


def rwkv7_1_5b():
    """RWKV7-Goose World 1.5B's shape (fla-hub/rwkv7-1.5B-world; issue 51 item 5): 24 layers of width
    2048, heads of 64 (32 heads), FFN 8192 (4x, sqrelu), vocabulary 65536 (the World tokenizer's 65529
    tokens, `<s>` and padding), head untied; LoRA ranks decay 96, a 96, v 64, gate 256 from
    `blinkdl_lora_rank` (RWKV/RWKV7-Goose-World3-1.5B-HF's config.json, as quoted in public code, has
    the same decay/a/v/gate_low_rank_dim). Not a transformers model: tests/tiny_rwkv7.py writes it in
    fla-hub's layout, float32 (6 GB, saved without a copy)."""
    from tiny_rwkv7 import Rwkv7Shape
    hidden = 2048
    ranks = {"w": blinkdl_lora_rank(hidden, 0.5, 1.8), "a": blinkdl_lora_rank(hidden, 0.5, 1.8),
             "v": blinkdl_lora_rank(hidden, 0.5, 1.3), "g": blinkdl_lora_rank(hidden, 0.8, 0.6)}
    return Rwkv7Shape(hidden=hidden, head=64, layers=24, ffn=8192, ranks=ranks, vocab=65536)


# name -> the real model's config (a transformers config, or an RWKV7_SHAPES shape)
SHAPES = {"lfm2-350m": lfm2_350m, "granite-4.0-h-1b": granite_4_h_1b, "mamba-1.4b": mamba_1_4b,
          "rwkv7-1.5b": rwkv7_1_5b}
RWKV7_SHAPES = {"rwkv7-1.5b"}


def save_hf_folder(name: str, folder: Path) -> Path:
    """The random-weight Hugging Face folder of `name`: transformers' own init, or tiny_rwkv7's builder."""
    if name in RWKV7_SHAPES:
        from tiny_rwkv7 import save_tiny_rwkv7
        hf, _ = save_tiny_rwkv7(folder, SHAPES[name](), reference=False)
        return hf
    from tiny_mamba import save_model
    torch.manual_seed(0)
    return save_model(SHAPES[name](), folder)


def build(name: str, out_dir: Path, outtype: str = "q8_0") -> Path:
    """`out_dir/<name>-<outtype>.gguf`, made once (the HF folder beside it is removed after)."""
    from llamacpp_converter import convert, converter_dir

    from wallbreaker.formats.packaged import cache_dir
    gguf = out_dir / f"{name}-{outtype}.gguf"
    if gguf.is_file():
        return gguf
    folder = out_dir / f"{name}-hf"
    convert(converter_dir(cache_dir()), save_hf_folder(name, folder), outtype, gguf)
    shutil.rmtree(folder)
    return gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="where the files go (outside the repository)")
    parser.add_argument("--outtype", default="q8_0")
    parser.add_argument("names", nargs="*", help=f"of {', '.join(SHAPES)} (default: all)")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in SHAPES]
    if unknown:
        parser.error(f"unknown shape {unknown[0]!r} (known: {', '.join(SHAPES)})")
    args.dir.mkdir(parents=True, exist_ok=True)
    for name in args.names or SHAPES:
        print(build(name, args.dir, args.outtype))


if __name__ == "__main__":
    main()
