"""`optimum-cli neuron-torch`, registered through optimum's `optimum.commands.register` namespace.

Kept light: argparse and optimum's command classes only. The library (torch, the device) is
imported inside `run`, so that `optimum-cli --help` stays fast.
"""

import sys
from argparse import ArgumentParser

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo


class CacheListCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="list", help="List the compiled graphs in the compile cache.")

    def run(self) -> None:
        from optimum_neuron_torch.commands.cache import list_cache

        list_cache()


class CacheStatsCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="stats", help="Show where the compile cache is, and its size.")

    def run(self) -> None:
        from optimum_neuron_torch.commands.cache import print_cache_stats

        print_cache_stats()


class CacheClearCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="clear", help="Remove every compiled graph from the compile cache.")

    def run(self) -> None:
        from optimum_neuron_torch.commands.cache import clear_cache

        clear_cache()


class CheckCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="check", help="Report what a model hits on TorchNeuron: fallbacks, graph breaks, lowering, dtypes, patches.")

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        parser.add_argument("model", help="A Hub model id or a local folder.")
        parser.add_argument("--format", choices=("text", "json", "markdown"), default="text", help="Report format (default: text).")
        parser.add_argument("--strict", action="store_true", help="Exit with status 1 when anything falls back.")
        parser.add_argument("--no-patches", action="store_true", help="Check the model as it is, without the library's patches.")
        parser.add_argument("--no-compile", action="store_true", help="Run the eager check only (no torch.compile).")
        parser.add_argument("--sequence-length", type=int, default=16, help="Length of the random example input (default: 16).")

    def run(self) -> None:
        from optimum_neuron_torch.commands.check import run_check

        sys.exit(run_check(self.args.model, self.args.format, self.args.strict, not self.args.no_patches,
                           not self.args.no_compile, self.args.sequence_length))


def _subcommand(command: type[BaseOptimumCLICommand]) -> CommandInfo:
    return CommandInfo(name=command.COMMAND.name, help=command.COMMAND.help, subcommand_class=command)


class CacheCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="cache", help="Inspect or clear the cache of compiled graphs.")
    SUBCOMMANDS = tuple(map(_subcommand, (CacheListCommand, CacheStatsCommand, CacheClearCommand)))


class NeuronTorchCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="neuron-torch", help="optimum-neuron-torch: Transformers on the PyTorch neuron device.")
    SUBCOMMANDS = (_subcommand(CacheCommand), _subcommand(CheckCommand))


REGISTER_COMMANDS = [NeuronTorchCommand]
