"""The test suite's shared harness; test modules import from here, never from one another.

- ``listening``: the TCP sockets a process listens on (``/proc``).
- ``parity_reward``: a reward a random model earns half the time (named by dotted path in configs).
- ``sglang_ref``: running SGLang's own code in ``.venv-sglang``.
"""

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
