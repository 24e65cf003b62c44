"""A fleet's shared store under load and faults: engine processes, each with its own LMCache L1 and RESP (or
FS) adapter, store and load overlapping chunk sets through one real Valkey server, kvcx's serde against
LMCache's fp8; then the faults. Every loaded chunk is compared with the decode of what was stored.

    python -m bench.bench_fleet [--engines 4] [--rounds 12] [--markdown docs/results/fleet.md]

Load: each engine, each round, stores its 8 chunks (half of them also another engine's: overlapping sets),
then loads every engine's chunks of that round (loads run after the engine's own store only: a neighbour's
chunk may not be there yet, a miss). Chunks are synthetic BF16 KV_2LTD chunks of the embedded model's shape
([2, 30, 256, 192], 5.9 MB) whose bytes every process can recompute, so each knows what any chunk must decode
to. Faults (kvcx serde): the server killed with SIGKILL mid-run and restarted on its port; the FS adapter on
a 16 MiB tmpfs that fills up; stored chunks truncated, bit-flipped and copied under another key (the same
faults through fp8 for comparison).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import kvcx.integrations.lmcache_local as ls

SHAPE = [2, 30, 256, 192]


def summarise(res, rounds, per_round) -> dict:
    recs = [x for r in res for x in r["records"]]
    store_s = [x["store_s"] for x in recs if x["store_ok"]]
    load_s = [x["load_s"] for x in recs]
    return {"engines": len(res), "exit": sorted({r["exit"] for r in res}, key=str),
            "store_chunks_s": per_round / (sum(store_s) / len(store_s)) if store_s else 0.0,
            "load_chunks_s": sum(x["hits"] for x in recs) / sum(load_s) if sum(load_s) else 0.0,
            "bytes_per_chunk": max((x["bytes"] / x["stored"] for x in recs if x["stored"] and x["bytes"]), default=0),
            "hits": sum(x["hits"] for x in recs), "misses": sum(x["misses"] for x in recs),
            "wrong": sum(x["wrong"] for x in recs), "store_failures": sum(r["store_failures"] for r in res),
            "rss_growth_mib": max(r["rss_end"] - r["rss_start"] for r in res) / 2 ** 20,
            # after the first half of the rounds (L1 pool pages touched, the verifier's bounded cache of expected
            # chunks full) memory must stay flat: growth there would be a leak
            "rss_late_mib": max(r["records"][-1]["rss"] - r["records"][len(r["records"]) // 2]["rss"]
                                for r in res if len(r["records"]) > 1) / 2 ** 20 if len(res[0]["records"]) > 1 else 0.0,
            "reconnects": sum(r.get("reconnects", 0) for r in res)}


def store_bytes(port) -> int:
    return sum(ls.resp(port, "STRLEN", k) for k in ls.resp(port, "KEYS", "*"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--per-round", type=int, default=8)
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args(argv)
    from bench.report import Report

    out = Report()
    n, rounds, per = args.engines, args.rounds, args.per_round
    out(f"## Load: {n} engine processes, {rounds} rounds, {per} chunks stored per engine per round "
        f"(KV_2LTD {SHAPE} BF16, {2 * 30 * 256 * 192 * 2:,} B), one Valkey server\n")
    out("| serde | store chunks/s per engine | load chunks/s per engine | bytes stored per chunk | bytes in the "
        "store | loads: hits / misses | wrong | store failures | engines' exit | RSS growth per engine: whole run / "
        "second half |")
    out("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for serde in ("kvcx", "fp8"):
        proc, port = ls.start_valkey()
        try:
            res = ls.run_engines(n, timeout=1800, store="resp", where=port, serde=serde, rounds=rounds, per_round=per,
                                 shape=SHAPE)
            s = summarise(res, rounds, per)
            out(f"| {serde} | {s['store_chunks_s']:.1f} | {s['load_chunks_s']:.1f} | {s['bytes_per_chunk']:,.0f} | "
                f"{store_bytes(port):,} | {s['hits']} / {s['misses']} | {s['wrong']} | {s['store_failures']} | "
                f"{s['exit']} | {s['rss_growth_mib']:.1f} / {s['rss_late_mib']:+.1f} MiB |")
        finally:
            ls.stop(proc)

    out(f"\n## Faults (kvcx serde; {n} engines unless said)\n")
    out("| fault | what the engines saw | wrong | engines' exit | afterwards |")
    out("|---|---|---:|---|---|")
    # the server killed (SIGKILL) mid-run, restarted on its port 2 s later
    proc, port = ls.start_valkey()
    try:
        started = ls.start_engines(n, store="resp", where=port, serde="kvcx", rounds=40, per_round=4, shape=SHAPE,
                                   pause=0.1)
        while len(ls.resp(port, "KEYS", "*")) < 4 * n:
            time.sleep(0.2)
        killed = time.time()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(2)
        proc, _ = ls.start_valkey(port)
        restarted = time.time()
        res = ls.collect(started, timeout=1800)
        s = summarise(res, 40, 4)
        during = [x for r in res for x in r["records"] if killed < x["t0"] < restarted]
        after = [x for r in res for x in r["records"] if x["t0"] > restarted]
        first_ok = min((x["t0"] for x in after if x["store_ok"] and x["hits"]), default=float("nan")) - restarted
        out(f"| Valkey killed (SIGKILL) mid-run, restarted 2 s later | during the outage {len(during)} rounds: "
            f"{sum(not x['store_ok'] for x in during)} failed stores, {sum(x['hits'] for x in during)} hits; "
            f"{s['reconnects']} adapter rebuilds | {s['wrong']} | {s['exit']} | traffic back {first_ok:.1f} s after the "
            f"restart: {sum(x['store_ok'] for x in after)}/{len(after)} rounds stored, {sum(x['hits'] for x in after)} "
            f"hits; RSS growth {s['rss_growth_mib']:.1f} MiB, second half {s['rss_late_mib']:+.1f} MiB |")
    finally:
        ls.stop(proc)
    # the FS adapter on a filesystem that fills up
    tmp = Path(tempfile.mkdtemp())
    store = tmp / "store"
    store.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(store)]).returncode == 0
    try:
        res = ls.run_engines(2, timeout=1800, store="fs", where=str(store), serde="kvcx", rounds=8, per_round=4,
                             shape=SHAPE)
        s = summarise(res, 8, 4)
        out(f"| FS adapter on a 16 MiB tmpfs that fills up (2 engines){'' if mounted else ' (NOT mounted)'} | "
            f"{s['store_failures']} failed stores, {s['hits']} hits, {s['misses']} misses; "
            f"{shutil.disk_usage(store).free:,} B left | {s['wrong']} | {s['exit']} | RSS growth "
            f"{s['rss_growth_mib']:.1f} MiB |")
    finally:
        if mounted:
            subprocess.run(["umount", str(store)])
        shutil.rmtree(tmp, ignore_errors=True)
    # stored chunks truncated, bit-flipped, and a valid chunk copied under another key
    for serde, first in (("kvcx", 0), ("fp8", 1)):
        proc, port = ls.start_valkey()
        try:
            kw = dict(store="resp", where=port, rounds=1, per_round=4, shape=SHAPE, first_round=first)
            ls.run_engines(2, timeout=1800, serde=serde, do_load=False, **kw)
            ids = list(range(first * ls.ROUND_IDS, first * ls.ROUND_IDS + 6))
            by_id = {i: next(k for k in ls.resp(port, "KEYS", "*") if ls.key(i).chunk_hash.hex() in k.decode())
                     for i in ids}
            v = ls.resp(port, "GET", by_id[ids[0]])
            ls.resp(port, "SET", by_id[ids[0]], v[:len(v) // 2])
            v = bytearray(ls.resp(port, "GET", by_id[ids[1]]))
            v[len(v) // 3] ^= 0x10
            ls.resp(port, "SET", by_id[ids[1]], bytes(v))
            ls.resp(port, "SET", by_id[ids[3]], ls.resp(port, "GET", by_id[ids[2]]))
            res = ls.run_engines(2, timeout=1800, serde=serde, do_store=False, load_each=True, **kw)
            s = summarise(res, 1, 4)
            out(f"| {serde}: of 6 stored chunks, 1 truncated, 1 bit-flipped, 1 a copy of another key's (2 engines "
                f"load all 6) | {s['hits']} hits, {s['misses']} misses | {s['wrong']} | {s['exit']} | |")
        finally:
            ls.stop(proc)
    if args.markdown:
        out.write(args.markdown, "A fleet's shared store under load and faults: kvcx's LMCache serde against "
                                 "LMCache's fp8, engine processes with their own L1 sharing one real Valkey server.")


if __name__ == "__main__":
    main()
