"""cute-flash: exact attention kernels in the CuTe Python DSL."""
