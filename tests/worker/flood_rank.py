"""A stand-in rank process that floods its output: ``FLOOD_LINES`` lines of 100 bytes as fast
as it can, then exits 0 (tests/worker/test_rank_logs.py). Arguments are ignored."""

import os
import sys

FLOOD_LINES = int(os.environ.get("SURGE_TEST_FLOOD_LINES", "20000"))

if __name__ == "__main__":
    line = "flood ".ljust(99, "x") + "\n"
    for _ in range(FLOOD_LINES):
        sys.stdout.write(line)
    sys.stdout.flush()
