"""The daemon's faces to the world: the control socket (control, handlers), the health and
metrics HTTP API (health, metrics), the notify socket units talk to (notify), and sd_notify
towards the service manager (systemd). Translates omnid.core's answers and errors to the wire;
imports the layers below, never omnid.daemon or omnid.cli."""
