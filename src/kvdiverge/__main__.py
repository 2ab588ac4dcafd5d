"""``python -m kvdiverge``: the command line (:func:`kvdiverge.doors.cli.main`), e.g. ``python -m kvdiverge measure ...``."""

import sys

from kvdiverge.doors.cli import main

if __name__ == "__main__":
    sys.exit(main())
