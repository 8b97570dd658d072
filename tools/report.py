"""The report of a staleness study or of any runs: ``summary.csv`` and a self-contained ``report.html``.

    python tools/report.py runs/<study>
    python tools/report.py RUN_DIR [RUN_DIR ...] [--out DIR] [--group-by KEY ...]
        [--metric rollout/correct] [--threshold X | start+D] [--window N]

A thin entry point: what it reads and writes is ``areal_async/report/build.py``'s docstring.
Exit status 0, or 2 for bad input (the error names the path and the fix).
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run as a script: the repository's package
from areal_async.report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
