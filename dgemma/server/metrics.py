"""/metrics in the Prometheus text format, written by prometheus-client (its escaping and format, not
ours): the engine's counters read at scrape time, and HTTP answers by route template and status, so a
client's request path never becomes a label value (the label set is bounded by the routes)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..generation.engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_COUNTERS = {  # EngineStats field -> (metric name, help)
    "requests": ("dgemma_requests", "requests submitted to the engine"),
    "requests_finished": ("dgemma_requests_finished", "requests that ran to their end"),
    "requests_rejected": ("dgemma_requests_rejected", "requests refused because the queue was full"),
    "requests_cancelled": ("dgemma_requests_cancelled", "requests dropped because their client went away"),
    "requests_failed": ("dgemma_requests_failed", "requests that failed or timed out"),
    "tokens_generated": ("dgemma_tokens_generated", "tokens generated"),
    "denoising_steps": ("dgemma_denoising_steps", "batched denoising passes"),
    "row_steps": ("dgemma_canvas_steps", "canvas steps summed over the rows of those passes"),
    "encoded_tokens": ("dgemma_encoded_tokens", "positions the encoder computed (prompts and commits)"),
}


class _EngineCollector:
    """Reads the engine's statistics when Prometheus scrapes."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats
        gauges = {
            "dgemma_tokens_per_forward": ("tokens generated per canvas step", s.tokens_generated / max(s.row_steps, 1)),
            "dgemma_queue_depth": ("requests waiting", self.engine.queue_depth),
            "dgemma_batch_size": ("requests being denoised", self.engine.active),
            "dgemma_last_batch_size": ("requests denoised in the last engine step", s.last_batch_size),
        }
        yield from _families(_COUNTERS, s, gauges)
        cache = self.engine.prefix_cache
        if cache is None:
            return
        p = cache.stats
        gauges = {
            "dgemma_prefix_cache_hit_rate": ("cached / looked-up positions", p.cached_tokens / max(p.prompt_tokens, 1)),
            "dgemma_prefix_cache_bytes": ("bytes of keys and values held", cache.nbytes),
            "dgemma_prefix_cache_max_bytes": ("the bound on those bytes (--prefix-cache-gb)", cache.max_bytes),
            "dgemma_prefix_cache_blocks": ("blocks held", cache.blocks),
        }
        yield from _families(_PREFIX_COUNTERS, p, gauges)


_PREFIX_COUNTERS = {  # PrefixStats field -> (metric name, help)
    "lookups": ("dgemma_prefix_cache_lookups", "prompts looked up in the prefix cache"),
    "hits": ("dgemma_prefix_cache_hits", "prompts that found a stored prefix"),
    "prompt_tokens": ("dgemma_prefix_cache_prompt_tokens", "positions of the prompts looked up"),
    "cached_tokens": ("dgemma_prefix_cache_cached_tokens", "of those, positions loaded instead of encoded"),
    "evictions": ("dgemma_prefix_cache_evictions", "blocks evicted to make room"),
    "stored_blocks": ("dgemma_prefix_cache_stored_blocks", "blocks stored"),
}


def _families(counters: dict, stats, gauges: dict):
    """Counters read from `stats` (field -> (name, help)) and gauges (name -> (help, value))."""
    for field, (name, doc) in counters.items():
        yield CounterMetricFamily(name, doc, value=getattr(stats, field))
    for name, (doc, value) in gauges.items():
        yield GaugeMetricFamily(name, doc, value=value)


class Metrics:
    """The server's registry: engine statistics and HTTP answers by route and status."""

    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.http = Counter(
            "dgemma_http_requests", "HTTP answers by route and status", ["route", "status"], registry=self.registry
        )

    def count(self, route: str, status: int) -> None:
        self.http.labels(route=route, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
