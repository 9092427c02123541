"""`python -m ntp_manager.cli`: the `ntp-manager` command."""

import sys

from ntp_manager.cli.manager import main

sys.exit(main())
