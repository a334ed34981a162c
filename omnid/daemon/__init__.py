"""The daemon's wiring: the `omnid daemon` command up to the loop (command), start-up in
order, fresh or after a re-exec (main), its fronts (fronts: control socket, health API), the
stop (shutdown), the first start as systemd sees it (startup), the state file (statefile),
re-exec (handover, and record: the re-exec record's one schema), and the cross-host wiring
(clusterwiring). The one place that knows every part; imported by omnid.cli only."""
