"""Benchmarks: the overload comparison (`bench.overload`), its open-loop load generator
(`bench.loadgen`) and report (`bench.report`), and smaller probes run as scripts."""
