"""`optimum-cli neuron-torch`, registered through optimum's `optimum.commands.register` namespace
(optimum imports every module of it, and registers its `REGISTER_COMMANDS`). The commands are in
`neuron_torch_commands/`, one module each; like this module, they import argparse and optimum's
command classes only, and the library when they run."""

from optimum.commands.register.neuron_torch_commands import NeuronTorchCommand

REGISTER_COMMANDS = [NeuronTorchCommand]
