"""The soak's results: the acceptance lines and everything recorded, as one dict
(``soak.json``), and the table printed from it."""

from __future__ import annotations

import os
import time
from collections import Counter

import numpy as np

from benchmarks.run import machine_summary
from benchmarks.soak.checks import at_rest, per_type_layer_bytes, rss_growth, weights_check
from benchmarks.soak.plan import LEASE_S, SMALL_WINDOW


class Report:
    """The summary of a run (the harness's state: see ``Soak.__init__``)."""

    def summarize(self, results: dict) -> dict:
        log = self.log
        # The last two thirds, from when the restarted processes hold their models again
        # (a restart's warm-up is not growth); later on a run too short for its faults.
        third = self.load_start + (self.load_end - self.load_start) / 3
        window = (max(third, getattr(self, "warm_after_faults", third)), self.load_end)
        rss = {}
        for child in [self.api, *self.workers]:
            mine = [(t + log.start, mem, loaded, rest, work) for t, role, pid, mem, loaded, rest, work in log.rss
                    if role == child.role and pid == child.pid]
            rest = at_rest(mine)
            if child is self.api:
                # Its RSS while reading follows the largest answer being built, which grows
                # with the collections (a report over more types): compared at rest, readers
                # paused for longer than its heap-trim period; all samples kept beside.
                got = rss_growth([(t, mem["rss"]) for t, mem, _ in rest], *window)
                got["measure"], got["rest_samples"], got["samples_all"] = "VmRSS at rest", len(rest), len(mine)
                got["busy_included"] = rss_growth([(t, mem["rss"]) for t, mem, *_ in mine], *window)
                rss[child.role] = got
                continue
            # A busy worker's memory follows the window it holds (hundreds of MB, by the jobs
            # it drew): it is compared at rest, after two samples at rest in a row (the
            # worker hands its window's pages back when a checkpoint completes). Its
            # anonymous memory is what a leak of objects, tensors or windows grows; the
            # file-backed rest is libraries and the mapped weights of the models it holds,
            # whose resident pages follow what the forwards touched (an embedding's rows)
            # and what the kernel reclaimed: those are bounded by the pool instead.
            got = rss_growth([(t, mem["anon"], loaded) for t, mem, loaded in rest], *window)
            got["measure"] = "RssAnon at rest"
            got["rest_samples"], got["samples_all"] = len(rest), len(mine)
            got["busy_included"] = rss_growth([(t, mem["anon"], loaded) for t, mem, loaded, *_ in mine], *window)
            got["vmrss_at_rest"] = rss_growth([(t, mem["rss"], loaded) for t, mem, loaded in rest], *window)
            # Where a growth lies: the C heap the program holds (in use) or keeps free.
            heaps = [(t, mem["heap"], loaded) for t, mem, loaded in rest if mem.get("heap")]
            if heaps:
                got["heap_at_rest"] = {part: rss_growth([(t, h[part], loaded) for t, h, loaded in heaps], *window)
                                       for part in ("in_use_mb", "free_mb", "mmap_mb")}
                got["heap_at_rest"]["arenas"] = max(h["arenas"] for _, h, _ in heaps)
            got["weights"] = weights_check([mem for _, mem, _ in rest], self.weight_mb,
                                           self.settings.max_loaded_models)
            got["ok"] = got["ok"] and got["weights"]["ok"]
            rss[child.role] = got
        allowed = [e for e in log.errors_5xx if e["status"] == 503
                   and any(a <= e["at"] <= b for a, b in log.outages)]
        bad = [e for e in log.errors_5xx if e not in allowed]
        # Requests sent while Redis was down (its restart's grace included): an outage no
        # request saw would leave the line below proving nothing.
        during_outage = sum(any(a <= t <= b for a, b in log.outages) for t in log.requests_at)
        limit = 2 * LEASE_S
        stalled = max((r["stalled_s"] for r in log.checkpoints.values()), default=0.0)
        sealed = max((r.get("sealed_s", 0.0) for r in log.checkpoints.values()), default=0.0)
        still = list(log.inflight_now)
        with self.jobs_lock:
            status = Counter(j.status for j in self.jobs.values())
            failed = [{"job": j.job_id, "pair": f"{j.collection}/{j.model}", "error": j.error}
                      for j in self.jobs.values() if j.status == "failed"]
        unfinished = [j.job_id for j in self.unfinished()]
        latency = {e: {"n": len(v), "p50_ms": round(float(np.percentile(v, 50)), 1),
                       "p99_ms": round(float(np.percentile(v, 99)), 1),
                       "statuses": dict(log.statuses[e])}
                   for e, v in sorted(log.latency.items()) if v}
        per_type_layer = per_type_layer_bytes(results["redis_families_end"], results["counts"],
                                              {f"{c}/{m}": len(self.plan[c][0].get("layers")
                                                               or range(self.model_layers[m]))
                                               for c, m in self.pairs()})
        acceptance = [
            ("memory flat over the last two thirds (growth <= 5% + 50 MB: the API's RSS at rest; workers' "
             "anonymous RSS at rest per set of loaded models, mapped weights within the pool's bound)",
             all(r["ok"] for r in rss.values()),
             "; ".join(f"{k} {r['growth_mb']:+.0f} MB (limit {r['limit_mb']:.0f}, {r['rest_samples']} samples at rest"
                       + (f"; weights {r['weights']['max_mb']:.0f} MB of {r['weights']['bound_mb']:.0f}"
                          if "weights" in r else "") + ")"
                       for k, r in rss.items())),
            (f"no checkpoint sealed longer than two leases ({limit:g} s) without progress (a new owner or more applied)",
             stalled <= limit and not still,
             f"longest without progress {stalled:.1f} s, longest sealed {sealed:.1f} s"
             + (f"; still sealed at the end: {still}" if still else "")),
            ("no 5xx but 503 during the Redis outage", not bad and (during_outage > 0 or not log.outages),
             f"{len(bad)} other 5xx; {during_outage} requests during the outage, {len(allowed)} of them 503"),
            ("every job ended", not unfinished, f"{len(unfinished)} unfinished; {dict(status)}"),
            ("no process died unless killed here", not log.unexpected_exits,
             f"{len(log.unexpected_exits)} unexpected exits"),
            ("every count exact", bool(results["counts"]) and all(x["ok"] for x in results["counts"]),
             f"{sum(x['ok'] for x in results['counts'])} of {len(results['counts'])} pairs"),
            ("values within tolerance of the float64 reference",
             bool(results["values"]) and all(not v["problems"] for v in results["values"]),
             f"{sum(v['checked'] for v in results['values'])} values, worst "
             f"{max((v['worst'] for v in results['values']), default=float('nan')):.1e} of Q"),
        ]
        return {
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(log.start)),
            "minutes": self.minutes, "plan": self.plan_name, "cpus": os.cpu_count(),
            "machine": {**self.machine, "load_average_end": list(os.getloadavg())},
            "models": self.models, "collections": {c: {"settings": s, "models": ms, "texts": k}
                                                   for c, (s, ms, k) in self.plan.items()},
            "lease_s": LEASE_S, "small_window": SMALL_WINDOW,
            "jobs": dict(status), "texts_done": sum(len(j.texts) for j in self.jobs.values()
                                                    if j.status == "done"),
            "failed_jobs": failed[:50], "unfinished_jobs": unfinished, "deletes": self.deletes,
            "faults": log.faults, "unexpected_exits": log.unexpected_exits,
            "rss": rss, "rss_window_s": [round(w - log.start, 1) for w in window], "rss_series": log.rss, "redis_memory_series": log.redis_mem,
            "redis_families_series": log.redis_families, "redis_families_end": results["redis_families_end"],
            "redis_bytes_per_type_layer": per_type_layer,
            "checkpoints": {"longest_sealed_s": sealed, "longest_without_progress_s": stalled,
                            "count": len(log.checkpoints),
                            "worst": sorted(log.checkpoints.items(), key=lambda kv: -kv[1]["stalled_s"])[:5]},
            "errors_5xx": log.errors_5xx, "errors_5xx_not_allowed": bad,
            "requests_during_outage": during_outage,
            "connect_errors": dict(log.connect_errors), "latency": latency,
            "not_read": sorted(e for e in self.not_read if "GET " + e.split(" (")[0] not in latency),
            "counts": results["counts"], "values": results["values"],
            "events": log.events,
            "acceptance": [{"check": name, "ok": ok, "detail": detail} for name, ok, detail in acceptance],
        }


