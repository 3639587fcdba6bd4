"""Workload generators and benchmarks; each benchmark prints a human table and, last, one JSON line."""
