"""`optimum-cli neuron-torch check MODEL`."""

from argparse import ArgumentParser

from optimum.commands.base import CommandInfo

from .base import LibraryCommand, add_dtype, add_model


class CheckCommand(LibraryCommand):
    COMMAND = CommandInfo(name="check",
                          help="Report what a model hits on TorchNeuron: fallbacks, graph breaks, lowering, dtypes, "
                               "patches.")
    EXAMPLES = (
        "optimum-cli neuron-torch check --model org/model-id",
        "optimum-cli neuron-torch check --model ./my-model --dtype bfloat16 --training --format markdown --strict",
    )

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        add_model(parser, "A Hub model id or a local folder")
        add_dtype(parser)
        parser.add_argument("--format", choices=("text", "json", "markdown"), default="text",
                            help="Report format (default: text).")
        parser.add_argument("--strict", action="store_true", help="Exit with status 1 when anything falls back.")
        parser.add_argument("--no-patches", action="store_true",
                            help="Check the model as it is, without the library's patches.")
        parser.add_argument("--no-compile", action="store_true", help="Run the eager check only (no torch.compile).")
        parser.add_argument("--sequence-length", type=int, default=16,
                            help="Length of the random example input (default: 16).")
        parser.add_argument("--training", action="store_true",
                            help="Also check a training step: the backward pass's fallbacks, graph breaks and "
                                 "lowering.")

    def failure(self) -> str:
        return f"cannot check {self.args.model}"

    def execute(self) -> int:
        from optimum_neuron_torch.commands.check import run_check

        args = self.args
        return run_check(args.model, args.format, args.strict, not args.no_patches, not args.no_compile,
                         args.sequence_length, args.training, dtype=args.dtype)
