"""`optimum-cli neuron-torch compile MODEL`."""

import sys
from argparse import ArgumentParser

from optimum.commands.base import CommandInfo

from .base import LibraryCommand, add_dtype, add_model, add_tensor_parallel_size, sizes


class CompileCommand(LibraryCommand):
    COMMAND = CommandInfo(name="compile", help="Precompile a model's generation graphs into the compile cache.")
    EXAMPLES = (
        "optimum-cli neuron-torch compile --model org/model-id --dry-run",
        "optimum-cli neuron-torch compile --model org/model-id --batch-sizes 1,4 --prompt-buckets 64,256 "
        "--save ./precompiled",
    )

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        add_model(parser, "A Hub model id or a local folder (a causal or encoder-decoder language model)")
        add_dtype(parser)
        parser.add_argument("--batch-sizes", type=sizes,
                            help="Batch-size buckets, comma-separated, e.g. 1,4 (default: the model's).")
        parser.add_argument("--prompt-buckets", type=sizes,
                            help="Prompt-length buckets, comma-separated, e.g. 16,64 (default: the model's).")
        parser.add_argument("--max-length", type=int,
                            help="KV cache length: padded prompt plus new tokens (default: the model's).")
        parser.add_argument("--context-buckets", type=sizes,
                            help="Context-length buckets of the cache a step attends over, comma-separated, "
                                 "e.g. 128,512 (max-length is always one; default: the model's, or max-length "
                                 "and its quarters down to 128 with a new max-length).")
        parser.add_argument("--save", metavar="DIR",
                            help="Save the model (and its tokenizer) with its compiled graphs in DIR.")
        parser.add_argument("--dry-run", action="store_true",
                            help="Print the graphs these buckets compile (the compile bill); compile nothing.")
        add_tensor_parallel_size(parser)

    def failure(self) -> str:
        return f"cannot compile {self.args.model}"

    def execute(self) -> int:
        from optimum_neuron_torch.commands.compile import compile_model
        from optimum_neuron_torch.commands.launch import launch
        from optimum_neuron_torch.settings import launched

        args = self.args
        if args.tp_size > 1 and not launched():
            return launch(args.tp_size, sys.argv[1:])
        compile_model(args.model, args.batch_sizes, args.prompt_buckets, args.max_length, args.save, args.tp_size,
                      args.context_buckets, args.dry_run, dtype=args.dtype)
        return 0
