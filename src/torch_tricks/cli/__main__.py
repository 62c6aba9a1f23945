"""``python -m torch_tricks.cli``: the same as the ``torch-tricks`` command."""

import sys

from torch_tricks.cli import main

sys.exit(main())
