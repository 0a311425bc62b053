"""`python -m jaxdp.plan`: the documented command for the planner, which lives in jaxdp/planner/."""

import sys

from jaxdp.planner.capacity import main

if __name__ == "__main__":
    sys.exit(main())
