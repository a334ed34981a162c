"""Everything that forks, signals, waits and holds a unit's processes.

- spawnstart, spawner, _spawnc.c  the single-threaded spawner: the only place that forks
- spawnclient  the daemon's side of it; handle: a process held by pidfd, group and start time
- termination, cgroup  stopping a unit and proving its processes gone (process group / cgroup v2)
- numa, sockets, privatetmp, ipc, output, runner  what a unit is born with and leaves behind

Imports omnid.base and omnid.model only. Kept light: the spawner imports this package first."""
