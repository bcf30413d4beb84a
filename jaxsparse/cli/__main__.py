"""`python -m jaxsparse.cli ...`: the same as the `jaxsparse` console script."""
import sys

from jaxsparse.cli import main

sys.exit(main())
