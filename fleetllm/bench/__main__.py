"""``python -m fleetllm.bench``: the same as ``fleetllm bench``."""

import sys

from fleetllm.bench.cli import main

sys.exit(main())
