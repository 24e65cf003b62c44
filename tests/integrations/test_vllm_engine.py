"""kvcx inside a real serving engine: vLLM's CPU build serving the embedded model, LMCache's multiprocess server
(``kvcx lmcache-server``) storing vLLM's KV caches through the kvcx serde into an FS store and into a real Valkey
server. Prompts are stored, both servers restarted, the prompts answered from the store; stored chunks damaged in
three ways are misses that vLLM recomputes; Valkey killed while serving, requests are still answered, and stores
resume when it is back; a Valkey cluster's primary killed while serving, likewise once its replica is promoted.
Every server runs on free loopback ports and is stopped by its pid."""
import os
import time

import numpy as np
import pytest

if os.environ.get("CI"):  # CI installs the extras: these tests must run there, never skip
    import lmcache  # noqa: F401
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")
    pytest.importorskip("lmcache")

from kvcx.formats.chunk import read_header  # noqa: E402
from kvcx.formats.layouts import VllmCpu  # noqa: E402
from kvcx.integrations import engine_local as el  # noqa: E402
from kvcx.integrations import lmcache_local as ls  # noqa: E402
from kvcx.integrations.lmcache import host_has_amx  # noqa: E402

pytestmark = pytest.mark.engine

CHUNK = 256                     # LMCache's chunk size (tokens)
RAW_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2   # the embedded model's BF16 KV: layers x (K, V) x heads x dim x 2 B
GENERATED = 12                  # tokens compared a prompt
NAMES = ("ok", "truncated", "flipped", "swapped", "donor", "outage", "after")


@pytest.fixture(scope="module")
def checkpoint():
    from kvcx.quality.engine_model import engine_checkpoint

    return engine_checkpoint()


@pytest.fixture(scope="module")
def prompts(checkpoint, wikitext_path):
    """Token ids of held-out WikiText-2 passages, two LMCache chunks and a little more each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    text = wikitext_path.read_text(encoding="utf-8")
    return {name: tok(text[200_000 + 9_000 * i:][:4_000])["input_ids"][:2 * CHUNK + 40]
            for i, name in enumerate(NAMES)}


class Servers:
    """LMCache's server with the kvcx serde over ``adapters``, and vLLM connected to it; stopped by pid."""

    def __init__(self, checkpoint, adapters, logs, tag):
        self.lm = el.start_lmcache_server(adapters, log=logs / f"lmcache-{tag}.log")
        try:
            # vLLM's CPU worker inside its engine core's process: one process fewer to start a pair, the same
            # vLLM code serving and the same connector storing and loading through the serde
            self.vl = el.start_vllm(checkpoint, log=logs / f"vllm-{tag}.log", lmcache_port=self.lm.port,
                                    max_model_len=2048, executor="uni")
        except BaseException:
            self.lm.stop()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.vl.stop()
        self.lm.stop()


