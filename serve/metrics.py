"""Prometheus text-format metrics: request counts by endpoint and status, latency histograms, index size.

Labels are bounded whatever clients send: the method is one of ``METHODS`` or "other", the endpoint the matched
route's template (``/images/{raw_id:path}``, not the raw path) or "unmatched".
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
METHODS = frozenset({"GET", "POST", "HEAD", "OPTIONS"})  # labelled as themselves; any other method is "other"


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = defaultdict(int)  # (method, endpoint, status) -> count
        self.hist = defaultdict(lambda: [0] * (len(BUCKETS) + 1))  # endpoint -> cumulative-ready counts
        self.sums = defaultdict(float)
        self.counts = defaultdict(int)

    def observe(self, method: str, endpoint: str, status: int, seconds: float) -> None:
        with self.lock:
            self.requests[(method, endpoint, status)] += 1
            i = next((i for i, b in enumerate(BUCKETS) if seconds <= b), len(BUCKETS))
            self.hist[endpoint][i] += 1
            self.sums[endpoint] += seconds
            self.counts[endpoint] += 1

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """Text exposition format 0.0.4; ``gauges``: name -> (help, value)."""
        out = ["# HELP mmgeo_requests_total HTTP requests by endpoint and status.",
               "# TYPE mmgeo_requests_total counter"]
        with self.lock:
            for (m, e, s), n in sorted(self.requests.items()):
                out.append(f'mmgeo_requests_total{{method="{m}",endpoint="{e}",status="{s}"}} {n}')
            out += ["# HELP mmgeo_request_seconds Request latency.", "# TYPE mmgeo_request_seconds histogram"]
            for e, counts in sorted(self.hist.items()):
                acc = 0
                for b, c in zip((*map(str, BUCKETS), "+Inf"), counts):
                    acc += c
                    out.append(f'mmgeo_request_seconds_bucket{{endpoint="{e}",le="{b}"}} {acc}')
                out.append(f'mmgeo_request_seconds_sum{{endpoint="{e}"}} {self.sums[e]:.6f}')
                out.append(f'mmgeo_request_seconds_count{{endpoint="{e}"}} {self.counts[e]}')
        for name, (help_, value) in gauges.items():
            out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {value}"]
        return "\n".join(out) + "\n"


class MetricsMiddleware:
    """Pure ASGI middleware: times every HTTP request and labels it by a known method and its route template
    (not the raw method and path: a client must not create series)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.observe(method, endpoint, status[0], time.perf_counter() - start)
