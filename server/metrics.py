"""Prometheus metrics (one registry per app, so several apps can live in one process)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class _SchedulerCollector(Collector):
    """Gauges read from the live scheduler at scrape time."""

    def __init__(self, runtime: Callable[[], Any], ready: Callable[[], bool]) -> None:
        self._runtime = runtime
        self._ready = ready

    def collect(self):
        ready = GaugeMetricFamily("slotserve_ready", "1 once the model is loaded and warm")
        ready.add_metric([], 1.0 if self._ready() else 0.0)
        yield ready
        runtime = self._runtime()
        if runtime is None:
            return
        sched = runtime.scheduler
        stats = sched.counters()
        busy = sum(slot.busy for slot in sched.slots)
        for name, doc, value in (
            ("slotserve_slots_total", "KV slots", runtime.num_slots),
            ("slotserve_slots_busy", "KV slots holding a running request", busy),
            ("slotserve_slot_occupancy_ratio", "busy slots / slots", busy / max(runtime.num_slots, 1)),
            ("slotserve_queue_depth", "requests waiting for a slot", sched.waiting),
            ("slotserve_prefilling_requests", "requests in prefill", sched.prefilling),
            ("slotserve_prefix_cache_hit_ratio", "prompt tokens served from a cache / prompt tokens",
             stats["cached_tokens"] / stats["prompt_tokens"] if stats["prompt_tokens"] else 0.0),
            ("slotserve_host_tier_bytes", "bytes of KV runs held in host memory", sched.host.bytes_used),
            ("slotserve_kv_bytes_per_slot", "KV cache bytes one slot takes (every layer, every position)",
             runtime.engine.bytes_per_slot),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        fills = list(sched.mask_fills)
        if fills:
            step = sorted(f for f, _ in fills)
            per_row = sorted(f / rows for f, rows in fills)
            for name, values, doc in (
                ("slotserve_mask_fill_seconds", step, "grammar-mask fill time per decode step (all constrained rows)"),
                ("slotserve_mask_fill_per_row_seconds", per_row, "grammar-mask fill time per constrained token"),
            ):
                g = GaugeMetricFamily(name, doc + ", over the latest fills", labels=["quantile"])
                for q in (0.5, 0.9, 0.99):
                    g.add_metric([str(q)], values[min(len(values) - 1, int(q * len(values)))])
                yield g
        for field, doc in (
            ("iterations", "scheduler iterations"),
            ("decode_steps", "batched decode steps"),
            ("prefill_tokens", "prompt tokens computed"),
            ("cached_tokens", "prompt tokens reused from a cache"),
            ("prompt_tokens", "prompt tokens requested"),
            ("slot_reuses", "requests that resumed a prefix their own slot held"),
            ("device_copies", "slot-to-slot prefix copies"),
            ("host_restores", "host-tier restores"),
            ("host_saves", "host-tier saves"),
            ("disk_restores", "prefixes read from the disk tier"),
            ("in_flight_waits", "requests that waited for another request's prefill of their prefix"),
            ("rejected_queue_full", "requests refused because the queue was full"),
            ("cancelled", "requests cancelled (client gone or shutdown)"),
            ("batched_prefills", "calls that prefilled several short prompts at once"),
            ("carried_chunks", "prompt chunks a decode step took along in the same pass"),
            ("speculative_steps", "speculative verify steps (a lone stream, or batched)"),
            ("batched_speculative_steps", "speculative verify steps batched over several streams"),
            ("overlapped_steps", "decode steps queued before the previous step's tokens were read"),
            ("draft_tokens", "prompt-lookup draft tokens verified"),
            ("accepted_draft_tokens", "draft tokens accepted (tokens gained over plain decode steps)"),
            ("budget_closed", "constrained outputs closed along their grammar to fit max_tokens"),
        ):
            c = CounterMetricFamily(f"slotserve_scheduler_{field}", doc)
            c.add_metric([], float(stats[field]))
            yield c
        yield from _disk_tier_metrics(sched.disk_stats())


DISK_TIER_COUNTERS = (("hits", "KV runs read from the disk tier"),
                      ("misses", "disk-tier reads that found a file missing or damaged"),
                      ("writes", "files written to the disk tier"),
                      ("evictions", "files the disk tier's byte budget deleted"),
                      ("damaged", "damaged, truncated or foreign files deleted unread"),
                      ("dropped", "files not written because the write queue was full"),
                      ("write_errors", "files whose write failed (disk full, permissions)"))


def _disk_tier_metrics(disk: dict[str, int] | None):
    if disk is None:
        return
    for name, doc, value in (("slotserve_disk_tier_bytes", "bytes of KV files in the disk tier's directory",
                              disk["bytes_used"]),
                             ("slotserve_disk_tier_entries", "KV files in the disk tier's directory", disk["entries"]),
                             ("slotserve_disk_tier_budget_bytes", "the disk tier's byte budget", disk["budget_bytes"]),
                             ("slotserve_disk_tier_pending", "files queued for writing", disk["pending"])):
        g = GaugeMetricFamily(name, doc)
        g.add_metric([], float(value))
        yield g
    for field, doc in DISK_TIER_COUNTERS:
        c = CounterMetricFamily(f"slotserve_disk_tier_{field}", doc)
        c.add_metric([], float(disk[field]))
        yield c


class RecentWindow:
    """A latency over the last ``seconds``, per second (count, sum, max): a ring of bins, O(1) per observation.
    Fed and read on the event loop only (the dashboard's TTFT and inter-token plots)."""

    def __init__(self, seconds: int = 60) -> None:
        self.seconds = seconds
        self._bins = [[-1, 0, 0.0, 0.0] for _ in range(seconds)]  # [second, count, sum, max]

    def observe(self, value: float, now: float | None = None) -> None:
        second = int(time.time() if now is None else now)
        b = self._bins[second % self.seconds]
        if b[0] != second:
            b[0], b[1], b[2], b[3] = second, 0, 0.0, 0.0
        b[1] += 1
        b[2] += value
        if value > b[3]:
            b[3] = value

    def series(self, now: float | None = None) -> list[dict[str, float]]:
        """The seconds of the window that saw observations, oldest first: t (unix second), n, mean, max."""
        second = int(time.time() if now is None else now)
        live = sorted(b for b in self._bins if b[1] and second - self.seconds < b[0] <= second)
        return [{"t": b[0], "n": b[1], "mean": round(b[2] / b[1], 6), "max": round(b[3], 6)} for b in live]

    def summary(self, now: float | None = None) -> dict[str, float]:
        points = self.series(now)
        n = sum(p["n"] for p in points)
        mean = sum(p["mean"] * p["n"] for p in points) / n if n else 0.0
        return {"count": n, "mean": round(mean, 6), "max": max((p["max"] for p in points), default=0.0)}


class Metrics:
    def __init__(self, runtime: Callable[[], Any], ready: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("slotserve_requests", "HTTP requests to the OpenAI endpoints",
                                ["agent", "endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("slotserve_prompt_tokens", "prompt tokens", ["agent"], registry=r)
        self.cached_tokens = Counter("slotserve_cached_prompt_tokens", "prompt tokens served from the prefix cache",
                                     ["agent"], registry=r)
        self.completion_tokens = Counter("slotserve_completion_tokens", "generated tokens", ["agent"], registry=r)
        self.finished = Counter("slotserve_generations", "finished generations by finish reason",
                                ["agent", "finish_reason"], registry=r)
        self.ttft = Histogram("slotserve_time_to_first_token_seconds", "time from request to first token",
                              ["agent"], buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("slotserve_inter_token_latency_seconds", "time between streamed tokens",
                                     ["agent"], buckets=_TOKEN_BUCKETS, registry=r)
        self.duration = Histogram("slotserve_request_duration_seconds", "time from request to the last token",
                                  ["agent"], buckets=_LATENCY_BUCKETS, registry=r)
        self.recent_ttft = RecentWindow()  # the last minute, for the dashboard (server/dashboard.py)
        self.recent_inter_token = RecentWindow()
        self.model_info = Info("slotserve_model", "the resident model, its precision and KV pool", registry=r)
        r.register(_SchedulerCollector(runtime, ready))

    def set_model_info(self, info: dict[str, str]) -> None:
        self.model_info.info(info)

    def render(self) -> bytes:
        return generate_latest(self.registry)
