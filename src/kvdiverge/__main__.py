"""``python -m kvdiverge``: the command line (:func:`kvdiverge.cli.main`), e.g. ``python -m kvdiverge measure ...``."""

import sys

from kvdiverge.cli import main

if __name__ == "__main__":
    sys.exit(main())
