"""Tiny random-weight models of every supported architecture, for fast tests.

Each is written twice: a Hugging Face folder (transformers' `save_pretrained`, the reference) and a
GGUF file of the same weights through wallbreaker's `write_gguf`. Both carry the same tiny byte-level
BPE tokenizer, trained here deterministically on a fixed text, splitting text like a different
llama.cpp pre-tokenizer per architecture (llama: "gpt2", qwen2: "qwen2", gemma3: "llama-bpe").

A model is named by its kind (`KINDS`): an architecture (llama, qwen2, qwen3, phi3, gemma2, gemma3,
qwen3moe) or a model family that is one of them with its own settings (llama3: Llama 3.1's RoPE
scaling; mistral: a sliding window; mixtral: llama with experts; qwen3-yarn, phi3-longrope: those
RoPE scalings).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import torch
from safetensors.torch import load_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from wallbreaker.config import ModelConfig, RopeScaling
from wallbreaker.formats.gguf_writer import write_gguf
from wallbreaker.formats.families import adds_one, hf_expert, hf_to_canonical_table
from wallbreaker.formats.names import FUSED_GATE_UP, FUSED_QKV

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS, EOS = "<|endoftext|>", "<|im_end|>"
VOCAB_SIZE = 512

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A paged cache keeps keys and values in fixed blocks,
so that many sequences can share one pool of memory without copying. Speculative decoding drafts
a few tokens with a small model and verifies them with the large one in a single forward pass.
Hello, world! How are you today? I am fine, thank you. What's the time? It's 12:30 in the afternoon.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159. Code: def main(): return x + y * 2
The attention of each head looks at the keys of all earlier tokens, weighted by their similarity.
Once upon a time there was a little model that wanted to generate text, one token after another.
Unicode: café, naïve, über, 日本語, emoji 🙂, em—dash.\tTabs\tand  double  spaces.
IT'S LOUD, DON'T SHOUT. It's fine.\tand\tthe\ttab\tand\tthe\ttab. Years 2024, 2025, 12345678, 99999.
Each line ends here.
(and this) [one] too.
"""


_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's `tokenizer.ggml.pre` name -> the split regex it stands for
SPLIT_REGEXES = {"gpt2": _GPT2_SPLIT, "qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT}


def train_tokenizer(pre: str, add_bos: bool) -> Tokenizer:
    """Byte-level BPE splitting text the way llama.cpp's pre-tokenizer `pre` does.

    "qwen2" also NFC-normalizes: transformers always loads a qwen2 folder with its own
    `Qwen2Tokenizer`, which does, whatever `tokenizer.json` says.
    """
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre == "gpt2")
    if pre != "gpt2":
        split = pre_tokenizers.Split(Regex(SPLIT_REGEXES[pre]), behavior="isolated")
        byte_level = pre_tokenizers.Sequence([split, byte_level])
    tok.pre_tokenizer = byte_level
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def gguf_tokenizer_metadata(tok: Tokenizer, pre: str, add_bos: bool) -> dict[str, Any]:
    state = json.loads(tok.to_str())
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIAL_TOKENS else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": vocab[BOS],
        "tokenizer.ggml.eos_token_id": vocab[EOS],
        "tokenizer.ggml.padding_token_id": vocab[BOS],
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.ggml.add_eos_token": False,
    }


def _save_hf_tokenizer(tok: Tokenizer, out: Path, add_bos: bool) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": BOS, "unk_token": None,
        "add_bos_token": add_bos, "add_eos_token": False,
        "model_max_length": 512, "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


