"""The `omnid` command: argument parsing and commands (main), the control-socket client
(client), tables and trees for people (render), shell completion, and `omnid check`'s host
checks (preflight). The top layer: nothing imports it but `python -m omnid`."""
