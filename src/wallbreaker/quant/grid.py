"""Moved to formats/grid.py, where formats/ and layers/ read int-code grids without importing quant/.
Kept only because kernels/blocks.py still imports QuantizedTensor from here: once it imports
`..formats.grid`, delete this file (tests/test_layering.py lists the edge as the one exception)."""
from ..formats.grid import QuantizedTensor

__all__ = ["QuantizedTensor"]
