"""Starting the ranks of a tensor-parallel command (`--tp-size N`): torch's own launcher
(`torch.distributed.run`, elastic, standalone rendezvous on this host) runs N copies of the same
`optimum-cli` command, one process per `neuron` device; rank 0 writes the answer on stdout."""

from __future__ import annotations

import os
import signal
import sys

from .. import settings


def is_first_rank() -> bool:
    """Whether this process speaks for the job: rank 0, or the only process."""
    return settings.launcher_rank() == 0


def launch(processes: int, arguments: list[str], drain_seconds: int | None = None) -> int:
    """Runs `optimum-cli ARGUMENTS` as `processes` ranks on this host through `torch.distributed.run`;
    returns 0 when every rank succeeded.

    With `drain_seconds` (a server), SIGTERM or Ctrl-C is a request to stop, not a failure: torch's
    launcher passes it to the ranks and waits up to `drain_seconds` for them to finish their work
    (then kills them), and this returns 0.

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a rank failed (it names
            the rank, its exit code and, on the rank's stderr, its error).
    """
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing import SignalException

    command = "from optimum.commands.optimum_cli import main; main()"
    if drain_seconds is not None:
        os.environ.setdefault(settings.ELASTIC_SHUTDOWN_TIMEOUT_ENV, str(drain_seconds))
    try:
        run.main(["--standalone", f"--nproc-per-node={processes}", "--no-python", sys.executable, "-c", command,
                  *arguments])
    except SignalException as error:
        if drain_seconds is None or error.sigval not in (signal.SIGTERM, signal.SIGINT):
            raise
    return 0
