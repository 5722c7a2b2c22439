"""Reading a Prometheus exposition in tests: samples by family, one value, and the set of series."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]
"""``"<type>:<family>"`` -> ``(sample name, sorted labels)`` -> value."""

MODEL = "aiokv-tiny"


def parse(text: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        samples = out.setdefault(f"{fam.type}:{fam.name}", {})
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: Samples, kind: str, name: str, **labels: str) -> float:
    """The sum of the ``kind`` family ``name``'s values whose labels include ``labels`` (and the model's);
    histograms count observations (``_count``)."""
    samples = metrics[f"{kind}:{name}"]
    want = {"model_name": MODEL, **labels}
    suffix = {"counter": "_total", "gauge": "", "histogram": "_count"}[kind]
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name + suffix and all(dict(ls).get(k) == x for k, x in want.items())
    )


def outcomes(metrics: Samples, name: str) -> dict[tuple[str, str], float]:
    """``{(outcome, reason): value}`` of the counter ``name`` (``aiokv:engine_requests``, ...)."""
    return {
        (dict(ls)["outcome"], dict(ls)["reason"]): v
        for (n, ls), v in metrics[f"counter:{name}"].items()
        if n == name + "_total" and dict(ls).get("model_name") == MODEL
    }


def delta(
    after: dict[tuple[str, str], float], before: dict[tuple[str, str], float]
) -> dict[tuple[str, str], float]:
    """The series of ``after`` that moved since ``before``, by how much."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
