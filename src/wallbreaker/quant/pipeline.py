"""`quantize_model`: a loaded model in, every Linear weight of its decoder layers quantized out.

The calibrated methods walk the layers in order. For each: run it on the calibration activations
with hooks on its four Linear modules (qkv, o, gate_up, down), quantize them (GPTQ from the
Hessians; AWQ: search and fold scales, then round), write the dequantized weights back into the
model, and run the layer again so the next one sees what the quantized model computes. GPTQ
(AutoGPTQ's "true sequential") runs the layer once per Linear, so that o sees the quantized qkv,
and so on. Embeddings, the output head and norms stay in float. The in-memory model ends up
computing exactly what the written folder loads back as.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from tqdm import tqdm

from ..config import ModelConfig
from ..errors import InvalidRequestError
from .awq import AWQConfig, search_clip, search_scales
from .calibration import InputStats, calibration_sequences, capture_inputs, read_calibration_text
from .fold import fold_scales, folded_tensor_names, read_folded, tie_heads
from .gptq import GPTQConfig, PreparedHessian, gptq_quantize, prepare_hessian
from ..formats.families import family
from ..formats.grid import QuantGrid, QuantizedTensor
from .layerwise import LayerRunner, LinearGroup, linear_groups
from .mixed import allocate_bits, average_bits, candidate_bits
from .rtn import quantize_rtn

METHODS = ("rtn", "gptq", "awq", "mixed")


@dataclass(frozen=True)
class QuantizeConfig:
    method: str
    bits: float  # a whole width, or the target average for "mixed"
    group_size: int = 128
    sym: bool = False
    act_order: bool = False
    nsamples: int = 64
    seqlen: int = 512
    seed: int = 0
    calib: str | None = None  # calibration text file; None: WikiText-2 valid
    damp: float = 0.01
    true_sequential: bool = True  # GPTQ: each Linear's inputs come from the layer with the ones before it quantized
    awq_grid: int = 20
    awq_clip: bool = True  # AWQ: also shrink each group's range (llm-awq's auto_clip); see awq.py
    mixed_quantizer: str = "gptq"  # how "mixed" rounds each tensor at its width: "gptq" | "rtn"
    sensitivity_samples: int = 8  # calibration sequences the mixed sensitivities are measured on
    batch: int = 8  # sequences per layer call

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if not 2 <= self.bits <= 8:
            raise InvalidRequestError(f"bits must be between 2 and 8, got {self.bits}")
        if self.method != "mixed" and self.bits != int(self.bits):
            raise InvalidRequestError("a fractional --bits is an average: use --method mixed")
        if self.group_size < 1 or self.nsamples < 1 or self.seqlen < 2 or self.batch < 1:
            raise InvalidRequestError("group size, nsamples and batch must be positive, seqlen at least 2")
        if self.mixed_quantizer not in ("gptq", "rtn"):
            raise InvalidRequestError("mixed_quantizer must be 'gptq' or 'rtn'")
        if self.act_order and not self.uses_gptq:
            raise InvalidRequestError("--act-order applies to GPTQ only (gptq, or mixed with GPTQ)")

    @property
    def uses_gptq(self) -> bool:
        return self.method == "gptq" or (self.method == "mixed" and self.mixed_quantizer == "gptq")

    def grid(self, bits: int) -> QuantGrid:
        return QuantGrid(bits, self.group_size, self.sym)


@dataclass
class QuantizedModel:
    config: ModelConfig
    settings: QuantizeConfig
    quantized: dict[str, QuantizedTensor]  # canonical names of the Linear weights
    tensors: dict[str, torch.Tensor]  # every other canonical tensor, float32 (AWQ-folded norms included)
    rtn_source: dict[str, torch.Tensor] | None = None  # rtn/awq: the float weights that were rounded
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def bits_per_tensor(self) -> dict[str, int]:
        return {name: q.bits for name, q in self.quantized.items()}

    @property
    def average_bits(self) -> float:
        """Code bits per quantized weight."""
        return average_bits(self.bits_per_tensor, {n: q.codes.numel() for n, q in self.quantized.items()})


Quantizer = Callable[[torch.Tensor, QuantGrid], QuantizedTensor]


def quantize_model(llm, cfg: QuantizeConfig, progress: bool = True, keep_rtn_source: bool = False) -> QuantizedModel:
    """Quantize `llm` (an `LLM` loaded with dtype="float32") in place and return the result."""
    model = llm.model
    mc: ModelConfig = llm.model_config
    if mc.is_moe or family(mc.architecture).writes_fused:
        raise InvalidRequestError(f"quantize does not support {'mixtures of experts' if mc.is_moe else mc.architecture} "
                                  "(fused or expert tensors); quantize with llama.cpp, whose GGUF files load here")
    names = [name for i in range(mc.num_layers) for g in linear_groups(model, i) for name, _, _ in g.parts]
    plan = dict.fromkeys(names, int(cfg.bits))
    quantized: dict[str, QuantizedTensor] = {}
    source: dict[str, torch.Tensor] | None = {} if keep_rtn_source else None
    report: dict[str, Any] = {"method": cfg.method}
    bar = _bar(progress)

    if cfg.method == "rtn":
        for i in bar(range(mc.num_layers), desc="rtn"):
            for g in linear_groups(model, i):
                _quantize_group(g, plan, cfg, quantize_rtn, quantized, source)
    else:
        seqs = calibration_sequences(llm.tokenizer, read_calibration_text(cfg.calib), cfg.nsamples, cfg.seqlen,
                                     cfg.seed)
        runner = LayerRunner(model, cfg.seqlen, cfg.batch)
        if cfg.method == "mixed":
            plan, report["sensitivity"] = _mixed_plan(runner, seqs, cfg, bar)
        hidden = runner.embed(seqs)  # [N, L, hidden]
        awq = AWQConfig(n_grid=cfg.awq_grid, clip=cfg.awq_clip)
        alphas: dict[str, float] = {}
        for i in bar(range(mc.num_layers), desc=cfg.method):
            groups = linear_groups(model, i)
            if cfg.uses_gptq and cfg.true_sequential:
                for g in groups:
                    stats, _ = _capture(runner, i, hidden, [g])
                    _quantize_group(g, plan, cfg, _quantizer(cfg, stats[g.name]), quantized, source)
            else:
                stats, _ = _capture(runner, i, hidden, groups)
                if cfg.method == "awq":  # every fold first: folding o and down rescales rows of qkv and gate_up
                    for g in groups:
                        alphas[f"blk.{i}.{g.name}"] = _awq_group(model.layers[i], g, stats[g.name], cfg, awq, mc)
                for g in groups:
                    _quantize_group(g, plan, cfg, _quantizer(cfg, stats[g.name]), quantized, source)
            hidden = runner.run(i, hidden)
        if alphas:
            report["awq_alpha"] = alphas
    tensors = _float_tensors(llm, set(quantized), cfg.method == "awq")
    return QuantizedModel(mc, cfg, quantized, tensors, source, report)


def _bar(progress: bool):
    def bar(it, desc: str):
        return tqdm(it, desc=desc, unit="layer", file=sys.stderr, disable=not progress, leave=False)
    return bar


def _capture(runner: LayerRunner, i: int, hidden: torch.Tensor,
             groups: list[LinearGroup]) -> tuple[dict[str, InputStats], torch.Tensor]:
    stats = {g.name: InputStats(g.module.weight.shape[1]) for g in groups}
    with capture_inputs({g.name: g.module for g in groups}, stats):
        out = runner.run(i, hidden)
    return stats, out


def _quantizer(cfg: QuantizeConfig, stats: InputStats) -> Quantizer:
    if not cfg.uses_gptq:
        return quantize_rtn
    gcfg = GPTQConfig(damp=cfg.damp, act_order=cfg.act_order)
    prepared: PreparedHessian = prepare_hessian(stats.hessian, gcfg)
    return lambda w, grid: gptq_quantize(w, prepared, grid, gcfg.block_size)


@torch.no_grad()
def _quantize_group(g: LinearGroup, plan: dict[str, int], cfg: QuantizeConfig, quantizer: Quantizer,
                    out: dict[str, QuantizedTensor], source: dict[str, torch.Tensor] | None) -> None:
    """Quantize the parts of one fused Linear (parts of equal width together) and write them back."""
    weight = g.module.weight
    by_bits: dict[int, list[tuple[str, int, int]]] = {}
    for part in g.parts:
        by_bits.setdefault(plan[part[0]], []).append(part)
    for bits, parts in by_bits.items():
        w = torch.cat([weight[r0:r1] for _, r0, r1 in parts]).float()  # [rows, in]
        q = quantizer(w, cfg.grid(bits))
        offset = 0
        for name, r0, r1 in parts:
            out[name] = q.rows(offset, offset + r1 - r0)
            if source is not None:
                source[name] = w[offset:offset + r1 - r0].clone()
            offset += r1 - r0
            weight[r0:r1] = out[name].dequantize().to(weight.dtype)


def _awq_group(layer, g: LinearGroup, stats: InputStats, cfg: QuantizeConfig, awq: AWQConfig,
               mc: ModelConfig) -> float:
    """Search this Linear's AWQ scales, fold them in, and clip its weights' ranges."""
    tie = (lambda s: tie_heads(s, mc.num_heads, mc.num_kv_heads)) if g.name == "o" else None
    grid = cfg.grid(int(cfg.bits))
    gram = stats.gram
    found = search_scales(gram, stats.mean_abs, g.module.weight, grid, awq, tie)
    fold_scales(layer, g.name, found.scales, mc.num_heads, mc.num_kv_heads)
    if awq.clip:
        gram = gram / found.scales[:, None] / found.scales[None, :]  # the Gram matrix of X/s
        weight = g.module.weight
        for name, r0, r1 in g.parts:
            if not name.endswith(("attn_q.weight", "attn_k.weight")):  # q·k products: llm-awq leaves them unclipped
                with torch.no_grad():
                    weight[r0:r1] = search_clip(gram, weight[r0:r1], grid, awq).to(weight.dtype)
    return found.alpha


def _mixed_plan(runner: LayerRunner, seqs: torch.Tensor, cfg: QuantizeConfig, bar) -> tuple[dict[str, int], dict]:
    """Per tensor and candidate width, the relative error of its layer's output when it alone is
    quantized (on float inputs), weighted by how much of an error at that layer's output reaches
    the model's final hidden state (`_propagation_gains`); then the greedy allocation."""
    model = runner.model
    widths = candidate_bits(cfg.bits)
    errors: dict[str, dict[int, float]] = {}
    numel: dict[str, int] = {}
    k = min(cfg.sensitivity_samples, seqs.shape[0])
    hidden = runner.embed(seqs)
    inputs: list[torch.Tensor] = []  # per layer, its float input and output on the first k sequences
    outputs: list[torch.Tensor] = []
    for i in bar(range(model.config.num_layers), desc="mixed: sensitivity"):
        groups = linear_groups(model, i)
        stats, next_hidden = _capture(runner, i, hidden, groups)
        ref = next_hidden[:k]
        inputs.append(hidden[:k])
        outputs.append(ref)
        for g in groups:
            quantizer = _quantizer(cfg, stats[g.name])
            weight = g.module.weight
            for name, r0, r1 in g.parts:
                original = weight[r0:r1].detach().clone()
                errors[name], numel[name] = {}, original.numel()
                for b in widths:
                    with torch.no_grad():
                        weight[r0:r1] = quantizer(original.float(), cfg.grid(b)).dequantize().to(weight.dtype)
                    errors[name][b] = _relative_error(runner.run(i, hidden, k), ref)
                with torch.no_grad():
                    weight[r0:r1] = original
        hidden = next_hidden
    gains = _propagation_gains(runner, inputs, outputs, cfg.grid(widths[len(widths) // 2]), bar)
    weighted = {name: {b: e * gains[int(name.split(".")[1])] for b, e in by_width.items()}
                for name, by_width in errors.items()}
    plan = allocate_bits(numel, weighted, cfg.bits)
    return plan, {"candidates": widths, "errors": errors, "gains": gains, "bits": plan,
                  "average_bits": average_bits(plan, numel)}


@torch.no_grad()
def _propagation_gains(runner: LayerRunner, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
                       grid: QuantGrid, bar) -> list[float]:
    """Per layer: final-hidden-state relative error over that layer's own output error, with the
    whole layer rounded to `grid`. Layer-local errors alone mislead: the residual stream grows with
    depth, so a middle layer's error looks small at its output yet is carried, and amplified, to the
    logits; summing unweighted local errors once gave SmolLM2's layers 11-16 two bits."""
    model = runner.model
    n = len(inputs)

    def finish(i: int, h: torch.Tensor) -> torch.Tensor:
        for j in range(i + 1, n):
            h = runner.run(j, h)
        return model.norm(h.view(-1, h.shape[-1])).float()

    clean_final = finish(n - 1, outputs[n - 1])
    gains = []
    for i in bar(range(n), desc="mixed: propagation"):
        saved = []
        for g in linear_groups(model, i):
            saved.append((g.module.weight, g.module.weight.detach().clone()))
            g.module.weight.copy_(quantize_rtn(g.module.weight.float(), grid).dequantize())
        out = runner.run(i, inputs[i])
        for weight, original in saved:
            weight.copy_(original)
        local = _relative_error(out, outputs[i])
        gains.append(_relative_error(finish(i, out), clean_final) / max(local, 1e-20))
    return gains


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean over tokens of ||Δy||² / ||y||². Per token, because the next layer normalises each token
    on its own, and because a few tokens carry massive activations (SmolLM2: norms 100x the median
    from layer 11 on) that would otherwise make every later layer look insensitive."""
    return ((out - ref).pow(2).sum(-1) / ref.pow(2).sum(-1).clamp(min=1e-12)).mean().item()


def _float_tensors(llm, quantized: set[str], folded: bool) -> dict[str, torch.Tensor]:
    mc: ModelConfig = llm.model_config
    tensors = {name: ref.load().float() for name, ref in llm.files.weights.items() if name not in quantized}
    if folded:
        kv = mc.num_kv_heads * mc.head_dim
        for i, layer in enumerate(llm.model.layers):
            for name, where in folded_tensor_names(i, mc.qkv_bias).items():
                tensors[name] = read_folded(layer, where, kv)
    return tensors
