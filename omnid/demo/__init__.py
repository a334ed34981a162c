"""The reference stack omnid supervises by default (units/demo): serve -> engine -> worker@N.

serve.py (aiohttp HTTP API), engine.py (pyzmq broker), worker.py (torch), over the
protocol in protocol.py; sdnotify.py is their sd_notify client. Only worker.py imports torch.
"""
