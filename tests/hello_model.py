"""A tiny model with SmolLM2's tokenizer and chat template and a 64k context that always answers "Hello!".

The real clients' prompts are long (Claude Code's system prompt and tools are ~19k SmolLM2 tokens,
past SmolLM2's 8192), and they ask for up to 32k tokens. A random-weight model would ramble until
then; this one is a bigram model by construction, so every turn ends in three tokens, whatever the
prompt and the sampling settings:

- attention and MLP outputs are zero (their projections into the residual stream are zero), so the
  last hidden state is the embedding of the current token;
- every token embeds as axis 0 except "Hello" (axis 1) and "!" (axis 2);
- the output rows map axis 0 -> "Hello", axis 1 -> "!", axis 2 -> <|im_end|>, with a logit gap of
  `GAIN` * 8 (RMSNorm scales a unit vector in 64 dimensions by 8), so even temperature 1 is greedy.

Attention still runs over the whole prompt (random q/k/v), so prefill costs what a 1-layer model's does.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import torch

from wallbreaker.config import ModelConfig
from wallbreaker.formats.gguf_writer import write_gguf

HIDDEN = 64
HEAD_DIM = 16
CONTEXT = 65536
GAIN = 5.0
ANSWER = "Hello!"


def _smollm2_tokenizer(smollm2_gguf: Path) -> tuple[dict, str]:
    """SmolLM2's `tokenizer.ggml.*` metadata and its chat template, read from its GGUF."""
    reader = gguf.GGUFReader(smollm2_gguf)
    metadata = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.")}
    return metadata, reader.fields["tokenizer.chat_template"].contents()


def write_hello_model(smollm2_gguf: Path, out: Path) -> Path:
    """Write the model as an F32 GGUF at `out` (about 25 MB); returns `out`."""
    metadata, template = _smollm2_tokenizer(smollm2_gguf)
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    hello, bang = tokens.index("Hello"), tokens.index("!")
    eos = int(metadata["tokenizer.ggml.eos_token_id"])
    vocab = len(tokens)
    config = ModelConfig(
        architecture="llama", vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=HIDDEN, num_layers=1,
        num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, max_position_embeddings=CONTEXT, rope_theta=100000.0,
        bos_token_id=int(metadata["tokenizer.ggml.bos_token_id"]), eos_token_ids=(eos,))

    generator = torch.Generator().manual_seed(0)
    embed = torch.zeros(vocab, HIDDEN)  # [vocab, hidden]
    embed[:, 0] = 1.0
    embed[hello] = torch.nn.functional.one_hot(torch.tensor(1), HIDDEN).float()
    embed[bang] = torch.nn.functional.one_hot(torch.tensor(2), HIDDEN).float()
    output = torch.zeros(vocab, HIDDEN)  # [vocab, hidden]
    output[hello, 0] = output[bang, 1] = output[eos, 2] = GAIN
    q, kv = 4 * HEAD_DIM, 2 * HEAD_DIM
    tensors = {
        "token_embd.weight": embed, "output.weight": output, "output_norm.weight": torch.ones(HIDDEN),
        "blk.0.attn_norm.weight": torch.ones(HIDDEN), "blk.0.ffn_norm.weight": torch.ones(HIDDEN),
        "blk.0.attn_q.weight": 0.1 * torch.randn(q, HIDDEN, generator=generator),
        "blk.0.attn_k.weight": 0.1 * torch.randn(kv, HIDDEN, generator=generator),
        "blk.0.attn_v.weight": 0.1 * torch.randn(kv, HIDDEN, generator=generator),
        "blk.0.attn_output.weight": torch.zeros(HIDDEN, q),
        "blk.0.ffn_gate.weight": 0.1 * torch.randn(HIDDEN, HIDDEN, generator=generator),
        "blk.0.ffn_up.weight": 0.1 * torch.randn(HIDDEN, HIDDEN, generator=generator),
        "blk.0.ffn_down.weight": torch.zeros(HIDDEN, HIDDEN),
    }
    return write_gguf(out, config, tensors, metadata, chat_template=template, name="hello-smollm2-tokenizer")
