"""`_C.lora_add_` (csrc/lora_ops.cpp), each row's own LoRA adapter slot's product added beside a
layer's matmul, against the same product in PyTorch, at every kernel level this CPU runs."""
from __future__ import annotations

import pytest
import torch

from wallbreaker import _C, kernels

LEVELS = [level for level in kernels.LEVELS if kernels.LEVELS.index(level) <= kernels.LEVELS.index(kernels.cpu_isa())]
SLOTS, WIDTH, IN, OUT = 3, 24, 200, 333  # widths and sizes off the 16 lanes, to reach the tails


@pytest.fixture(params=LEVELS)
def level(request):
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(None)


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SLOTS * WIDTH, IN, generator=g), torch.randn(SLOTS * WIDTH, OUT, generator=g)


def test_each_row_gets_its_own_slots_product_and_rows_without_one_are_untouched(level):
    a, b_t = _weights()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(9, IN, generator=g), torch.randn(9, OUT, generator=g)
    slots = torch.tensor([0, 1, 2, 3, 1, 0, 3, 3, 2])
    got = y.clone()
    _C.lora_add_(got, x, a, b_t, slots, WIDTH)
    for t, s in enumerate(slots.tolist()):
        if s == 0:
            assert torch.equal(got[t], y[t])
            continue
        rows = slice((s - 1) * WIDTH, s * WIDTH)
        want = y[t].double() + (a[rows].double() @ x[t].double()) @ b_t[rows].double()
        torch.testing.assert_close(got[t].double(), want, atol=1e-3, rtol=1e-4)


def test_a_rows_bits_do_not_depend_on_the_rest_of_the_batch(level):
    """Batch-invariant as it stands: row 0 alone, and among 40 rows of other slots, is the same bits."""
    a, b_t = _weights()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(40, IN, generator=g), torch.randn(40, OUT, generator=g)
    slots = torch.randint(0, SLOTS + 1, (40,), generator=g)
    slots[0] = 2
    alone, batch = y[:1].clone(), y.clone()
    _C.lora_add_(alone, x[:1], a, b_t, slots[:1], WIDTH)
    _C.lora_add_(batch, x, a, b_t, slots, WIDTH)
    assert torch.equal(alone[0], batch[0])


def test_bad_shapes_and_slots_are_refused():
    a, b_t = _weights()
    x, y = torch.randn(2, IN), torch.randn(2, OUT)
    with pytest.raises(RuntimeError, match="slot out of range"):
        _C.lora_add_(y, x, a, b_t, torch.tensor([0, SLOTS + 1]), WIDTH)
    with pytest.raises(RuntimeError, match="float32"):
        _C.lora_add_(y, x, a, b_t[:, :-1].contiguous(), torch.tensor([1, 1]), WIDTH)
    with pytest.raises(RuntimeError, match="float32"):
        _C.lora_add_(y.double(), x, a, b_t, torch.tensor([1, 1]), WIDTH)
