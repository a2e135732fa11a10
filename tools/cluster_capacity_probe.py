"""Print how many clusters of 2, 4 and 8 one-CTA-an-SM CTAs this GPU runs at once (``cute_attn.cluster_capacity``).

    python tools/cluster_capacity_probe.py

The MLA decode kernel's shared memory and block size (the sm_90a one-token build with ``cluster_merge``), so the
counts are the ones the cluster-merge plans are checked against.
"""

from __future__ import annotations

import dataclasses

import torch


def main() -> int:
    from cute_attn import api
    from cute_attn.ops import mla_decode

    base = api._config_for(mla_decode.ONE_TOKEN_SPEC, 16, 1, 576, 512, 64, "sm_90a")
    device = torch.device("cuda", torch.cuda.current_device())
    print(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).multi_processor_count, "SMs")
    for k in (2, 4, 8):
        print(f"clusters of {k}: {mla_decode.cluster_capacity(dataclasses.replace(base, cluster_merge=k), device)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
