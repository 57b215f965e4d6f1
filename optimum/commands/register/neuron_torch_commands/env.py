"""`optimum-cli neuron-torch env`."""

from argparse import ArgumentParser

from optimum.commands.base import CommandInfo

from .base import LibraryCommand


class EnvCommand(LibraryCommand):
    COMMAND = CommandInfo(name="env", help="Print the backend, versions, devices and cache folders, for a bug report.")
    EXAMPLES = ("optimum-cli neuron-torch env", "optimum-cli neuron-torch env --format json > env.json")

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        parser.add_argument("--format", choices=("text", "json"), default="text",
                            help="Output format (default: text).")

    def failure(self) -> str:
        return "cannot report the environment"

    def execute(self) -> int:
        from optimum_neuron_torch.commands.env import print_environment

        print_environment(self.args.format)
        return 0
