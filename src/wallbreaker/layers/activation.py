import torch
import torch.nn.functional as F


def gated(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for a fused [.., 2 * inter] projection: SwiGLU ("silu") or GeGLU ("gelu_tanh")."""
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up
