"""A LoRA adapter read from disk: a Hugging Face PEFT folder (`adapter_config.json` and
`adapter_model.safetensors`) or llama.cpp's GGUF LoRA (what `convert_lora_to_gguf.py` writes), as
(A, B) pairs under the canonical names of the weights they adapt (formats/names.py), B's rows in the
order the model holds that weight's rows (HF's: a GGUF's llama q/k rows are un-permuted as the
model's own are, formats/gguf_model.py)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import InvalidRequestError
from ..formats.families import family, hf_to_canonical_table
from ..formats.names import llama_unpermute

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


@dataclass
class Adapter:
    rank: int
    scale: float  # lora_alpha / r (PEFT's rsLoRA: lora_alpha / sqrt(r))
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # weight name -> (A [r, in], B [out, r]) float32


def read_adapter(path: str | Path, cfg: ModelConfig) -> Adapter:
    """The adapter at `path` (a PEFT folder or a .gguf file) for a model of `cfg`; InvalidRequestError
    naming what is wrong with a file that is missing, corrupt or not a LoRA."""
    path = Path(path)
    if path.is_dir():
        return _read_peft(path, cfg)
    if path.is_file() and path.suffix == ".gguf":
        return _read_gguf(path, cfg)
    raise InvalidRequestError(f"LoRA adapter {path}: neither a PEFT folder ({PEFT_CONFIG} and {PEFT_WEIGHTS}) "
                              f"nor a .gguf file")


def _read_peft(path: Path, cfg: ModelConfig) -> Adapter:
    try:
        conf = json.loads((path / PEFT_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"LoRA adapter {path}: cannot read {PEFT_CONFIG}: {e}") from None
    if not isinstance(conf, dict) or conf.get("peft_type", "LORA") != "LORA":
        raise InvalidRequestError(f"LoRA adapter {path}: {PEFT_CONFIG} is not a LoRA's")
    for key, why in (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks"), ("alpha_pattern", "per-module alphas"),
                     ("modules_to_save", "fully trained modules"), ("layers_pattern", "a layers pattern")):
        if conf.get(key):
            raise InvalidRequestError(f"LoRA adapter {path}: {why} ({key}) are not supported")
    if conf.get("bias", "none") != "none":
        raise InvalidRequestError(f"LoRA adapter {path}: trained biases (bias={conf['bias']!r}) are not supported")
    r, alpha = conf.get("r"), conf.get("lora_alpha")
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, (int, float)):
        raise InvalidRequestError(f"LoRA adapter {path}: {PEFT_CONFIG} needs a positive integer r and a lora_alpha")
    scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    try:
        from safetensors.torch import load_file
        tensors = load_file(str(path / PEFT_WEIGHTS))
    except FileNotFoundError:
        raise InvalidRequestError(f"LoRA adapter {path}: no {PEFT_WEIGHTS}") from None
    except Exception as e:  # safetensors' own error types for a corrupt file
        raise InvalidRequestError(f"LoRA adapter {path}: unreadable {PEFT_WEIGHTS}: {e}") from None
    table = hf_to_canonical_table(cfg.architecture, cfg.num_layers, cfg.is_moe)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        for half in ("lora_A", "lora_B"):
            marker = f".{half}.weight"
            if key.endswith(marker) and key.startswith(_PEFT_PREFIX):
                module = key[len(_PEFT_PREFIX):-len(marker)]
                name = table.get(module + ".weight")
                if name is None:
                    raise InvalidRequestError(f"LoRA adapter {path}: targets {module}, which this model has no "
                                              f"projection of")
                halves.setdefault(name, {})[half] = t.float()
                break
        else:
            raise InvalidRequestError(f"LoRA adapter {path}: tensor {key} is not a LoRA A or B weight")
    pairs = {}
    for name, h in halves.items():
        if set(h) != {"lora_A", "lora_B"}:
            raise InvalidRequestError(f"LoRA adapter {path}: {name} has only its {', '.join(h)}")
        pairs[name] = (h["lora_A"], h["lora_B"])
    return _checked(path, r, scale, pairs)


def _read_gguf(path: Path, cfg: ModelConfig) -> Adapter:
    from ..errors import WallbreakerError
    from ..formats.dequant import dequantize
    from ..formats.gguf_file import open_gguf
    try:
        f = open_gguf(path)
    except WallbreakerError as e:
        raise InvalidRequestError(f"LoRA adapter {e}") from None
    if f.get("general.type") != "adapter" or f.get("adapter.type") != "lora":
        raise InvalidRequestError(f"LoRA adapter {path}: a GGUF file, but not a LoRA adapter (general.type "
                                  f"{f.get('general.type')!r}, adapter.type {f.get('adapter.type')!r})")
    alpha = f.get("adapter.lora.alpha")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in f.tensors.items():
        base, _, half = name.rpartition(".")
        if half not in ("lora_a", "lora_b"):
            raise InvalidRequestError(f"LoRA adapter {path}: tensor {name} is not a LoRA A or B weight")
        halves.setdefault(base, {})[half] = dequantize(t.raw, t.ggml_type, t.shape)
    permuted = family(cfg.architecture).rope_permuted
    pairs, ranks = {}, set()
    for name, h in halves.items():
        if set(h) != {"lora_a", "lora_b"}:
            raise InvalidRequestError(f"LoRA adapter {path}: {name} has only its {', '.join(h)}")
        a, b = h["lora_a"], h["lora_b"]
        heads = {"attn_q.weight": cfg.num_heads, "attn_k.weight": cfg.num_kv_heads}.get(name.split(".", 2)[-1])
        if permuted and heads and b.shape[0] % (2 * heads) == 0:  # the converter's interleaved-RoPE rows
            b = llama_unpermute(b, heads)
        pairs[name] = (a, b)
        ranks.add(a.shape[0])
    if len(ranks) > 1:
        raise InvalidRequestError(f"LoRA adapter {path}: its tensors have different ranks {sorted(ranks)}")
    rank = ranks.pop() if ranks else 0
    if not rank:
        raise InvalidRequestError(f"LoRA adapter {path}: it holds no LoRA tensors")
    # llama.cpp scales by alpha / rank, and by 1 where the file carries no alpha
    return _checked(path, rank, alpha / rank if alpha else 1.0, pairs)


def _checked(path: Path, rank: int, scale: float, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Adapter:
    if not pairs:
        raise InvalidRequestError(f"LoRA adapter {path}: it holds no LoRA tensors")
    for name, (a, b) in pairs.items():
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise InvalidRequestError(f"LoRA adapter {path}: {name}'s A {tuple(a.shape)} and B {tuple(b.shape)} "
                                      f"are not a rank-{rank} pair")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise InvalidRequestError(f"LoRA adapter {path}: {name} holds values that are not finite")
    return Adapter(rank, float(scale), pairs)
