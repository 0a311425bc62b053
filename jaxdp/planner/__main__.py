"""`python -m jaxdp.planner`: the same command as `python -m jaxdp.plan`."""

import sys

from jaxdp.planner.capacity import main

sys.exit(main())
