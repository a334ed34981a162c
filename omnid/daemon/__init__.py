"""The daemon's wiring: start-up in order (main), the first start as systemd sees it (startup),
the state file (statefile), re-exec (handover), and the cross-host wiring (clusterwiring).
The one place that knows every part; imported by omnid.cli only."""
