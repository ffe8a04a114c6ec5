#!/usr/bin/env python3
"""Parses a Prometheus exposition on stdin with the prometheus_client parser (PyPI
`prometheus-client`, installed by scripts/setup.sh): the classic text format, or OpenMetrics
with --openmetrics. Prints its samples as JSON lines: {"family", "type", "name", "labels",
"value"}. Used by the metrics integration test so the format is checked by a real parser, not
one written for the test."""
import json
import sys

if "--openmetrics" in sys.argv[1:]:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families
else:
    from prometheus_client.parser import text_string_to_metric_families

for family in text_string_to_metric_families(sys.stdin.read()):
    for sample in family.samples:
        print(json.dumps({
            "family": family.name,
            "type": family.type,
            "name": sample.name,
            "labels": sample.labels,
            "value": sample.value,
        }))
