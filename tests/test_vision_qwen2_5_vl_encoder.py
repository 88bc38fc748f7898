"""Qwen2.5-VL's vision encoder against transformers' `Qwen2_5_VisionTransformerPretrainedModel` on the
same tiny random weights and real photographs' patches (our preprocessing, equal to transformers'),
float32: window attention (windows that bind, partial last windows), the blocks with full attention,
2D rotary positions, the merger."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from wallbreaker.vision.qwen2_5_vl import Qwen25VisionConfig, Qwen25VisionEncoder, window_order
from wallbreaker.vision.qwen2_vl_preprocess import Qwen2VLImageProcessor

Image = pytest.importorskip("PIL.Image")
skdata = pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")

# windows of 56 pixels: 2x2 merge-blocks (4x4 patches); blocks 1 and 3 of 4 attend over the whole image
HF = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14, spatial_merge_size=2,
          temporal_patch_size=2, window_size=56, out_hidden_size=40, fullatt_block_indexes=[1, 3])


@pytest.fixture(scope="module")
def models():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    reference = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**HF)).float().eval()
    with torch.no_grad():  # weights large enough to matter, norms off their neutral values
        for name, p in reference.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1 if p.dim() == 1 else 0.15)
    cfg = Qwen25VisionConfig.from_hf(reference.config.to_dict(), "tiny")
    ours = Qwen25VisionEncoder(cfg, dict(reference.state_dict()))
    return reference, ours


def patches(name: str, max_pixels: int):
    image = Image.fromarray(getattr(skdata, name)())
    return Qwen2VLImageProcessor(max_pixels=max_pixels)(image)


@pytest.mark.parametrize("name, max_pixels", [("astronaut", 28 * 28 * 36), ("chelsea", 28 * 28 * 30),
                                              ("rocket", 28 * 28 * 50), ("camera", 28 * 28 * 4)])
def test_encoder_matches_transformers(models, name, max_pixels):
    reference, ours = models
    x, grid = patches(name, max_pixels)
    with torch.no_grad():
        expected = reference(x, grid_thw=torch.tensor([[1, *grid]])).pooler_output
    got = ours(x, grid)
    assert got.shape == expected.shape == (grid[0] * grid[1] // 4, HF["out_hidden_size"])
    assert (got - expected).abs().max().item() < 1e-5


def test_the_windows_bind(models):  # the test above can fail: full attention everywhere differs
    reference, ours = models
    x, grid = patches("astronaut", 28 * 28 * 36)
    assert len(window_order(grid[0] // 2, grid[1] // 2, 2)[1]) > 4  # several windows
    everywhere = Qwen25VisionEncoder(dataclasses.replace(ours.cfg, fullatt_block_indexes=(0, 1, 2, 3)),
                                     dict(reference.state_dict()))
    assert (everywhere(x, grid) - ours(x, grid)).abs().max().item() > 1e-3


def test_window_order_keeps_partial_windows():
    order, lengths = window_order(3, 5, 2)
    assert lengths == [4, 4, 2, 2, 2, 1]
    assert order[:4].tolist() == [0, 1, 5, 6] and sorted(order.tolist()) == list(range(15))
