"""The commands of `optimum-cli neuron-torch`, one module per command (`base` holds what they share).
`optimum/commands/register/neuron_torch.py` registers the root command with optimum's CLI."""

from optimum.commands.base import CommandInfo

from .base import DescribedCommand, subcommand
from .cache import CacheCommand
from .check import CheckCommand
from .compile import CompileCommand
from .env import EnvCommand
from .generate import GenerateCommand
from .serve import ServeCommand


class NeuronTorchCommand(DescribedCommand):
    COMMAND = CommandInfo(name="neuron-torch", help="optimum-neuron-torch: Transformers on the PyTorch neuron device.")
    EXAMPLES = ('optimum-cli neuron-torch generate "What is the capital of France?"',
                "optimum-cli neuron-torch check --model org/model-id",
                "optimum-cli neuron-torch serve --model org/model-id")
    SUBCOMMANDS = tuple(map(subcommand, (GenerateCommand, CheckCommand, CompileCommand, ServeCommand, CacheCommand,
                                         EnvCommand)))


__all__ = ["NeuronTorchCommand"]
