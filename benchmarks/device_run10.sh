#!/usr/bin/env bash
# Fifth call (~2.5 min): the Prometheus exporter's cost on a quiet 16-core host (the dev VM was
# loaded when it measured +0.26 %): one scrape a second, the bus full, the sampler at 10 Hz.
set -u
R=/tmp/results10; mkdir -p $R
. benchmarks/device_env.sh
EXT=txt stage prom 150 python3 benchmarks/bench_prometheus.py --seconds 30 --blocks 2
cat $R/prom.txt; tail -3 $R/prom.err
tar czf $OUT/results10.tgz -C /tmp results10
