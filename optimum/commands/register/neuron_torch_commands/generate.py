"""`optimum-cli neuron-torch generate [PROMPT]`."""

import sys
from argparse import ArgumentParser

from optimum.commands.base import CommandInfo

from .base import DEFAULT_MODEL_HELP, LibraryCommand, add_dtype, add_model, add_tensor_parallel_size


class GenerateCommand(LibraryCommand):
    COMMAND = CommandInfo(name="generate",
                          help="Generate text on the neuron device, streamed to stdout (chat template applied).")
    EXAMPLES = (
        'optimum-cli neuron-torch generate "What is the capital of France?"',
        'echo "Write a haiku" | optimum-cli neuron-torch generate --model org/model-id --dtype bfloat16 --do-sample',
    )

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        parser.add_argument("prompt", nargs="?", help="The prompt (default: read from stdin).")
        add_model(parser, f"A Hub model id or a local folder ({DEFAULT_MODEL_HELP})", positional=False,
                  required=False)
        add_dtype(parser)
        parser.add_argument("--max-new-tokens", type=int, default=256,
                            help="The most tokens to generate (default: 256).")
        parser.add_argument("--do-sample", action="store_true",
                            help="Sample the next token instead of taking the most likely one.")
        parser.add_argument("--temperature", type=float, help="Sampling temperature (needs --do-sample).")
        parser.add_argument("--top-k", type=int, help="Sample among the k most likely tokens (needs --do-sample).")
        parser.add_argument("--top-p", type=float,
                            help="Sample among the most likely tokens of cumulative probability p "
                                 "(needs --do-sample).")
        parser.add_argument("--seed", type=int, help="Random seed, for reproducible sampling.")
        parser.add_argument("--no-chat-template", action="store_true",
                            help="Give the prompt as it is, without the tokenizer's chat template.")
        parser.add_argument("--system", help="A system message, put before the prompt by the chat template.")
        add_tensor_parallel_size(parser)

    def failure(self) -> str:
        return f"cannot generate with {self.args.model or 'the default model'}"

    def execute(self) -> int:
        from optimum_neuron_torch.commands.generate import generate, read_prompt
        from optimum_neuron_torch.commands.launch import launch
        from optimum_neuron_torch.settings import launched

        args = self.args
        if args.tp_size > 1 and not launched():  # the ranks get the prompt read here (stdin is ours)
            prompt = [] if args.prompt is not None else ["--", read_prompt(None)]
            return launch(args.tp_size, [*sys.argv[1:], *prompt])
        generate(args.model, args.prompt, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                 chat_template=not args.no_chat_template, system=args.system, tp_size=args.tp_size, dtype=args.dtype)
        return 0