@dataclass(frozen=True)
class TinyModel:
    arch: str  # the kind (KINDS), e.g. "mixtral"; config.architecture is wallbreaker's name for it
    hf_dir: Path
    gguf_path: Path
    config: ModelConfig
    tokenizer_metadata: dict[str, Any]
    chat_template: str

    def load_hf(self) -> torch.nn.Module:
        """The transformers reference model, float32, eval mode."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.hf_dir, dtype=torch.float32).eval()

    def canonical_tensors(self) -> dict[str, torch.Tensor]:
        """The weights under canonical names and layout (Gemma norms as 1 + w, Phi-3's fused
        projections split, each expert's projections stacked into [experts, out, in])."""
        c = self.config
        table = hf_to_canonical_table(c.architecture, c.num_layers, c.is_moe)
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for hf_name, t in load_file(self.hf_dir / "model.safetensors").items():
            if hf_name not in table:
                name, e = hf_expert(c.architecture, hf_name)
                experts.setdefault(name, {})[e] = t
                continue
            name = table[hf_name]
            out[name] = t + 1 if adds_one(c.architecture, name) else t
        for name, parts in experts.items():
            out[name] = torch.stack([parts[e] for e in range(len(parts))])
        q, kv, ff = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        for i in range(c.num_layers):
            p = f"blk.{i}."
            if p + FUSED_QKV in out:
                out[p + "attn_q.weight"], out[p + "attn_k.weight"], out[p + "attn_v.weight"] = \
                    out.pop(p + FUSED_QKV).split([q, kv, kv])
            if p + FUSED_GATE_UP in out:
                out[p + "ffn_gate.weight"], out[p + "ffn_up.weight"] = out.pop(p + FUSED_GATE_UP).split([ff, ff])
        return out

    def write_gguf(self, path: Path, tensor_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
        """These weights as a GGUF with every 2-D weight stored as `tensor_type` (norms stay F32)."""
        tensors = self.canonical_tensors()
        return write_gguf(path, self.config, tensors, self.tokenizer_metadata,
                          tensor_types=dict.fromkeys(tensors, tensor_type),
                          chat_template=self.chat_template, name=f"tiny-{self.arch}")

    def quantized_gguf(self, tensor_type: gguf.GGMLQuantizationType) -> Path:
        """A `tensor_type` copy next to `gguf_path`, written once."""
        path = self.gguf_path.with_name(f"model-{tensor_type.name}.gguf")
        return path if path.exists() else self.write_gguf(path, tensor_type)


_DEFAULTS = {  # tie_word_embeddings, qkv_bias, add_bos, pre-tokenizer
    "llama": (False, False, True, "gpt2"),
    "llama3": (False, False, True, "llama-bpe"),
    "mistral": (False, False, True, "gpt2"),
    "mixtral": (False, False, True, "gpt2"),
    "qwen2": (True, True, False, "qwen2"),
    "qwen3": (True, False, False, "qwen2"),
    "qwen3-yarn": (True, False, False, "qwen2"),
    "qwen3moe": (False, False, False, "qwen2"),
    "phi3": (False, False, True, "gpt2"),
    "phi3-longrope": (False, False, True, "gpt2"),
    "gemma2": (True, False, True, "llama-bpe"),
    "gemma3": (True, False, True, "llama-bpe"),
}
KINDS = tuple(_DEFAULTS)
_ARCHITECTURE = {"llama3": "llama", "mistral": "llama", "mixtral": "llama", "qwen3-yarn": "qwen3",
                 "phi3-longrope": "phi3"}
_GEMMA3_LAYERS = ("sliding", "sliding", "full", "sliding")
HEAD_DIM = 16
# Llama 3.1's scaling with a short "original" context, so that it changes most frequencies here
LLAMA3_ROPE = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64)
YARN_ROPE = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=128)
# LongRoPE: texts here stay below 64 positions, where transformers and wallbreaker both use the
# short factors (their long factors are checked in tests/test_rotary.py)
LONGROPE = RopeScaling("longrope", factor=8.0, original_max_position_embeddings=64,
                       short_factor=tuple(1.0 + 0.25 * i for i in range(HEAD_DIM // 2)),
                       long_factor=tuple(2.0 + 1.5 * i for i in range(HEAD_DIM // 2)))


def architecture_of(kind: str) -> str:
    return _ARCHITECTURE.get(kind, kind)


def tiny_model_config(arch: str, vocab_size: int, bos: int, eos: int, *, tie_word_embeddings: bool,
                      qkv_bias: bool) -> ModelConfig:
    """What wallbreaker should infer for the tiny model of kind `arch`.

    RoPE bases are off the library defaults so that a reader falling back to a default is caught.
    Gemma 3 also departs from what llama.cpp hardcodes for it (sliding pattern of 6, local base
    10000, scale 1/sqrt(head_dim)); the writer stores all three explicitly. Sliding windows are
    shorter than the test texts, soft caps small enough to bind.
    """
    kind = arch
    common: dict[str, Any] = dict(
        architecture=architecture_of(kind), vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings, qkv_bias=qkv_bias, bos_token_id=bos, eos_token_ids=(eos,),
    )
    if kind == "llama":
        return ModelConfig(**common, rms_norm_eps=1e-5, rope_theta=50000.0)
    if kind == "llama3":
        return ModelConfig(**common, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)
    if kind == "mistral":
        return ModelConfig(**common, rms_norm_eps=1e-5, rope_theta=20000.0, sliding_window=16,
                           layer_types=("sliding",) * 4)
    if kind == "mixtral":
        return ModelConfig(**common, rms_norm_eps=1e-5, rope_theta=30000.0, num_experts=4, num_experts_per_tok=2)
    if kind == "qwen2":
        return ModelConfig(**common, rms_norm_eps=1e-6, rope_theta=1e6)
    if kind in ("qwen3", "qwen3-yarn"):
        return ModelConfig(**common, rms_norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
                           rope_scaling=YARN_ROPE if kind == "qwen3-yarn" else None)
    if kind == "qwen3moe":
        return ModelConfig(**common, rms_norm_eps=1e-6, rope_theta=2e6, qk_norm=True, num_experts=4,
                           num_experts_per_tok=2, expert_intermediate_size=64, norm_topk_prob=True)
    if kind in ("phi3", "phi3-longrope"):
        return ModelConfig(**common, rms_norm_eps=1e-5, rope_theta=10000.0 * 3,
                           rope_scaling=LONGROPE if kind == "phi3-longrope" else None)
    if kind == "gemma2":
        return ModelConfig(
            **common, rms_norm_eps=1e-6, rope_theta=20000.0, hidden_act="gelu_tanh", sandwich_norm=True,
            embed_scale=True, query_pre_attn_scalar=32.0, sliding_window=16,
            layer_types=("sliding", "full", "sliding", "full"), attn_logit_softcap=2.0, final_logit_softcap=10.0)
    return ModelConfig(
        **common, rms_norm_eps=1e-6, rope_theta=1e6, hidden_act="gelu_tanh", qk_norm=True, sandwich_norm=True,
        embed_scale=True, query_pre_attn_scalar=32.0, sliding_window=16, layer_types=_GEMMA3_LAYERS,
        rope_local_theta=20000.0,
    )


def _hf_rope(c: ModelConfig) -> dict[str, Any]:
    """transformers' rope_parameters for `c` (one dict: no architecture here has two but Gemma 3)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    s = c.rope_scaling
    if s is None:
        return rope
    rope.update(rope_type=s.kind, factor=s.factor, original_max_position_embeddings=s.original_max_position_embeddings)
    if s.kind == "llama3":
        rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
    elif s.kind == "longrope":
        rope.update(short_factor=list(s.short_factor), long_factor=list(s.long_factor))
        del rope["factor"]  # transformers derives it: max_position_embeddings / original
    return rope


def hf_model(config: ModelConfig, seed: int, kind: str | None = None) -> torch.nn.Module:
    """A transformers model for `config`, with random weights large enough for peaked logits and
    norm weights moved off their neutral value, so that mistakes in either show up."""
    import transformers as tf

    c = config
    kind = kind or c.architecture
    common: dict[str, Any] = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, initializer_range=0.08,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_ids[0], pad_token_id=c.bos_token_id,
    )
    rope = _hf_rope(c)
    torch.manual_seed(seed)
    if kind in ("llama", "llama3"):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_parameters=rope, attention_bias=False, mlp_bias=False))
    elif kind == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, rope_parameters=rope, sliding_window=c.sliding_window))
    elif kind == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**common, rope_parameters=rope, num_local_experts=c.num_experts,
                                                       num_experts_per_tok=c.num_experts_per_tok))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, rope_parameters=rope, use_sliding_window=False))
    elif kind in ("qwen3", "qwen3-yarn"):
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, rope_parameters=rope, attention_bias=False,
                                                   use_sliding_window=False))
    elif kind == "qwen3moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **common, rope_parameters=rope, attention_bias=False, num_experts=c.num_experts,
            num_experts_per_tok=c.num_experts_per_tok, moe_intermediate_size=c.expert_ffn,
            norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False))
    elif kind in ("phi3", "phi3-longrope"):
        s = c.rope_scaling
        original = s.original_max_position_embeddings if s is not None else c.max_position_embeddings
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**common, rope_parameters=rope, original_max_position_embeddings=original,
                                                 sliding_window=None))
    elif kind == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(
            **common, rope_parameters=rope, query_pre_attn_scalar=int(c.query_pre_attn_scalar),
            sliding_window=c.sliding_window, layer_types=[f"{t}_attention" for t in c.layer_types],
            attn_logit_softcapping=c.attn_logit_softcap, final_logit_softcapping=c.final_logit_softcap,
            hidden_activation="gelu_pytorch_tanh"))
    else:
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **common, rope_theta=c.rope_theta, query_pre_attn_scalar=int(c.query_pre_attn_scalar),
            sliding_window=c.sliding_window, layer_types=[f"{t}_attention" for t in c.layer_types],
            rope_local_base_freq=c.rope_local_theta, hidden_activation="gelu_pytorch_tanh",
        ))
    gemma = c.architecture.startswith("gemma")
    neutral = 0.0 if gemma else 1.0
    # Gemma's sqrt(hidden) embedding scale would make a large tied embedding echo its input token;
    # a small one plus a larger final norm keeps the logits peaked instead.
    embed_std, final_gain = (0.1, 1.5) if c.embed_scale else (0.25, 0.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "model.norm.weight":
                p.copy_(neutral + final_gain + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(neutral + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.normal_(0.0, embed_std)
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.normal_(0.0, 0.5)  # a router with clear preferences: no near-ties in the top-k
            elif p.dim() == 3:  # experts' [experts, out, in]: set here, whatever transformers' init does
                p.normal_(0.0, 0.08)
    return model.float().eval()


def make_tiny_model(arch: str, tmp_dir: Path, *, tie_word_embeddings: bool | None = None,
                    qkv_bias: bool | None = None, seed: int = 0) -> TinyModel:
    """Build the tiny `arch` model under `tmp_dir`: `hf/` (transformers folder) and `model.gguf` (F32).

    Defaults follow the real models: llama untied without biases, qwen2 tied with q/k/v biases,
    gemma tied. transformers only has q/k/v biases for qwen2 (llama's `attention_bias` also adds
    an o_proj bias), so `qkv_bias` must match that.
    """
    default_tie, default_bias, add_bos, pre = _DEFAULTS[arch]
    tie = default_tie if tie_word_embeddings is None else tie_word_embeddings
    bias = default_bias if qkv_bias is None else qkv_bias
    if bias != default_bias:
        raise ValueError(f"transformers' {arch} cannot express qkv_bias={bias}")

    tmp_dir = Path(tmp_dir)
    hf_dir = tmp_dir / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(pre, add_bos)
    config = tiny_model_config(arch, tok.get_vocab_size(), tok.token_to_id(BOS), tok.token_to_id(EOS),
                               tie_word_embeddings=tie, qkv_bias=bias)
    hf_model(config, seed, arch).save_pretrained(hf_dir)
    _save_hf_tokenizer(tok, hf_dir, add_bos)

    tiny = TinyModel(arch, hf_dir, tmp_dir / "model.gguf", config, gguf_tokenizer_metadata(tok, pre, add_bos),
                     CHAT_TEMPLATE)
    tiny.write_gguf(tiny.gguf_path)
    return tiny


def write_padded_vocab_model(tiny: TinyModel, out: Path, extra_rows: int = 64) -> Path:
    """`tiny`'s HF folder with `extra_rows` embedding rows past its tokenizer, whose output rows win
    every argmax: a sampler that may pick them emits ids no text stands for (Qwen2.5's embedding
    has 271 such rows)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.hf_dir, dtype=torch.float32)
    real = model.config.vocab_size
    model.resize_token_embeddings(real + extra_rows, mean_resizing=False)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[real:] = head[:real].abs().mean(0) * 50.0  # huge logits against every hidden state
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny.hf_dir / name, out / name)
    return out
