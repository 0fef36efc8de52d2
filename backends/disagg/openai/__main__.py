"""``python -m disagg.openai``: the same as ``disagg openai`` (``disagg.openai.server``)."""

import sys

from disagg.openai.server import main

sys.exit(main())
