"""Hardware limits and the configuration rules that several kernels share (both arches).

Each kernel's ``check_config`` starts from these and adds its own rules; every rule returns a readable
reason or None, so ``can_implement``-style rejections read the same everywhere.
"""

from __future__ import annotations

SMEM_LIMIT_BYTES = 227 * 1024  # opt-in dynamic shared memory per CTA on H100/H200 and B200
TMEM_COLUMNS = 512  # tensor memory of one Blackwell SM (128 lanes x 512 columns of 32 bits)


def target_reason(config, kind: str, arch: str) -> str | None:
    """The config is for this kernel (kind and arch) and passes its kind's shape rules (``shape_reason``)."""
    if config.kind != kind or config.arch != arch:
        return f"this kernel is {kind} on {arch}, not {config.kind} on {config.arch}"
    return config.shape_reason()


#: the sm_90a GQA kernels gather rows (cp.async, 16 bytes a copy) only for pages below one 8-row swizzle atom
ROW_GATHER_MAX_PAGE = 8


def uses_row_gather(config, policy_page_sizes: tuple) -> bool:
    """An sm_90a GQA kernel's choice: ``config.row_gather``, or (None) whether the page size is in its policy."""
    return config.page_size in policy_page_sizes if config.row_gather is None else bool(config.row_gather)


def row_gather_reason(config, policy_page_sizes: tuple, rows_per_warp: int) -> str | None:
    """Rows for pages of at most ``ROW_GATHER_MAX_PAGE`` keys, whole pages in each gathering warp's rows."""
    largest = min(ROW_GATHER_MAX_PAGE, rows_per_warp)
    if uses_row_gather(config, policy_page_sizes) and config.page_size > largest:
        return (f"row_gather at page_size={config.page_size}: K/V rows are gathered for pages of at most "
                f"{largest} keys (a page inside one warp's rows; larger pages are TMA boxes)")
    return None


def row_gather_choice_reason(config) -> str | None:
    """``row_gather`` (rows or page boxes) is a choice of the sm_90a kernels only; the sm_100a ones leave it None."""
    if getattr(config, "row_gather", None) is not None:
        return (f"row_gather={config.row_gather} is a choice of the sm_90a kernels only (sm_100a gathers one-key "
                "pages and the MLA latent rows with TMA gather4, larger GQA pages as boxes)")
    return None


def smem_reason(nbytes: int, limit: int = SMEM_LIMIT_BYTES) -> str | None:
    if nbytes > limit:
        return f"needs {nbytes} bytes of shared memory, more than {limit}"
    return None


def page_box_reason(config) -> str | None:
    """A K/V page loaded as one TMA box inside a key tile: pages tile the key tile (powers of two up to kv_tile).

    Boxes of fewer than 8 rows (pages 1, 2, 4) land at a row offset inside a 128B-swizzled 8-row atom: TMA
    swizzles by shared-memory address and the tiles are 1024 B aligned, so every row lands where the swizzled
    layout expects it (the DSL builds the atom for the (page_size, D) slice of the stage layout)."""
    if config.page_size < 1 or config.page_size > config.kv_tile or config.kv_tile % config.page_size:
        return (f"page_size={config.page_size} must be a power of two in 1..kv_tile={config.kv_tile}: a page "
                "is one TMA box of page_size rows inside a key tile")
    return None


def mla_definition_reason(config, qk_dim: int = 576, v_dim: int = 512) -> str | None:
    """What every absorbed-MLA prefill kernel is built for: causal, (ckv + kpe, ckv) heads, one latent KV head,
    page sizes that are powers of two in 1..128 (row gathers: a key's row is found by a shift and a mask)."""
    if not config.causal:
        return f"the {config.arch} MLA prefill kernel is built causal (the definition); causal=False is not built"
    if (config.head_dim_qk, config.head_dim_v) != (qk_dim, v_dim):
        return f"MLA head dims must be (ckv + kpe, ckv) = ({qk_dim}, {v_dim})"
    if config.num_kv_heads != 1:
        return f"num_kv_heads={config.num_kv_heads} must be 1 (one latent KV row per key)"
    ps = config.page_size
    if ps < 1 or ps > 128 or ps & (ps - 1):
        return f"page_size={ps} must be a power of two in 1..128 (the MLA kernels gather one latent row per key)"
    return None
