"""python -m t3d.train: the same as the t3d-train console script."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
