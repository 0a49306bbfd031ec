"""What hotpath's Python tools (corpus.py, sft_data.py) share at their command line: the user
mistake that ends a run with exit status 2, the signals that remove temporary output on the way
out (exit status 128 + the signal), and the file-system failure that ends it with status 1."""

import signal
import sys


class Fail(Exception):
    """A user mistake: the message, and the exit status (2)."""


class Interrupted(Exception):
    """SIGINT or SIGTERM: temporaries are removed on the way out."""


def fail(msg):
    raise Fail(msg)


def _on_signal(signum, _frame):
    raise Interrupted(signum)


def run(name, body):
    """Calls body() with SIGINT and SIGTERM raising Interrupted; returns the exit status and
    prints `NAME: error: ...` for what ended the run."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    try:
        body()
    except Fail as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        signum = e.args[0]
        print(f"{name}: stopped by {signal.Signals(signum).name}; nothing written",
              file=sys.stderr)
        return 128 + signum
    except OSError as e:
        print(f"{name}: error: {e.filename or ''}: {e.strerror or e}; nothing written",
              file=sys.stderr)
        return 1
    return 0
