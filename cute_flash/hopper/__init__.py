"""Hopper (sm90a) kernels: TMA + wgmma + mbarrier pipelines + warp specialization."""
