"""``python -m charstream`` is the ``charstream`` command."""

import sys

from charstream.pipeline.cli import main

sys.exit(main())
