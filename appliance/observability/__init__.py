"""Observability as code: Grafana dashboards, Prometheus rules, alerts and scrape config.

``promql`` and ``panels`` are typed builders; ``dashboards``, ``rules`` and ``scrape`` define
what the appliance ships; ``generate`` writes the committed files and checks them for drift;
``metric_check`` proves every series they read exists; ``state_metrics`` writes the appliance's
own state as a node_exporter textfile (ADR 0016).
"""
