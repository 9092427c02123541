"""The command lines: `ntp-manager` (manager.py, with `simulate` in simulate.py) and `ntpctl`
(ctl.py, a client of the REST API). Nothing is imported here, so each command loads only its own
modules; `python -m ntp_manager.cli` runs `ntp-manager`."""
