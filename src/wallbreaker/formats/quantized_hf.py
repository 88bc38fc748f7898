"""wallbreaker's quantized Hugging Face folder: the on-disk layout, written and read here.

config.json carries `"quantization_config": {"quant_method": "wallbreaker", "method", "bits" (or
"bits_per_tensor": {HF module name: bits}), "group_size", "sym", "desc_act"}`. In model.safetensors,
each quantized Linear `X.weight` (X a Hugging Face module name such as model.layers.0.mlp.down_proj)
is stored as:

- `X.qweight` uint8 [out, ceil(in·bits/8)]: each row a little-endian bitstream of `bits`-bit codes
  (quant/packing.py: at 4 bits the low nibble is the even column);
- `X.scales` float16 [out, ceil(in/group_size)];
- `X.zeros` float16 [out, ceil(in/group_size)], asymmetric only (symmetric: z = 2^(bits−1));
- `X.g_idx` int32 [in], with activation order only (else the group of column i is i // group_size);

and reads back as W = (q − z[:, g]) · s[:, g]. Every other tensor is plain float32.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from ..config import ModelConfig, short_repr
from ..errors import ModelFormatError
from .grid import QuantizedTensor
from .packing import pack_codes, packed_row_bytes, unpack_codes
from .families import hf_to_canonical_table
from .weights import WeightRef

QUANT_METHOD = "wallbreaker"
QUANTIZED_PARTS = frozenset({"qweight", "scales", "zeros", "g_idx"})  # the tensors of one quantized module
MIN_BITS, MAX_BITS = 2, 8  # what QuantGrid and the packing support


@dataclass(frozen=True)
class QuantInfo:
    """`WeightRef.quant` of a quantized tensor: its grid, and its parts unpacked on demand."""

    bits: int
    group_size: int
    sym: bool
    act_order: bool
    load: Callable[[], QuantizedTensor]


def is_quantized_folder(hf_config: dict[str, Any]) -> bool:
    q = hf_config.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == QUANT_METHOD


def stored_type(bits: int, group_size: int, act_order: bool) -> str:
    return f"INT{bits}_G{group_size}" + ("_ACT" if act_order else "")


def quantized_state(module: str, q: QuantizedTensor) -> dict[str, torch.Tensor]:
    """The safetensors entries of one quantized weight; `module` is its HF name without `.weight`."""
    state = {f"{module}.qweight": pack_codes(q.codes, q.bits),
             f"{module}.scales": q.scales.to(torch.float16)}
    if q.zeros is not None:
        state[f"{module}.zeros"] = q.zeros.to(torch.float16)
    if q.g_idx is not None:
        state[f"{module}.g_idx"] = q.g_idx.to(torch.int32).clone()
    return state


def in_features(name: str, cfg: ModelConfig) -> int:
    if name.endswith("attn_output.weight"):
        return cfg.num_heads * cfg.head_dim
    if name.endswith("ffn_down.weight"):
        return cfg.intermediate_size
    return cfg.hidden_size


def read_quantized_weights(path: Path, cfg: ModelConfig, qcfg: Any) -> dict[str, WeightRef]:
    """WeightRefs of the quantized Linear weights in folder `path` (the float ones are read as usual).
    Every part's shape and type is checked here, from the headers; group indices when loaded."""
    where = f"{path}/config.json: quantization_config"
    if not isinstance(qcfg, dict):
        raise ModelFormatError(f"{where} is not a JSON object")
    if "group_size" not in qcfg or "sym" not in qcfg:
        raise ModelFormatError(f"{where}: incomplete, needs group_size and sym")
    group, sym, act = qcfg["group_size"], qcfg["sym"], qcfg.get("desc_act", False)
    if not _is_int(group) or group < 1:
        raise ModelFormatError(f"{where}: group_size must be a positive integer, got {short_repr(group)}")
    for key, value in (("sym", sym), ("desc_act", act)):
        if not isinstance(value, bool):
            raise ModelFormatError(f"{where}: {key} must be true or false, got {short_repr(value)}")
    per_tensor = qcfg.get("bits_per_tensor") or {}
    if not isinstance(per_tensor, dict):
        raise ModelFormatError(f"{where}: bits_per_tensor must be a JSON object, got {short_repr(per_tensor)}")
    uniform = qcfg.get("bits")
    weights: dict[str, WeightRef] = {}
    table = hf_to_canonical_table(cfg.architecture, cfg.num_layers)
    for file in sorted(path.glob("*.safetensors")):
        handle = safe_open(str(file), framework="pt")
        keys = set(handle.keys())
        for hf_name, name in table.items():
            module = hf_name.removesuffix(".weight")
            if f"{module}.qweight" not in keys:
                continue
            bits = per_tensor.get(module, uniform)
            if bits is None:
                raise ModelFormatError(f"{path}: no bit width for {module} in quantization_config")
            if not _is_int(bits) or not MIN_BITS <= bits <= MAX_BITS:
                raise ModelFormatError(f"{where}: bits of {module} must be an integer from {MIN_BITS} to {MAX_BITS}, "
                                       f"got {short_repr(bits)}")
            out_rows = handle.get_slice(f"{module}.qweight").get_shape()[0]
            weights[name] = _weight_ref(handle, keys, module, name, bits, group, sym, act,
                                        (out_rows, in_features(name, cfg)), file)
    return weights


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_parts(handle, keys: set[str], module: str, bits: int, group: int, sym: bool, act: bool,
                 shape: tuple[int, int], file: Path) -> None:
    """Each part has the shape and type `shape` (out, in) implies, or the folder is refused."""
    out, n = shape
    groups = -(-n // group)
    expected = {"qweight": ((out, packed_row_bytes(n, bits)), {"U8"}), "scales": ((out, groups), {"F16", "F32", "BF16"})}
    if not sym:
        expected["zeros"] = ((out, groups), {"F16", "F32", "BF16"})
    if act:
        expected["g_idx"] = ((n,), {"I32", "I64"})
    for part, (want, dtypes) in expected.items():
        key = f"{module}.{part}"
        if key not in keys:
            raise ModelFormatError(f"{file}: {key} is missing (the quantization_config needs it)")
        sl = handle.get_slice(key)
        got, dtype = tuple(sl.get_shape()), sl.get_dtype()
        if got != want or dtype not in dtypes:
            raise ModelFormatError(f"{file}: {key} is {dtype} {got}, expected {'/'.join(sorted(dtypes))} {want}")


def _weight_ref(handle, keys: set[str], module: str, name: str, bits: int, group: int, sym: bool, act: bool,
                shape: tuple[int, int], file: Path) -> WeightRef:
    _check_parts(handle, keys, module, bits, group, sym, act, shape, file)
    parts = [f"{module}.{p}" for p in ("qweight", "scales", "zeros", "g_idx") if f"{module}.{p}" in keys]
    nbytes = 0
    for p in parts:
        sl = handle.get_slice(p)
        numel = 1
        for d in sl.get_shape():
            numel *= d
        nbytes += numel * {"U8": 1, "F16": 2, "I32": 4, "F32": 4}.get(sl.get_dtype(), 4)
    groups = -(-shape[1] // group)

    def load_quant() -> QuantizedTensor:
        codes = unpack_codes(handle.get_tensor(f"{module}.qweight"), bits, shape[1])
        zeros = None if sym else handle.get_tensor(f"{module}.zeros").float()
        g_idx = None
        if act:
            g_idx = handle.get_tensor(f"{module}.g_idx")
            if g_idx.numel() and not (0 <= int(g_idx.min()) and int(g_idx.max()) < groups):
                raise ModelFormatError(f"{file}: {module}.g_idx holds groups {int(g_idx.min())} to "
                                       f"{int(g_idx.max())}, outside the {groups} groups of its scales")
            g_idx = g_idx.to(torch.int32)
        return QuantizedTensor(codes, handle.get_tensor(f"{module}.scales").float(), zeros, bits, group, g_idx)

    def load() -> torch.Tensor:
        return load_quant().dequantize()

    return WeightRef(name, shape, stored_type(bits, group, act), nbytes, load,
                     quant=QuantInfo(bits, group, sym, act, load_quant))
