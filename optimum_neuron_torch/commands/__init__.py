"""What the `optimum-cli neuron-torch` commands do. The commands themselves (argparse only) are
registered from `optimum/commands/register/neuron_torch.py` and import this package when they run."""
