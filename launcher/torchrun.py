"""``torchrun`` whose rendezvous listens on ``--master-addr`` only (docs/configuration.md#security)
and whose stop by SIGTERM is one line, ``[trainer] stopped by SIGTERM; ranks shut down``, exit
status 128 + the signal, not a traceback. Usage: ``python -m launcher.torchrun [torchrun arguments]``."""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys

_SHUTDOWN_NOTICES = ("death signal, shutting down workers", "closing signal")
# the loggers that write them (torch.distributed.elastic logs under each module's name)
_NOTICE_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")


class _DropShutdownNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(notice in record.getMessage() for notice in _SHUTDOWN_NOTICES)


def rendezvous_store(argv: list[str]):
    """The rendezvous store of the torchrun that ``argv`` starts, listening on ``--master-addr``
    only, or ``None`` when torchrun would not host a static one on a given port (keep it alive
    while torchrun runs). Raises ``OSError`` if that address and port cannot be bound."""
    from torch.distributed.run import parse_args

    from areal_async.tcp_store import hosted_store

    args = parse_args(argv)
    if args.standalone or args.rdzv_backend != "static" or args.rdzv_endpoint \
            or str(args.nnodes) not in ("1", "1:1") or not args.master_port:
        return None
    timeout = datetime.timedelta(seconds=600)  # torchrun's static rendezvous default (_default_timeout_seconds)
    return hosted_store(args.master_addr, args.master_port, None, timeout, multi_tenant=True, wait_for_workers=False)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    for name in _NOTICE_LOGGERS:
        logging.getLogger(name).addFilter(_DropShutdownNotices())
    argv = sys.argv[1:] if argv is None else argv
    # the ranks' parent, which they check after tying their death to it: one that died while they
    # started is otherwise never seen (their parent is then init)
    os.environ["AREAL_ASYNC_TORCHRUN_PID"] = str(os.getpid())  # trainer.main.TORCHRUN_PID_ENV
    store = rendezvous_store(argv)  # torchrun's agent reuses it: held until torchrun returns
    try:
        torchrun_main(argv)
    except SignalException as exc:
        print(f"[trainer] stopped by {signal.Signals(exc.sigval).name}; ranks shut down", flush=True)
        return 128 + int(exc.sigval)
    finally:
        del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
