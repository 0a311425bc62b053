"""`python -m jaxdp.bench`: the serving load client (jaxdp.bench.serving)."""

import sys

from jaxdp.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
