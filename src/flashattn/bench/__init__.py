"""Benchmark harness behind `flashattn bench`: providers, suites, the runner and reports.

Layout: case.py (shapes), flops.py, timing.py, check.py (oracle before timing), runner.py, results.py (JSON),
providers/ and suites/ (registries: one file per entry), report/ (markdown, plots, terminal, compare), cli.py.
"""
