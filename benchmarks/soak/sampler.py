"""The soak's sampler: every :data:`~benchmarks.soak.plan.SAMPLE_S` seconds the memory of
each process (:func:`process_memory`), Redis's memory (by key family once a minute:
:func:`memory_by_family`) and the sealed checkpoints; a process that died on its own is
restarted and recorded."""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path
from typing import Optional

from benchmarks.soak.plan import HEARTBEAT_S, MEMORY_EVERY_S, SAMPLE_S


class Sampler:
    """The sampling thread (the harness's state: see ``Soak.__init__``)."""

    def sampler(self) -> None:
        from embgeom.store.checkpoints import Checkpointer
        from embgeom.store.connection import redis_client
        from embgeom.store.keys import PairKeys

        client = None
        last_memory = 0.0
        while not self.stop_all.is_set():
            t = self.log.t()
            loaded = self.worker_states(client)
            api_rest = self.api_at_rest()
            for child in [self.api, *self.workers]:
                with child.lock:
                    pid = child.pid if child.alive() else None
                mem = process_memory(pid)
                if mem is not None:
                    with self.log.lock:
                        state = (None, api_rest, None, None) if child is self.api else \
                            loaded.get(child.role, (None, None, None, None))
                        if state[3]:  # the worker's C heap (embgeom.heap.usage), beside its RSS
                            mem["heap"] = state[3]
                        self.log.rss.append((t, child.role, pid, mem, *state[:3]))
                    continue
                code = child.restart_if_died()
                if code is not None:
                    # Died on its own (the kernel's OOM killer, a crash): keep the soak going.
                    self.log.unexpected_exits.append({"t": t, "role": child.role, "returncode": code})
                    self.log.note(f"{child.role} exited with {code}: restarted")
            try:
                if client is None:
                    client = redis_client(self.redis.url, socket_timeout=5)
                    checkpoints = Checkpointer(client, "soak-sampler")
                info = client.info("memory")
                with self.log.lock:
                    self.log.redis_mem.append((t, round(info["used_memory"] / 2**20, 1),
                                               round(info["used_memory_rss"] / 2**20, 1)))
                now_ms = _redis_ms(client)
                seen = []
                for c, m in self.pairs():
                    keys = PairKeys(c, m)
                    for cp, sealed in client.zrange(keys.inflight, 0, -1, withscores=True):
                        cp = cp.decode() if isinstance(cp, bytes) else cp
                        # An adoption counts a try: a worker restarted under the same id
                        # adopts its predecessor's checkpoint without changing the owner.
                        owner, tries = client.hmget(keys.checkpoint(cp), ["owner", "tries"])
                        owner = None if owner is None else f"{owner.decode()} (run {int(tries or 1)})"
                        record = checkpoints.record(keys, cp)
                        progress = checkpoints.progress(keys, record) if record else -1
                        self.track_checkpoint(f"{c}/{m}/{cp}", sealed, owner, now_ms, progress)
                        seen.append(f"{c}/{m}/{cp}")
                with self.log.lock:
                    self.log.inflight_now = seen
                if time.time() - last_memory >= MEMORY_EVERY_S:
                    last_memory = time.time()
                    fam = memory_by_family(client, [f"{c}:{m}" for c, m in self.pairs()], samples=5)
                    with self.log.lock:
                        self.log.redis_families.append((t, fam))
            except Exception as exc:  # Redis down (a fault) or restarting
                if client is not None:
                    client.close()
                client = None
                with self.log.lock:
                    self.log.connect_errors[f"sampler: {type(exc).__name__}"] += 1
            self.stop_all.wait(SAMPLE_S)
        if client is not None:
            client.close()

    def worker_states(self, client) -> dict[str, tuple]:
        """role -> (the models each worker's last heartbeat says it holds, whether it was at
        rest: no job, no window, nothing applying, what it has done: jobs, checkpoints and
        seconds of work so far, its C heap) ({} without Redis)."""
        from embgeom.store.heartbeats import live_workers

        if client is None:
            return {}
        try:
            beats = live_workers(client, 3 * HEARTBEAT_S + 2)
        except Exception:
            return {}
        by_id = {w["id"]: (tuple(sorted(w.get("loaded") or [])), bool(w.get("at_rest")),
                           (w.get("jobs_done"), w.get("checkpoints"),
                            round(sum((w.get("stage_seconds") or {}).values()), 3)), w.get("heap"))
                 for w in beats}
        return {c.role: by_id[c.args[c.args.index("--worker-id") + 1]] for c in self.workers
                if c.args[c.args.index("--worker-id") + 1] in by_id}

    def track_checkpoint(self, name: str, sealed_ms: float, owner, now_ms: float, progress: int = -1) -> None:
        """Progress of a sealed checkpoint is a new owner or run (an adoption) or more of it
        applied (pieces, layer parts); ``stalled_s`` is the longest time without either."""
        owner = owner.decode() if isinstance(owner, bytes) else owner
        with self.log.lock:
            rec = self.log.checkpoints.get(name)
            if rec is None:
                rec = self.log.checkpoints[name] = {"sealed_ms": sealed_ms, "owner": owner,
                                                    "owner_since_ms": sealed_ms, "owners": 1,
                                                    "progress": progress, "stalled_s": 0.0}
            # Up to this sample: progress seen now happened at most this long after the last.
            rec["stalled_s"] = max(rec["stalled_s"], round((now_ms - rec["owner_since_ms"]) / 1000, 2))
            if owner != rec["owner"]:
                rec["owner"], rec["owner_since_ms"], rec["owners"] = owner, now_ms, rec["owners"] + 1
            if progress > rec.get("progress", -1):
                rec["progress"], rec["owner_since_ms"] = progress, now_ms
            rec["last_ms"] = now_ms
            rec["sealed_s"] = round((now_ms - sealed_ms) / 1000, 2)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def process_memory(pid: Optional[int]) -> Optional[dict]:
    """Memory of ``pid`` in MB, None if gone: ``rss`` (VmRSS), its anonymous part ``anon``
    (RssAnon: heap, tensors, windows) and file-backed part ``file`` (RssFile: shared
    libraries and memory-mapped model weights, page cache the kernel can reclaim), from
    /proc/<pid>/status; ``weights``, the resident pages of mapped weight files
    (:data:`WEIGHT_SUFFIXES`), and ``weight_files``, how many such files are mapped, from
    /proc/<pid>/smaps. safetensors weights stay mapped while a model is loaded, so a model
    kept after its eviction shows here, whatever the allocator does."""
    if pid is None:
        return None
    try:
        status = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                status[key] = int(value.split()[0]) / 1024
        weights, files, path = 0.0, set(), None
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if line.startswith("Rss:"):
                    if path is not None:
                        weights += int(line.split()[1]) / 1024
                elif "-" in line.split(" ", 1)[0]:   # a mapping's header line
                    parts = line.split(maxsplit=5)
                    path = parts[5].strip() if len(parts) > 5 and parts[5].strip().endswith(WEIGHT_SUFFIXES) else None
                    if path is not None:
                        files.add(path)
    except OSError:
        return None
    if "VmRSS" not in status:
        return None
    return {"rss": round(status["VmRSS"], 1), "anon": round(status.get("RssAnon", 0.0), 1),
            "file": round(status.get("RssFile", 0.0), 1), "weights": round(weights, 1),
            "weight_files": len(files)}


