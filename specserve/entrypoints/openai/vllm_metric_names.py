"""The server's metrics under vLLM's names as well (``vllm:num_requests_waiting`` and the rest).

Dashboards, autoscalers and load-balancing routers written for vLLM (its Grafana board, KEDA
rules, Kubernetes inference gateways) read metrics by vLLM's names. ``VllmNames`` exports each
specserve metric that has a vLLM counterpart once more under that name, same values, same
``model_name`` label, at scrape time: one table, no second set of counters to keep equal.
"""
from __future__ import annotations

from prometheus_client.metrics_core import Metric

# specserve family -> (vLLM family, {specserve label: vLLM label})
VLLM_NAMES: dict[str, list[tuple[str, dict[str, str]]]] = {
    "specserve_scheduler_requests_running": [("vllm:num_requests_running", {})],
    "specserve_scheduler_requests_waiting": [("vllm:num_requests_waiting", {})],
    "specserve_kv_cache_usage_ratio": [("vllm:kv_cache_usage_perc", {}), ("vllm:gpu_cache_usage_perc", {})],
    "specserve_num_preemptions": [("vllm:num_preemptions", {})],
    "specserve_lora_requests_info": [("vllm:lora_requests_info", {})],
    "specserve_prompt_tokens": [("vllm:prompt_tokens", {})],
    "specserve_generation_tokens": [("vllm:generation_tokens", {})],
    "specserve_request_success": [("vllm:request_success", {"finish_reason": "finished_reason"})],
    "specserve_time_to_first_token_seconds": [("vllm:time_to_first_token_seconds", {})],
    "specserve_time_per_output_token_seconds": [("vllm:time_per_output_token_seconds", {})],
    "specserve_e2e_request_latency_seconds": [("vllm:e2e_request_latency_seconds", {})],
    "specserve_prefix_cache_queries": [("vllm:prefix_cache_queries", {})],
    "specserve_prefix_cache_hits": [("vllm:prefix_cache_hits", {})],
    "specserve_spec_decode_num_drafts": [("vllm:spec_decode_num_drafts", {})],
    "specserve_spec_decode_num_draft_tokens": [("vllm:spec_decode_num_draft_tokens", {})],
    "specserve_spec_decode_num_accepted_tokens": [("vllm:spec_decode_num_accepted_tokens", {})],
    "specserve_spec_decode_num_accepted_tokens_per_pos": [("vllm:spec_decode_num_accepted_tokens_per_pos", {})],
}


class VllmNames:
    """A Prometheus collector: ``families()`` (specserve's metric families, read at each scrape)
    again under vLLM's names (``VLLM_NAMES``)."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        for family in self.families():
            for name, labels in VLLM_NAMES.get(family.name, []):
                renamed = Metric(name, family.documentation, family.type)
                for sample in family.samples:
                    suffix = sample.name[len(family.name):]          # "_total", "_bucket", "_count", ...
                    if suffix == "_created":                         # start times: specserve's own names have them
                        continue
                    renamed.add_sample(name + suffix, {labels.get(k, k): v for k, v in sample.labels.items()},
                                       sample.value, sample.timestamp, sample.exemplar)
                yield renamed

    def describe(self):
        return []     # collected at scrape time only: nothing to check at registration
