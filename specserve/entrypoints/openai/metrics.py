"""The server's Prometheus metrics (``GET /metrics``).

``ServerMetrics`` counts requests, errors, tokens and latencies as the handlers
report them (``record_finish`` for each finished choice); ``_EngineCollector``
reads the engine's speculation counts, scheduler queues and KV-cache pool at scrape
time. Each metric vLLM also has is exported under vLLM's name too
(``vllm_metric_names.py``), for the dashboards and routers that read those.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specserve.engine.async_engine import AsyncLLMEngine
from specserve.entrypoints.openai.response_format import ChoiceState
from specserve.entrypoints.openai.vllm_metric_names import VllmNames

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineCollector:
    """Read at scrape time: speculation counts (``engine.spec_stats``) and the KV pool."""

    def __init__(self, async_engine: AsyncLLMEngine, model_name: str):
        self.async_engine = async_engine
        self.model_name = model_name
        self._lora_state: tuple[list[str], float] | None = None   # the LoRA gauge's labels and since when

    def collect(self):
        engine = self.async_engine.engine
        labels, values = ["model_name"], [self.model_name]
        s = engine.spec_stats
        for name, value, doc in (
            ("specserve_spec_decode_num_drafts", s.num_drafts, "Verification steps that carried at least one draft token."),
            ("specserve_spec_decode_num_draft_tokens", s.num_draft_tokens, "Draft tokens proposed."),
            ("specserve_spec_decode_num_accepted_tokens", s.num_accepted_tokens, "Draft tokens accepted by verification."),
            ("specserve_spec_decode_num_emitted_tokens", s.num_emitted_tokens, "Tokens emitted by decode steps (accepted + recovered/bonus)."),
            ("specserve_spec_decode_num_steps", s.num_steps, "Decode (verification) steps, with or without draft tokens."),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            yield c
        g = GaugeMetricFamily("specserve_spec_decode_acceptance_rate", "Accepted / draft tokens since start-up.", labels=labels)
        g.add_metric(values, s.acceptance_rate)
        yield g
        g = GaugeMetricFamily(
            "specserve_spec_decode_mean_acceptance_length",
            "Mean acceptance length (tau): emitted tokens per decode step, bonus included (plain decoding = 1).",
            labels=labels,
        )
        g.add_metric(values, s.mean_acceptance_length)
        yield g
        g = GaugeMetricFamily(
            "specserve_spec_decode_acceptance_by_position", "Acceptance rate of the i-th draft token.", labels=labels + ["position"]
        )
        for i, rate in enumerate(s.acceptance_by_position):
            g.add_metric(values + [str(i)], rate)
        yield g
        g = GaugeMetricFamily("specserve_num_speculative_tokens", "k, draft tokens per step (0: no speculation).", labels=labels)
        g.add_metric(values, engine.num_speculative_tokens)
        yield g
        c = CounterMetricFamily("specserve_spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted at the i-th draft position.", labels=labels + ["position"])
        for i, count in enumerate(s.accepted_per_position):
            c.add_metric(values + [str(i)], count)
        yield c
        scheduler = engine.scheduler
        for name, value, doc in (
            ("specserve_scheduler_requests_running", len(scheduler.running), "Requests the scheduler is running."),
            ("specserve_scheduler_requests_waiting", len(scheduler.waiting),
             "Requests waiting to be scheduled (queued, or preempted)."),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            yield g
        c = CounterMetricFamily("specserve_num_preemptions", "Running requests preempted (computed again later).",
                                labels=labels)
        c.add_metric(values, scheduler.num_preemptions)
        yield c
        if engine.loras is not None:     # vLLM's LoRA gauge: the adapters running and waiting, by name
            names = {i: r.lora_name for i, r in engine.loras.loaded.items()}

            def adapters(reqs) -> str:
                return ",".join(sorted({names.get(r.lora_id, str(r.lora_id)) for r in reqs if r.lora_id}))

            state = [str(engine.config.max_loras), adapters(scheduler.running), adapters(scheduler.waiting)]
            if self._lora_state is None or self._lora_state[0] != state:
                self._lora_state = (state, time.time())
            g = GaugeMetricFamily("specserve_lora_requests_info", "LoRA adapters of running and waiting requests "
                                  "(labels; the value: since when, in seconds since the epoch, as vLLM's).",
                                  labels=labels + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            g.add_metric(values + state, self._lora_state[1])
            yield g
        kv = engine.kv_cache
        g = GaugeMetricFamily("specserve_kv_cache_free_blocks", "Free KV-cache blocks.", labels=labels)
        g.add_metric(values, kv.num_free_blocks)
        yield g
        g = GaugeMetricFamily("specserve_kv_cache_total_blocks", "KV-cache blocks in the pool.", labels=labels)
        g.add_metric(values, kv.num_blocks)
        yield g
        g = GaugeMetricFamily("specserve_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use.", labels=labels)
        g.add_metric(values, 1.0 - kv.num_free_blocks / kv.num_blocks)
        yield g
        for name, value, doc in (
            ("specserve_prefix_cache_queries", kv.num_queried_tokens, "Prompt tokens looked up in the prefix cache."),
            ("specserve_prefix_cache_hits", kv.num_hit_tokens, "Prompt tokens found in the prefix cache (not recomputed)."),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            yield c


class ServerMetrics:
    def __init__(self, async_engine: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        r, ln = self.registry, ["model_name"]
        self.model_name = model_name
        self.requests = Counter("specserve_requests", "Requests accepted.", ln + ["endpoint"], registry=r)
        self.finished = Counter("specserve_request_success", "Finished completions (choices), by finish reason.", ln + ["finish_reason"], registry=r)
        self.errors = Counter("specserve_request_errors", "Requests answered with an error, by HTTP status.", ln + ["status"], registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens of accepted requests.", ln, registry=r)
        self.generation_tokens = Counter("specserve_generation_tokens", "Generated tokens.", ln, registry=r)
        self.running = Gauge("specserve_num_requests_running", "Completions in flight on this server.", ln, registry=r)
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "Time from arrival to the first token.", ln, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(
            "specserve_time_per_output_token_seconds", "Per request: (finish - first token) / (output tokens - 1).", ln, buckets=TPOT_BUCKETS, registry=r
        )
        self.e2e = Histogram("specserve_e2e_request_latency_seconds", "Time from arrival to the last token.", ln, buckets=E2E_BUCKETS, registry=r)
        engine_metrics = _EngineCollector(async_engine, model_name)
        r.register(engine_metrics)
        own = [self.requests, self.finished, self.errors, self.prompt_tokens, self.generation_tokens, self.running,
               self.ttft, self.tpot, self.e2e, engine_metrics]
        r.register(VllmNames(lambda: [m for c in own for m in c.collect()]))

    def render(self) -> bytes:
        return generate_latest(self.registry)


    def record_finish(self, choice: ChoiceState) -> None:
        """A finished choice (or one that ended early): its finish reason, tokens and latencies."""
        out, ln = choice.output, self.model_name
        if out is None:
            return
        completion = out.outputs[0]
        n = len(completion.token_ids)
        finish = time.monotonic()
        self.finished.labels(ln, completion.finish_reason or "abort").inc()
        self.generation_tokens.labels(ln).inc(n)
        self.e2e.labels(ln).observe(finish - choice.arrival)
        if choice.first_token_time is not None:
            self.ttft.labels(ln).observe(choice.first_token_time - choice.arrival)
            if n > 1:
                self.tpot.labels(ln).observe((finish - choice.first_token_time) / (n - 1))
