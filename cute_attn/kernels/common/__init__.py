"""Arch-independent building blocks shared by the sm_90a and sm_100a kernels."""
