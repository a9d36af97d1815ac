"""``python -m monai_fast.apps.cli``: the ``monai-fast`` command."""

import sys

from monai_fast.apps.cli import main

sys.exit(main())
