"""``python -m torchneuron check -- python train.py``: the same as the ``torchneuron`` command."""

import sys

from .cli import main

sys.exit(main())
