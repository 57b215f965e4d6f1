"""`optimum-cli neuron-torch`, registered through optimum's `optimum.commands.register` namespace.

Kept light: argparse and optimum's command classes only. The library (torch, the device) is
imported inside `run`, so that `optimum-cli --help` stays fast.
"""

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


def _subcommand(command: type[BaseOptimumCLICommand]) -> CommandInfo:
    return CommandInfo(name=command.COMMAND.name, help=command.COMMAND.help, subcommand_class=command)


class CacheCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="cache", help="Inspect or clear the cache of compiled graphs.")
    SUBCOMMANDS = tuple(map(_subcommand, (CacheListCommand, CacheStatsCommand, CacheClearCommand)))


class NeuronTorchCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="neuron-torch", help="optimum-neuron-torch: Transformers on the PyTorch neuron device.")
    SUBCOMMANDS = (_subcommand(CacheCommand),)


REGISTER_COMMANDS = [NeuronTorchCommand]
