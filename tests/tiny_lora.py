"""PEFT LoRA adapters of the tiny models (tests/tiny_models.py), made with PyPI `peft`: rank 8 on
q/k/v/o and the MLP's gate/up/down. PEFT starts B at zero (the adapter changes nothing until trained);
here every LoRA weight is drawn at random before saving, so the adapter changes the model's output."""
from __future__ import annotations

from pathlib import Path

import torch

from tiny_models import TinyModel

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_model(tiny: TinyModel, adapter_dir: Path) -> torch.nn.Module:
    """transformers' model with the saved adapter, through peft (the reference)."""
    from peft import PeftModel
    return PeftModel.from_pretrained(tiny.load_hf(), str(adapter_dir)).eval()


def make_peft_adapter(tiny: TinyModel, out: Path, seed: int, r: int = 8, alpha: float = 16.0,
                      targets: tuple[str, ...] = TARGETS, use_rslora: bool = False, std: float = 0.15) -> Path:
    """A random-weight PEFT LoRA of `tiny` saved into `out` (adapter_config.json, adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(tiny.load_hf(), LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                      lora_dropout=0.0, use_rslora=use_rslora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(str(out))
    return Path(out)
