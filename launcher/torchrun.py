"""``torchrun`` (``torch.distributed.run``) whose stop by a signal is one line, not a traceback.

    python -m launcher.torchrun [torchrun arguments ...]

The launcher stops the trainer with SIGTERM (``Supervisor.stop``; Ctrl-C of the job). torchrun's
agent then shuts its ranks down and raises ``SignalException`` out of its ``main``, which ends
``trainer.log`` with a 30-line traceback and two warnings about the signal, although nothing went
wrong. Here that exception becomes the single line ``[trainer] stopped by SIGTERM; ranks shut
down`` and exit status 128 + the signal number (as a shell reports it); those two warnings are
dropped. Everything else, a rank's failure included, is torchrun's own behaviour and output.
"""

from __future__ import annotations

import logging
import signal
import sys

_SHUTDOWN_NOTICES = ("death signal, shutting down workers", "closing signal")
# the loggers that write them (torch.distributed.elastic logs under each module's name)
_NOTICE_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")


class _DropShutdownNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(notice in record.getMessage() for notice in _SHUTDOWN_NOTICES)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    for name in _NOTICE_LOGGERS:
        logging.getLogger(name).addFilter(_DropShutdownNotices())
    try:
        torchrun_main(argv)
    except SignalException as exc:
        print(f"[trainer] stopped by {signal.Signals(exc.sigval).name}; ranks shut down", flush=True)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
