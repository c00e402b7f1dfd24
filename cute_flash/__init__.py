"""cute-flash: exact attention kernels in the CuTe Python DSL.

Importing the package registers the ``torch.ops.cute_flash`` custom ops; the DSL and the kernels
are only imported when a kernel is first launched or compiled.
"""

from cute_flash.api import attention, flash_attn_func, flash_attn_varlen_func, quantize_qkv

__version__ = "0.1.0"

__all__ = ["__version__", "attention", "flash_attn_func", "flash_attn_varlen_func", "quantize_qkv"]
