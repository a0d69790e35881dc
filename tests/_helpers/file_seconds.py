"""Each test file's seconds in a run, for the order the suite dispatches its files in
(``tests/conftest.py``: the longest first, so that two xdist workers end together).

    python -m pytest -q --durations=0 > run.log
    python tests/_helpers/file_seconds.py run.log > tests/file_seconds.json

Reads pytest's ``--durations`` lines (setup, call and teardown summed per file); the figures
only order the files, so a stale file costs balance, never a result."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter

LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+([^:\s]+)::")


def file_seconds(lines) -> dict[str, float]:
    totals: Counter = Counter()
    for line in lines:
        m = LINE.match(line)
        if m:
            totals[m.group(2)] += float(m.group(1))
    return {f: round(s, 1) for f, s in totals.most_common()}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        json.dump(file_seconds(f), sys.stdout, indent=1)
    print()
