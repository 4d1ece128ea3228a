"""``python -m tests.support.chaos worker ROLE``: a chaos worker process."""

import sys

from tests.support.chaos.worker import worker_main

worker_main(sys.argv[1:])
