"""Benchmark harness: omnid vs supervisord vs Circus (run by hand, see README.md)."""
