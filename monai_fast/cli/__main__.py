"""``python -m monai_fast.cli``: the ``monai-fast`` command."""

import sys

from monai_fast.cli import main

sys.exit(main())
