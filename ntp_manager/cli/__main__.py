"""`python -m ntp_manager.cli`: the `ntp-manager` command."""

from ntp_manager.cli.manager import main

main()
