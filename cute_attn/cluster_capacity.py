"""How many thread-block clusters of a size a GPU runs at once (``cuOccupancyMaxActiveClusters``), asked once.

A cluster's CTAs run on the SMs of one GPC, so the count is not ``SMs // size``: on the H200 sixteen clusters of 8
one-CTA-an-SM CTAs did not fit at once (MLA decode 16 x 4096 under the cluster merge ran 34.6 -> 51.1 us: a second
wave), while sixty-four clusters of 2 did. A cluster-merge plan (``plan_clusters.py``) is taken only when its clusters
fit in one wave.

The driver answers for a kernel; any kernel with the same block size and shared memory packs the same way, so a
one-instruction kernel loaded from PTX stands in for the attention kernel (asked at planning time on the host, never
while tracing). Without a GPU, or when the driver cannot answer, the count is 0: no cluster plan.
"""

from __future__ import annotations

import ctypes
import functools

_PROBE = "cute_attn_cluster_probe"


def _probe_ptx(major: int) -> bytes:
    version, target = ("8.0", "sm_90") if major < 10 else ("8.7", f"sm_{major}0")
    return (f".version {version}\n.target {target}\n.address_size 64\n"
            f".visible .entry {_PROBE}()\n{{\n\tret;\n}}\n").encode() + b"\0"


class _ClusterDim(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class _AttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("clusterDim", _ClusterDim)]


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttributeValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION


@functools.lru_cache(maxsize=32)
def max_active_clusters(device_index: int, cluster_size: int, threads: int, smem_bytes: int) -> int:
    """Clusters of ``cluster_size`` CTAs of ``threads`` threads and ``smem_bytes`` of dynamic shared memory that
    device ``device_index`` holds at once (0 when unknown). The driver's own entry points through ctypes: the
    Python bindings resolve theirs with ``cuGetProcAddress`` calls that compute-sanitizer reports as API errors."""
    try:
        import torch

        if not torch.cuda.is_available():
            return 0
        major, _ = torch.cuda.get_device_capability(device_index)
        if major < 9:
            return 0
        torch.cuda.init()
        with torch.cuda.device(device_index):
            torch.cuda.current_stream().synchronize()  # the device's primary context current on this thread
            cuda = ctypes.CDLL("libcuda.so.1")
            module, func = ctypes.c_void_p(), ctypes.c_void_p()
            if cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(_probe_ptx(major))) != 0:
                return 0
            try:
                if cuda.cuModuleGetFunction(ctypes.byref(func), module, _PROBE.encode()) != 0:
                    return 0
                if cuda.cuFuncSetAttribute(func, _MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(smem_bytes)) != 0:
                    return 0
                cluster = _LaunchAttribute(id=_CLUSTER_DIMENSION)
                cluster.value.clusterDim = _ClusterDim(cluster_size, 1, 1)
                config = _LaunchConfig(cluster_size, 1, 1, threads, 1, 1, smem_bytes, None,
                                       ctypes.pointer(cluster), 1)
                count = ctypes.c_int(0)
                if cuda.cuOccupancyMaxActiveClusters(ctypes.byref(count), func, ctypes.byref(config)) != 0:
                    return 0
                return count.value
            finally:
                cuda.cuModuleUnload(module)
    except Exception:  # no driver library or entry point: no cluster plans, the combine path
        return 0


__all__ = ["max_active_clusters"]
