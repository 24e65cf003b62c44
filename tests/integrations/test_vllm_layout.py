"""vLLM's CPU cache, the real components end to end, without a server: keys and values written by vLLM's own
cache-write kernel (``cpu_attn_reshape_and_cache``, one per ISA), copied into an LMCache chunk by LMCache's own
block transfer (the CPU path of the multiprocess connector), are the keys and values kvcx's ``vllm_cpu`` layout
finds there, bit for bit; and a chunk kvcx rebuilds goes back into vLLM's cache as vLLM wrote it."""
import os

import numpy as np
import pytest

if os.environ.get("CI"):  # CI installs the extras: these tests must run there, never skip
    import lmcache  # noqa: F401
    import torch
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")
    pytest.importorskip("lmcache")
    torch = pytest.importorskip("torch")

from kvcx.codecs.dtypes import BFLOAT16  # noqa: E402
from kvcx.formats.chunk import ChunkCodec  # noqa: E402
from kvcx.formats.layouts import VllmCpu  # noqa: E402
from kvcx.integrations.lmcache import host_has_amx  # noqa: E402

from helpers import codec_roundtrip  # noqa: E402

L, NB, H = 2, 6, 3


def _vllm_cache(isa, dtype, bs, d, blocks, seed=0):
    """(caches, keys, values): vLLM's per-layer CPU caches [NB, H, bs, 2d] with len(blocks) blocks written by
    vLLM's kernel for ``isa``, and the [L, T, H * d] keys and values written."""
    import vllm._custom_ops as ops

    g = torch.Generator().manual_seed(seed)
    t = len(blocks) * bs
    key, value = (torch.randn(L, t, H, d, generator=g).to(dtype) for _ in range(2))
    slots = torch.tensor([blocks[i // bs] * bs + i % bs for i in range(t)], dtype=torch.int64)
    caches = []
    for layer in range(L):
        kv = torch.zeros(NB, H, bs, 2 * d, dtype=dtype)
        kc, vc = kv.view(NB, H, 2 * bs, d).chunk(2, dim=2)     # as vLLM's CPU attention splits it
        ops.cpu_attn_reshape_and_cache(key[layer], value[layer], kc, vc, slots, isa)
        caches.append(kv)
    return caches, key.reshape(L, t, H * d), value.reshape(L, t, H * d)


def _transfer(caches, obj, blocks, bs, d, to_chunk: bool):
    """LMCache's block transfer between vLLM's caches and one chunk (the CPU multiprocess connector's path)."""
    import lmcache.lmcache_native as native
    from lmcache.v1.platform.torch_ops.mp_mem_kernels import multi_layer_block_kv_transfer

    sd = native.PageBufferShapeDesc()
    sd.kv_size, sd.nl, sd.nb, sd.bs, sd.nh, sd.hs = 1, L, NB, bs, H, 2 * d
    sd.element_size, sd.block_stride_elems, sd.dtype = obj.element_size(), H * bs * 2 * d, obj.dtype
    direction = native.TransferDirection.D2H if to_chunk else native.TransferDirection.H2D
    multi_layer_block_kv_transfer(caches, [obj], torch.tensor(blocks), "cpu", direction, sd, obj.shape[1],
                                  native.EngineKVFormat.NL_X_NB_NH_BS_CS, 0)


def _np(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).numpy()


# (isa, block size, head size, dtype): vLLM uses its amx kernel for BF16 only
# The amx cases run where vLLM itself would pick amx, a CPU with AMX tiles (its cpu_attn asks torch the same): vLLM's
# amx kernel raises "Unsupported CPU attention configuration" on any other CPU, so there is nothing of vLLM's to
# read there (the vec layouts are this CPU's)
CASES = [(isa, bs, d, dt) for isa, bs, d in [("vec", 128, 64), ("vec", 32, 128), ("vec16", 32, 80)]
         for dt in ("bfloat16", "float16")] + ([("amx", 32, 64, "bfloat16"), ("amx", 64, 128, "bfloat16")]
                                               if host_has_amx() else [])


@pytest.mark.parametrize("isa,bs,d,dtype", CASES)
def test_vllm_writes_what_the_layout_reads(isa, bs, d, dtype):
    dt = getattr(torch, dtype)
    blocks = [4, 1]                                   # engine blocks out of order, as a running engine has them
    caches, key, value = _vllm_cache(isa, dt, bs, d, blocks)
    obj = torch.zeros(L, len(blocks) * bs, H * 2 * d, dtype=dt)
    _transfer(caches, obj, blocks, bs, d, to_chunk=True)
    lay = VllmCpu(bs, isa)
    x = _np(obj).view(BFLOAT16 if dtype == "bfloat16" else np.float16)
    g = lay.geometry(x.shape, d, "chunk")
    k, v = lay.split(x, g)
    assert np.array_equal(k.view(np.int16), _np(key)) and np.array_equal(v.view(np.int16), _np(value))
    # back: a chunk rebuilt from the planes, through LMCache's transfer into fresh caches, is vLLM's cache
    rebuilt = np.zeros_like(x)
    lay.join([k, v], rebuilt, g)
    fresh = [torch.zeros_like(c) for c in caches]
    _transfer(fresh, torch.from_numpy(rebuilt.view(np.int16)).view(dt), blocks, bs, d, to_chunk=False)
    for a, b in zip(fresh, caches):
        assert torch.equal(a[blocks].view(torch.int16), b[blocks].view(torch.int16))


def test_a_vllm_chunk_through_kvcx_decodes_into_vllm_s_layout():
    """A chunk of vLLM's cache encoded by kvcx and decoded into a fused plane holds, in vLLM's order, the keys
    and values the same codec gives when it is handed the keys and values themselves."""
    dt, bs, d = torch.bfloat16, 128, 64
    caches, key, value = _vllm_cache("vec", dt, bs, d, [2, 5], seed=3)
    obj = torch.zeros(L, 2 * bs, H * 2 * d, dtype=dt)
    _transfer(caches, obj, [2, 5], bs, d, to_chunk=True)
    x = _np(obj).view(BFLOAT16)
    lay = VllmCpu(bs, "vec")
    _, y = codec_roundtrip(ChunkCodec(plane_layout=lay), x)
    kv = np.stack([_np(key).view(BFLOAT16), _np(value).view(BFLOAT16)])
    _, want = codec_roundtrip(ChunkCodec(), kv)
    k, v = lay.split(y, lay.geometry(y.shape, d, "chunk"))
    assert np.array_equal(k.view(np.int16), want[0].view(np.int16))
    assert np.array_equal(v.view(np.int16), want[1].view(np.int16))
