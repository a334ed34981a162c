"""Hang forensics: what a hung unit's processes were doing, captured before it is killed.

- capture  the capture itself (py-spy, /proc stacks), bounded in time and size
- record   the record of one capture; store: where captures are kept; helper: running py-spy

Imports omnid.base and omnid.process."""
