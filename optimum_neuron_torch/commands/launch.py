"""Starting the ranks of a tensor-parallel command (`--tp-size N`): torch's own launcher
(`torch.distributed.run`, elastic, standalone rendezvous on this host) runs N copies of the same
`optimum-cli` command, one process per `neuron` device; rank 0 writes the answer on stdout."""

from __future__ import annotations

import sys

from .. import settings


def is_first_rank() -> bool:
    """Whether this process speaks for the job: rank 0, or the only process."""
    return settings.launcher_rank() == 0


def launch(processes: int, arguments: list[str]) -> int:
    """Runs `optimum-cli ARGUMENTS` as `processes` ranks on this host through `torch.distributed.run`;
    returns 0 when every rank succeeded.

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a rank failed (it names
            the rank, its exit code and, on the rank's stderr, its error).
    """
    from torch.distributed import run

    command = "from optimum.commands.optimum_cli import main; main()"
    run.main(["--standalone", f"--nproc-per-node={processes}", "--no-python", sys.executable, "-c", command,
              *arguments])
    return 0
