"""`optimum-cli neuron-torch cache list|stats|clear|push|pull`."""

from argparse import ArgumentParser

from optimum.commands.base import CommandInfo

from .base import DescribedCommand, LibraryCommand, subcommand


class CacheListCommand(LibraryCommand):
    COMMAND = CommandInfo(name="list", help="List the compiled graphs in the compile cache.")
    EXAMPLES = ("optimum-cli neuron-torch cache list",)

    def failure(self) -> str:
        return "cannot list the compile cache"

    def execute(self) -> int:
        from optimum_neuron_torch.commands.cache import list_cache

        list_cache()
        return 0


class CacheStatsCommand(LibraryCommand):
    COMMAND = CommandInfo(name="stats", help="Show where the compile cache is, and its size.")
    EXAMPLES = ("optimum-cli neuron-torch cache stats",)

    def failure(self) -> str:
        return "cannot read the compile cache"

    def execute(self) -> int:
        from optimum_neuron_torch.commands.cache import print_cache_stats

        print_cache_stats()
        return 0


class CacheClearCommand(LibraryCommand):
    COMMAND = CommandInfo(name="clear", help="Remove every compiled graph from the compile cache.")
    EXAMPLES = ("optimum-cli neuron-torch cache clear",)

    def failure(self) -> str:
        return "cannot clear the compile cache"

    def execute(self) -> int:
        from optimum_neuron_torch.commands.cache import clear_cache

        clear_cache()
        return 0


class CachePushCommand(LibraryCommand):
    COMMAND = CommandInfo(name="push", help="Copy the compiled graphs to a folder, an fsspec URL or a Hub repo.")
    EXAMPLES = ("optimum-cli neuron-torch cache push hf://my-org/neuron-cache",
                "optimum-cli neuron-torch cache push s3://my-bucket/neuron-cache")

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        parser.add_argument("destination", help="A local folder, an fsspec URL (s3://bucket/prefix) or a Hugging "
                                                "Face Hub repo (hf://org/repo, hf://datasets/org/repo).")

    def failure(self) -> str:
        return f"cannot push the compile cache to {self.args.destination}"

    def execute(self) -> int:
        from optimum_neuron_torch.commands.cache import push_cache

        push_cache(self.args.destination)
        return 0


class CachePullCommand(LibraryCommand):
    COMMAND = CommandInfo(name="pull", help="Copy compiled graphs from a folder, an fsspec URL or a Hub repo into "
                                            "the compile cache (each checked against its checksum and environment).")
    EXAMPLES = ("optimum-cli neuron-torch cache pull hf://my-org/neuron-cache@main",)

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        parser.add_argument("source", help="A local folder, an fsspec URL or a Hub repo (hf://org/repo@revision "
                                           "pins a revision).")

    def failure(self) -> str:
        return f"cannot pull compiled graphs from {self.args.source}"

    def execute(self) -> int:
        from optimum_neuron_torch.commands.cache import pull_cache

        pull_cache(self.args.source)
        return 0


class CacheCommand(DescribedCommand):
    COMMAND = CommandInfo(name="cache", help="Inspect, clear or share the cache of compiled graphs.")
    EXAMPLES = ("optimum-cli neuron-torch cache stats", "optimum-cli neuron-torch cache push hf://my-org/neuron-cache")
    SUBCOMMANDS = tuple(map(subcommand, (CacheListCommand, CacheStatsCommand, CacheClearCommand, CachePushCommand,
                                         CachePullCommand)))