def table(res: dict) -> str:
    lines = [f"soak: {res['minutes']:g} min, plan {res['plan']}, models {', '.join(res['models'])}, "
             f"{res['cpus']} CPUs; jobs {res['jobs']}, texts done {res['texts_done']}, "
             f"DELETEs {len(res['deletes'])}",
             f"machine: {machine_summary(res.get('machine') or {})}",
             "faults: " + "; ".join(f"{f['what']} at {f['t']:.0f} s (back after {f['down_s']:.0f} s)"
                                    for f in res["faults"]), "",
             f"memory (MB) over {res['rss_window_s'][0]:.0f}-{res['rss_window_s'][1]:.0f} s (the last two thirds, "
             "from the end of the restarts' warm-up): largest of its first half -> largest of its last "
             "quarter; the API's RSS at rest (busy: rss.api.busy_included); workers' anonymous RSS at rest per set of loaded models (the worst "
             "set shown; all: rss.by_loaded), their RSS at rest beside, and the mapped weights' largest "
             "resident size against the pool's bound"]
    for role, r in res["rss"].items():
        sets = f"  ({len(r['by_loaded'])} sets; worst {max(r['by_loaded'], key=lambda k: r['by_loaded'][k]['growth_mb'] - r['by_loaded'][k]['limit_mb'])})" \
            if r.get("by_loaded") else ""
        lines.append(f"  {role:<8} {r['measure']:<16} {r.get('first_mb', float('nan')):8.0f} -> "
                     f"{r.get('last_mb', float('nan')):8.0f}  growth {r['growth_mb']:+7.0f}  limit {r['limit_mb']:6.0f}"
                     f"  max {r.get('max_mb', float('nan')):6.0f}{sets}")
        if "weights" in r:
            v, w = r["vmrss_at_rest"], r["weights"]
            lines.append(f"  {'':<8} {'VmRSS at rest':<16} {v.get('first_mb', float('nan')):8.0f} -> "
                         f"{v.get('last_mb', float('nan')):8.0f}  growth {v['growth_mb']:+7.0f}   "
                         f"weights {w['max_mb']:.0f} MB in {w['max_files']} files (bound {w['bound_mb']:.0f} MB, "
                         f"{w['max_models']} models)  {r['rest_samples']} samples at rest")
        if "heap_at_rest" in r:
            h = r["heap_at_rest"]
            lines.append(f"  {'':<8} {'C heap at rest':<16} " + "  ".join(
                f"{part[:-3].replace('_', ' ')} {h[part].get('first_mb', float('nan')):.0f} -> "
                f"{h[part].get('last_mb', float('nan')):.0f}" for part in ("in_use_mb", "free_mb", "mmap_mb"))
                + f"  arenas {h['arenas']}")
    mem = res["redis_memory_series"]
    if mem:
        lines.append(f"Redis used_memory {mem[0][1]:.0f} -> {mem[-1][1]:.0f} MB (RSS {mem[-1][2]:.0f} MB)")
    lines.append("Redis bytes per pair (end): total, token shards per (type, kept layer)")
    for pair, v in res["redis_bytes_per_type_layer"].items():
        lines.append(f"  {pair:<22} {v['bytes'] / 2**20:8.1f} MB  {v['per_type_layer'] or '-':>10}")
    cp = res["checkpoints"]
    lines.append(f"checkpoints: {cp['count']} sealed seen; longest sealed {cp['longest_sealed_s']:.1f} s, "
                 f"longest without progress (a new owner or more applied) {cp['longest_without_progress_s']:.1f} s")
    lines.append(f"5xx: {len(res['errors_5xx'])} ({len(res['errors_5xx_not_allowed'])} outside the Redis outage)")
    for e in res["errors_5xx_not_allowed"][:8]:
        lines.append(f"  {e['t']:7.1f}s {e['status']} {e['endpoint']}: {e['body'][:150]}")
    if res["connect_errors"]:
        kinds = Counter()
        for k, v in res["connect_errors"].items():
            kinds[k.rsplit(": ", 1)[-1]] += v
        lines.append("requests without an answer (API or Redis down): "
                     + ", ".join(f"{k} x{v}" for k, v in kinds.most_common()))
    lines += ["", f"{'read latency by endpoint':<96} {'n':>5} {'p50 ms':>8} {'p99 ms':>8}  statuses"]
    for e, v in res["latency"].items():
        lines.append(f"  {e[:94]:<94} {v['n']:>5} {v['p50_ms']:>8.1f} {v['p99_ms']:>8.1f}  "
                     + ",".join(f"{k}:{n}" for k, n in sorted(v["statuses"].items())))
    if res["not_read"]:
        lines.append("not read: " + "; ".join(res["not_read"]))
    lines += ["", "counts (per kept layer) against the tokenizer:"]
    for c in res["counts"]:
        exp = ", ".join(f"W={w}: {n}" for w, n in c["expected"].items())
        lines.append(f"  {'ok ' if c['ok'] else 'BAD'} {c['pair']:<22} texts {c['texts']:>5}  observed "
                     f"{c.get('observed')}  expected {exp}" + (f"  ({c['error']})" if c.get("error") else ""))
    lines.append("values against the float64 reference:")
    for v in res["values"]:
        lines.append(f"  {'ok ' if not v['problems'] else 'BAD'} {v['pair']:<22} layers {v['layers']} "
                     f"{v['checked']} values, worst {v['worst']:.1e} of Q (tol {v['tol']:g})"
                     + (f"  {v['problems'][:3]}" if v["problems"] else ""))
    lines += ["", "acceptance:"]
    for a in res["acceptance"]:
        lines.append(f"  {'PASS' if a['ok'] else 'FAIL'}  {a['check']}: {a['detail']}")
    return "\n".join(lines)
