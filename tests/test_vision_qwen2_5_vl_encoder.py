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


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny `Qwen2_5_VLForConditionalGeneration` saved by transformers (weights and config only)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": [2, 3, 3]})
    config = Qwen2_5_VLConfig(text_config=text, vision_config={**HF, "out_hidden_size": 64},
                              image_token_id=300, video_token_id=301, vision_start_token_id=302,
                              vision_end_token_id=303)
    torch.manual_seed(1)
    model = Qwen2_5_VLForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p)) if ("norm" in name or "ln_q" in name) else p.normal_(0, 0.15)
    out = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    model.save_pretrained(out)
    return out, model


def test_encoder_from_a_folder_matches_get_image_features(folder):
    from wallbreaker.vision.qwen2_5_vl import load_folder
    path, model = folder
    encoder, processor = load_folder(path)
    images = [processor(Image.fromarray(getattr(skdata, n)()))
              for n in ("coffee", "camera")]  # transformers' default bounds: larger grids, many windows
    pixels = torch.cat([x for x, _ in images])
    grids = torch.tensor([[1, *g] for _, g in images])
    with torch.no_grad():
        expected = model.model.get_image_features(pixels, grids).pooler_output
    for (x, grid), want in zip(images, expected):
        got = encoder(x, grid)
        assert got.shape == want.shape and (got - want).abs().max().item() < 1e-4


def test_mrope_positions_are_get_rope_index(folder):
    from wallbreaker.vision.qwen2_5_vl import mrope_positions
    _, model = folder
    grids = [(8, 12), (6, 4)]  # patches; merged 4x6 (24 tokens) and 3x2 (6 tokens)
    ids = [5, 6, 302] + [300] * 24 + [303, 7, 8, 9, 302] + [300] * 6 + [303, 10, 11]
    offsets = [3, 32]
    types = [1 if t == 300 else 0 for t in ids]
    expected, delta = model.model.get_rope_index(torch.tensor([ids]), torch.tensor([types]),
                                                 image_grid_thw=torch.tensor([[1, *g] for g in grids]))
    got, got_delta = mrope_positions(len(ids), [(o, *g) for o, g in zip(offsets, grids)], 2)
    assert torch.equal(got, expected[:, 0]) and got_delta == int(delta)
    assert got_delta < 0  # the images take fewer positions than tokens: the test can fail
