"""Exports of live telemetry to other tools: `prometheus.py` serves the bus as Prometheus metrics."""
