"""``python -m mlcomp``: the command line."""
import sys

from mlcomp.cli.main import main

sys.exit(main())