def _wait(fn, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not reached in {timeout:.0f} s")


def _files(path):
    return {p for p in path.rglob("*") if p.is_file()}


def _tokens(choice):
    return choice["token_ids"]


def _check_kvcx_chunks(blobs):
    """Every stored object is a kvcx chunk of vLLM's CPU layout, in the order vLLM's CPU attention keeps on this
    host (``amx`` for BF16 where the CPU has AMX tiles, else ``vec``: the serde resolves it as vLLM does); the bytes
    a token it holds."""
    sizes = []
    for b in blobs:
        h = read_header(np.frombuffer(b, np.uint8))
        want = VllmCpu(el.CPU_BLOCK_SIZE, "auto", host_has_amx()).resolve(h["dtype"], h["head_dim"])
        assert h["layout"] == want and (h["layers"], h["tokens"]) == (30, CHUNK), (h["layout"], want)
        sizes.append(len(b))
    per_token = np.mean(sizes) / CHUNK
    assert per_token <= 0.28 * RAW_BYTES_PER_TOKEN, per_token
    return per_token


def _served_from_the_store(vl, prompt, ref):
    """Teacher-forced greedy agreement with the first round's uncompressed continuation ``ref`` (vLLM's own
    computation: nothing was in the store yet) and the KL of their top logprobs."""
    tf = el.teacher_forced(vl.port, prompt, _tokens(ref))
    assert tf["agreement"] >= 0.9, tf
    kld = el.top_kld(ref["logprobs"]["top_logprobs"], tf["top_logprobs"])
    assert kld < 0.1, kld
    return tf


@pytest.fixture(scope="module")
def valkey():
    """A real Valkey server on a free loopback port: {"proc": its process (replaced when restarted), "port"}."""
    proc, port = ls.start_valkey()
    state = {"proc": proc, "port": port}
    try:
        yield state
    finally:
        ls.stop(state["proc"])


@pytest.fixture(scope="module")
def first_round(checkpoint, prompts, valkey, tmp_path_factory):
    """Every prompt computed once by vLLM with LMCache's server storing into an FS store and into Valkey (two L2
    adapters, both through the kvcx serde): each prompt's answer with its top logprobs (the reference: the store
    was empty, so vLLM computed every token itself; the prompts share no prefix vLLM's own cache could reuse), and
    which files each prompt's chunks went to."""
    logs = tmp_path_factory.mktemp("engine")
    store, serde = logs / "kv", el.serde_config()
    adapters = [el.fs_adapter(store, serde), el.valkey_adapter(valkey["port"], serde)]
    written, computed, reference = {}, {}, {}
    with Servers(checkpoint, adapters, logs, "first") as s:
        for name in NAMES:
            before = _files(store)
            reference[name] = el.complete(s.vl.port, prompts[name], max_tokens=GENERATED, logprobs=5)["choices"][0]
            computed[name] = _tokens(reference[name])
            _wait(lambda: len(_files(store) - before) >= 2, what=f"{name}'s chunks stored")
            written[name] = sorted(_files(store) - before)
        _wait(lambda: len(el.resp_values(valkey["port"])) >= 2 * len(NAMES), what="chunks stored in Valkey")
        counts = el.lmcache_counts(s.lm)
    assert counts["failed_stores"] == 0 and counts["stored_tokens"] >= len(NAMES) * 2 * CHUNK, counts
    return {"store": store, "logs": logs, "written": written, "computed": computed, "reference": reference,
            "per_token": _check_kvcx_chunks([f.read_bytes() for f in _files(store)] +
                                            list(el.resp_values(valkey["port"]).values()))}


def test_fs_store_restart_and_damaged_chunks(checkpoint, prompts, first_round):
    store, written, computed = first_round["store"], first_round["written"], first_round["computed"]
    reference = first_round["reference"]
    for f in written["truncated"]:                       # damage three prompts' chunks, each its own way
        f.write_bytes(f.read_bytes()[:-1000])
    for i, f in enumerate(written["flipped"]):
        raw = bytearray(f.read_bytes())
        raw[4096 + 997 * i] ^= 0x08
        f.write_bytes(bytes(raw))
    for f, g in zip(written["swapped"], written["donor"]):   # another key's valid chunk in its place
        f.write_bytes(g.read_bytes())

    adapters = [el.fs_adapter(store, el.serde_config())]
    with Servers(checkpoint, adapters, first_round["logs"], "fs") as s:
        _served_from_the_store(s.vl, prompts["ok"], reference["ok"])
        hits = el.lmcache_counts(s.lm)
        assert hits["l2_hits"] >= 2 and hits["retrieved_tokens"] >= CHUNK, hits
        # Both chunks handed to vLLM from the store, unless LMCache's first prefetch on the cold server retained
        # fewer keys than the store holds (it can report "1/2 retained keys (0 L1, 1 L2)", then "2/2 (1 L1, 1 L2)"
        # at every later request): vLLM then computes the second chunk and keeps it in its own prefix
        # cache. Then a later prefetch must have found every key, one at least in L2 (read through the serde).
        first = hits["prefetches"][0]
        assert hits["retrieved_tokens"] >= 2 * CHUNK or first[0] < first[1] and any(
            r == n and l2 >= 1 for r, n, _, l2 in hits["prefetches"][1:]), hits
        for name in ("truncated", "flipped", "swapped"):
            out = el.complete(s.vl.port, prompts[name], max_tokens=GENERATED)["choices"][0]
            assert _tokens(out) == computed[name], name    # recomputed: the uncompressed answer of the first round
        counts = el.lmcache_counts(s.lm)
        assert s.vl.alive() and s.lm.alive()
    assert counts["retrieved_tokens"] == hits["retrieved_tokens"], counts   # nothing damaged was handed to vLLM
    assert counts["failed_loads"] >= 2, counts                          # the serde refused what it read


def test_valkey_store_restart_and_outage(checkpoint, prompts, first_round, valkey):
    port, computed, reference = valkey["port"], first_round["computed"], first_round["reference"]
    adapters = [el.valkey_adapter(port, el.serde_config())]
    with Servers(checkpoint, adapters, first_round["logs"], "valkey") as s:
        _served_from_the_store(s.vl, prompts["ok"], reference["ok"])
        assert el.lmcache_counts(s.lm)["l2_hits"] >= 2
        ls.stop(valkey["proc"])                                     # Valkey killed while serving
        out = el.complete(s.vl.port, prompts["outage"], max_tokens=GENERATED)["choices"][0]
        assert _tokens(out) == computed["outage"]                    # answered, recomputed
        valkey["proc"], _ = ls.start_valkey(port)                   # back on the same port, empty
        out = el.complete(s.vl.port, prompts["after"], max_tokens=GENERATED)["choices"][0]
        assert _tokens(out) == computed["after"]
        _wait(lambda: len(el.resp_values(port)) >= 2, what="stores resumed")
        assert s.vl.alive() and s.lm.alive()
    assert abs(_check_kvcx_chunks(el.resp_values(port).values()) - first_round["per_token"]) < 1e-9


def test_valkey_cluster_store_and_a_primary_killed(checkpoint, prompts, first_round, tmp_path):
    """LMCache's server on a real Valkey cluster (3 primaries + 3 replicas, its valkey adapter in cluster mode, the
    six nodes as seeds) through the kvcx serde: vLLM's chunks stored across the primaries, a fresh server pair served
    from them; a primary killed while serving: the request is answered, the replica is promoted, later requests are
    answered and stored again. Every answer is the one vLLM computes alone (0 wrong answers)."""
    cluster = ls.start_valkey_cluster(tmp_path / "cluster", primaries=3, replicas=1, node_timeout_ms=1000)
    primaries = cluster.ports[:3]
    held = lambda: sum(ls.resp(p, "DBSIZE") for p in cluster.ports[:6] if cluster.procs[p].poll() is None   # noqa
                       and cluster.role(p) == "master")
    computed, reference = first_round["computed"], first_round["reference"]
    try:
        adapters = [el.valkey_cluster_adapter(cluster.startup_nodes, el.serde_config())]
        with Servers(checkpoint, adapters, first_round["logs"], "cluster-a") as s:
            assert _tokens(el.complete(s.vl.port, prompts["ok"], max_tokens=GENERATED)["choices"][0]) == computed["ok"]
            _wait(lambda: held() >= 2, what="chunks stored in the cluster")
            assert el.lmcache_counts(s.lm)["failed_stores"] == 0
        with Servers(checkpoint, adapters, first_round["logs"], "cluster-b") as s:
            _served_from_the_store(s.vl, prompts["ok"], reference["ok"])
            assert el.lmcache_counts(s.lm)["l2_hits"] >= 2
            victim = next(p for p in primaries if ls.resp(p, "DBSIZE"))
            heir = cluster.ports[3 + primaries.index(victim)]
            before = held()
            os.kill(cluster.procs[victim].pid, 9)                   # a primary killed while serving
            cluster.procs[victim].wait()
            out = el.complete(s.vl.port, prompts["outage"], max_tokens=GENERATED)["choices"][0]
            assert _tokens(out) == computed["outage"]
            _wait(lambda: cluster.role(heir) == "master", timeout=30, what="the replica promoted")
            out = el.complete(s.vl.port, prompts["after"], max_tokens=GENERATED)["choices"][0]
            assert _tokens(out) == computed["after"]
            _wait(lambda: held() >= before + 2, what="stores resumed")
            assert s.vl.alive() and s.lm.alive()
        blobs = [v for p in cluster.ports if cluster.procs[p].poll() is None and cluster.role(p) == "master"
                 for v in el.resp_values(p).values()]
        assert abs(_check_kvcx_chunks(blobs) - first_round["per_token"]) < 1e-9
    finally:
        cluster.stop()
