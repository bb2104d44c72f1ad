"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

Engine state is read at scrape time (``engine_snapshot``): running / waiting requests, KV blocks and
Mamba state slots (free, total, usage), speculative-decoding drafts and acceptance. Per-request
latencies are histograms observed when a request finishes, from the engine's own timestamps:
time to first token (arrival -> first token) and time per output token (first token -> finish,
divided by the tokens after the first).
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..outputs import RequestOutput

PREFIX = "hybrid_engine"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


def engine_snapshot(llm) -> dict:
    """Load and cache occupancy of the engine behind ``llm`` (an AsyncLLM), cheap enough per request:
    running / waiting request counts, free / total KV blocks and Mamba slots and the
    speculative-decoding counters, all host-side (the MoE expert-load window is left to ``stats()``
    callers: reading it is a device read that clears it)."""
    st = llm.engine.stats(expert_load=False)
    return {"num_requests_running": st["num_requests_running"], "num_requests_waiting": st["num_requests_waiting"],
            "free_blocks": st["free_blocks"], "total_blocks": st["total_blocks"],
            "free_slots": st["free_slots"], "total_slots": st["total_slots"],
            "drafts_proposed": st["drafts_proposed"], "drafts_accepted": st["drafts_accepted"],
            "acceptance_rate": st["acceptance_rate"], "mean_acceptance_length": st["mean_acceptance_length"],
            "steps": st["steps"]}


class _EngineCollector:
    """Gauges and counters read from the engine when /metrics is scraped."""

    def __init__(self, llm, model_name: str):
        self.llm, self.model_name = llm, model_name

    def collect(self):
        s = engine_snapshot(self.llm)
        lab = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["model_name"])
            g.add_metric(lab, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["model_name"])
            c.add_metric(lab, value)
            return c
        used_blocks = s["total_blocks"] - s["free_blocks"]
        used_slots = s["total_slots"] - s["free_slots"]
        yield gauge("num_requests_running", "Requests in the running batch.", s["num_requests_running"])
        yield gauge("num_requests_waiting", "Requests queued in the engine, not yet running.",
                    s["num_requests_waiting"])
        yield gauge("kv_blocks_free", "Free KV-cache blocks.", s["free_blocks"])
        yield gauge("kv_blocks_total", "KV-cache blocks in the pool.", s["total_blocks"])
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use.",
                    used_blocks / s["total_blocks"] if s["total_blocks"] else 0.0)
        yield gauge("mamba_slots_free", "Free Mamba state slots.", s["free_slots"])
        yield gauge("mamba_slots_total", "Mamba state slots in the pool.", s["total_slots"])
        yield gauge("mamba_slot_usage_perc", "Fraction of Mamba state slots in use.",
                    used_slots / s["total_slots"] if s["total_slots"] else 0.0)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed (finished requests).",
                      s["drafts_proposed"])
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted (finished requests).",
                      s["drafts_accepted"])
        yield gauge("spec_decode_acceptance_rate", "Accepted / proposed draft tokens.", s["acceptance_rate"])
        yield gauge("spec_decode_mean_acceptance_length", "Tokens per verify step (1 + accepted drafts).",
                    s["mean_acceptance_length"])
        yield counter("engine_steps", "Engine steps launched.", s["steps"])


class ServerMetrics:
    def __init__(self, llm, model_name: str):
        self.registry = CollectorRegistry()
        reg, names = self.registry, ["model_name"]
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Arrival to first output token.", names,
                              buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds", "Mean time per output token after the "
                              "first.", names, buckets=TPOT_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Arrival to finish.", names,
                             buckets=E2E_BUCKETS, registry=reg).labels(model_name)
        self.finished = Counter(f"{PREFIX}_request_success", "Requests finished, by finish reason.",
                                names + ["finish_reason"], registry=reg)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.", names,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated (finished requests).",
                                         names, registry=reg).labels(model_name)
        self.aborted = Counter(f"{PREFIX}_requests_aborted", "Requests aborted (the client went away, or shutdown).",
                               names, registry=reg).labels(model_name)
        self.rejected = Counter(f"{PREFIX}_requests_rejected", "Requests refused, by HTTP status (400, 401, 429...).",
                                names + ["status"], registry=reg)
        self.failed = Counter(f"{PREFIX}_requests_failed", "Requests whose engine step failed (HTTP 500).", names,
                              registry=reg).labels(model_name)
        self.model_name = model_name
        reg.register(_EngineCollector(llm, model_name))

    def observe_finished(self, last: RequestOutput, num_output_tokens: int) -> None:
        """Record a request that ended in the engine (``last.finished``)."""
        reason = last.outputs[0].finish_reason or "unknown"
        self.finished.labels(self.model_name, reason).inc()
        if reason == "error":
            self.failed.inc()
        elif reason == "abort":
            self.aborted.inc()
        self.prompt_tokens.inc(len(last.prompt_token_ids))
        self.generation_tokens.inc(num_output_tokens)
        m = last.metrics
        t0, t1, t2 = m.get("arrival_time"), m.get("first_token_time"), m.get("finish_time")
        if t0 is not None and t1 is not None:
            self.ttft.observe(max(t1 - t0, 0.0))
            if t2 is not None and num_output_tokens > 1:
                self.tpot.observe(max(t2 - t1, 0.0) / (num_output_tokens - 1))
        if t0 is not None and t2 is not None:
            self.e2e.observe(max(t2 - t0, 0.0))

    def reject(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
