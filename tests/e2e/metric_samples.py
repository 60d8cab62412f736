"""A server's /metrics as {(sample name, sorted label pairs): value}, for before/after diffs."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape_metrics(url: str, headers: dict) -> dict:
    r = httpx.get(url + "/metrics", headers=headers)
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