def weight_bytes(path: str) -> int:
    """Bytes of the weight files (:data:`WEIGHT_SUFFIXES`) under a model's folder."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.name.endswith(WEIGHT_SUFFIXES))


def _redis_ms(client) -> float:
    sec, usec = client.time()
    return sec * 1000 + usec / 1000


def key_family(key: str) -> Optional[tuple[str, str]]:
    """``(pair "c:m", family)`` of a key of the service's layout: ``eg:{c:m}:inflight`` ->
    ("c:m", "control:inflight"); ``eg:{c:m:g:s3}:rec`` (and ``s3l1``, layer group 1) ->
    ("c:m", "shard:rec");
    ``eg:{c:m:g:L2c0}:seg`` -> ("c:m", "chunk:seg"); ``h`` -> head."""
    m = re.match(r"eg:\{([^}]*)\}:?(.*)$", key)
    if not m:
        return None
    parts = m.group(1).split(":")
    if len(parts) < 2:
        return None
    suffix = re.sub(r":.*", "", m.group(2)) or "-"
    if len(parts) == 2:
        return ":".join(parts), f"control:{suffix}"
    tag = parts[-1]
    kind = "shard" if tag.startswith("s") else "head" if tag == "h" else "chunk" if tag.startswith("L") else tag
    return ":".join(parts[:2]), f"{kind}:{suffix}"


def memory_by_family(client, pairs: list[str], samples: int = 5) -> dict:
    """``MEMORY USAGE`` of every key of each pair (``eg:{c:m...``), summed by family
    (:func:`key_family`); ``samples=0`` counts every field of a hash exactly."""
    out: dict = {}
    for pair in pairs:
        fam: Counter = Counter()
        for key in client.scan_iter(match=f"eg:{{{pair}*", count=1000):
            key = key.decode() if isinstance(key, bytes) else key
            got = key_family(key)
            if got is None or got[0] != pair:
                continue
            fam[got[1]] += client.memory_usage(key, samples=samples) or 0
        out[pair.replace(":", "/")] = dict(fam)
    return out
