"""Hopper (sm_90a) attention kernels: wgmma + TMA, one module per definition kind."""
