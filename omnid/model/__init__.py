"""The unit model: unit files read into a validated, frozen stack, and the daemon's settings.

- unitvalues  one value of a key: parsed and checked, with the error that names file and key
- unitfile    one unit file to a `UnitSpec`; unitmodel: the frozen dataclasses
- units       a directory of unit files (templates, drop-ins) to a `Stack`; stackgraph: its order
- cluster     the `[cluster]` table of omnid.toml; settings: the daemon's resolved settings

Imports only omnid.base. Runs no process and opens no socket."""
