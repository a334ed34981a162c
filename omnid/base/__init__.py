"""Leaf helpers that know no unit: the Linux calls and /proc readers (linux), what a root
daemon trusts on disk (ownership), owned asyncio tasks (tasks), log set-up (logconfig), and the
Prometheus text format (promtext). Imports nothing of omnid."""
