"""`python -m jaxspec ...` runs the command line (jaxspec/cli.py), like the `jaxspec` script."""

import sys

from jaxspec.cli import main

sys.exit(main())
