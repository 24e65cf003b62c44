"""Triton helpers of the fused decode attention for a paged store (:mod:`kvcx.codecs.paged`): a tile's row pointers
through the block table. Used by :func:`kvcx.codecs.triton_kernels.attention.attend_packed_kernel`.
"""
import triton
import triton.language as tl


@triton.jit
def _rows(kc_row, vc_row, ks_row, kz_row, vs_row, vz_row, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, page_row,
          tb, n, Hkv, PAGE: tl.constexpr, D: tl.constexpr, KG: tl.constexpr, K_CHANNEL: tl.constexpr,
          VG: tl.constexpr, V_CHANNEL: tl.constexpr):
    """The row pointers of the tile from token ``tb``: the slab's own (``PAGE`` 0), or for a paged store its page's
    (from the block table's row ``page_row``), such that token tb's offsets land at its place in the page."""
    if PAGE:
        slot = tl.load(page_row + tb // PAGE).to(tl.int64) * Hkv + n % Hkv
        first = tb - tb % PAGE
        ksr, kzr = _page_params(ks_ptr, kz_ptr, slot, first, PAGE, D, KG, K_CHANNEL)
        vsr, vzr = _page_params(vs_ptr, vz_ptr, slot, first, PAGE, D, VG, V_CHANNEL)
        return (kc_ptr + slot * (PAGE * D // 2) - first * (D // 2), vc_ptr + slot * (PAGE * D // 2) - first * (D // 2),
                ksr, kzr, vsr, vzr)
    else:
        return kc_row, vc_row, ks_row, kz_row, vs_row, vz_row


@triton.jit
def _page_params(s_ptr, z_ptr, slot, first, PAGE: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                 CHANNEL: tl.constexpr):
    """Scale and zero-point row pointers of a paged store's slot (a page's KV head) such that the kernel's offsets
    of token ``first`` + i (the page's first token and on) land at group i's place in the slot: per-channel
    blocks of G tokens ([slots, PAGE / G, D]) or per-token groups of G values ([slots, PAGE D / G])."""
    if CHANNEL:
        off = (slot * (PAGE // G) - first // G) * D
    else:
        off = slot * (PAGE * D // G) - first * D // G
    return s_ptr + off, z_ptr + off
