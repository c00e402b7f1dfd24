"""cute-flash: exact attention kernels in the CuTe Python DSL.

Importing the package registers the ``torch.ops.cute_flash`` custom ops and loads the launch stack:
the DSL, the kernel configs and the runtime that links cached kernels (the kernels themselves are
traced when a variant is first compiled), so a launch of a cached variant costs milliseconds.
"""

from cute_flash.api import (
    attention,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    quantize_qkv,
)
from cute_flash.block_mask import BlockMask, create_block_mask

__version__ = "0.1.0"

__all__ = ["BlockMask", "__version__", "attention", "create_block_mask", "flash_attn_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache", "quantize_qkv"]
