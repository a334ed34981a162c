"""Launchers that run inside an engine's own environment, not omnid's: shipped as package
data (`omnid example` writes them beside the units) and never imported by the daemon.

- vllm_listenfd.py  serves vLLM's OpenAI API server on the listening socket omnid holds
"""
