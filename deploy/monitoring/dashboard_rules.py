#!/usr/bin/env python3
"""Prints the Grafana dashboard's PromQL queries as a Prometheus rules file (JSON, which
`promtool check rules` reads as YAML), one recording rule per query, so promtool parses each:
deploy/check.sh runs it. Grafana's variables become what Grafana would put there: range
intervals a duration, $job and $instance (used in regex matchers) a regex.

Usage: dashboard_rules.py grafana-dashboard.json > rules.json
"""

import json
import re
import sys


def queries(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def grafana_to_promql(expr):
    expr = re.sub(r"\$__(rate_)?interval\b", "5m", expr)
    return re.sub(r"\$\w+", ".*", expr)


def main(path):
    with open(path) as f:
        dashboard = json.load(f)
    rules = [
        {"record": f"tern_dashboard:query_{i}", "expr": grafana_to_promql(expr)}
        for i, expr in enumerate(queries(dashboard))
    ]
    if not rules:
        sys.exit(f"{path}: no queries found")
    json.dump({"groups": [{"name": "grafana-dashboard", "rules": rules}]}, sys.stdout, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
