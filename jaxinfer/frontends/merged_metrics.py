"""Several engines' Prometheus metrics as one registry (data-parallel replicas, the disaggregated
prefill and decode engines)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from jaxinfer.engine.metrics import EngineMetrics


class MergedMetrics:
    """The replicas' Prometheus metrics as one registry: counters, histograms and the request
    gauges summed over replicas, the KV-cache usage averaged."""

    def __init__(self, parts: list[EngineMetrics]):
        self.parts = parts
        self.model_name = parts[0].model_name
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self):
        families: dict[str, Metric] = {}
        samples: dict[str, dict[tuple, list]] = {}  # family -> sample key -> [sample, summed value]
        for part in self.parts:
            for family in part.registry.collect():
                families.setdefault(family.name, family)
                for s in family.samples:
                    key = (s.name, tuple(sorted(s.labels.items())))
                    entry = samples.setdefault(family.name, {}).setdefault(key, [s, 0.0])
                    entry[1] += s.value
        for name, family in families.items():
            scale = 1 / len(self.parts) if name.endswith("kv_cache_usage_perc") else 1
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(value=v * scale) for s, v in samples.get(name, {}).values()]
            yield out


class _Exposition:
    """One engine's metrics as read back from their text exposition (an engine-core process's)."""

    def __init__(self, text: bytes):
        self.registry = self
        self.model_name = ""
        self._text = text.decode()

    def collect(self):
        from prometheus_client.parser import text_string_to_metric_families
        return text_string_to_metric_families(self._text)


def merge_expositions(texts: list[bytes]) -> bytes:
    """Several engines' /metrics texts as one (summed as MergedMetrics sums registries)."""
    if len(texts) == 1:
        return texts[0]
    from prometheus_client import generate_latest
    return generate_latest(MergedMetrics([_Exposition(t) for t in texts]).registry)
