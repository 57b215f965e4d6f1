"""`optimum-cli neuron-torch serve [MODEL]`."""

import sys
from argparse import ArgumentParser

from optimum.commands.base import CommandInfo

from .base import (
    DEFAULT_MODEL_HELP,
    LibraryCommand,
    add_dtype,
    add_model,
    add_tensor_parallel_size,
    positive,
    sizes,
)


class ServeCommand(LibraryCommand):
    COMMAND = CommandInfo(name="serve", help="Serve a model over HTTP with the OpenAI API (chat and text "
                                             "completions), batching requests in flight on compiled graphs.")
    EXAMPLES = (
        "optimum-cli neuron-torch serve",
        "optimum-cli neuron-torch serve --model org/model-id --dtype bfloat16 --batch-size 8 --port 8080",
        "optimum-cli neuron-torch serve --model org/model-id --tensor-parallel-size 2",
        "optimum-cli neuron-torch serve --task embed --batch-size 16 --max-length 256",
        "optimum-cli neuron-torch serve --model openai/whisper-tiny.en --task transcribe",
    )

    @staticmethod
    def parse_args(parser: ArgumentParser) -> None:
        add_model(parser, f"A Hub model id or a local folder ({DEFAULT_MODEL_HELP}); clients give this name as "
                          "`model`", required=False)
        add_dtype(parser)
        parser.add_argument("--host", default="127.0.0.1",
                            help="The address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for "
                                 "every interface).")
        parser.add_argument("--port", type=positive, default=8000, help="The TCP port (default: 8000).")
        parser.add_argument("--batch-size", type=positive,
                            help="Decode slots: the most requests generating at once; more wait in a queue "
                                 "(default: the model's largest batch bucket, 8 unless it was saved with others).")
        parser.add_argument("--max-length", type=positive,
                            help="Positions per request, prompt plus new tokens (default: the model's context "
                                 "length, capped at 2048).")
        parser.add_argument("--prompt-buckets", type=sizes,
                            help="Prompt lengths of the prefill graphs, comma-separated, e.g. 16,64,256; a longer "
                                 "prompt is prefilled in chunks of the largest (default: 16, 64, 256, ... up to half "
                                 "of max-length).")
        parser.add_argument("--prefill-budget", type=positive,
                            help="The most prompt tokens prefilled between two decode steps: the longest a new "
                                 "request delays the others' next token (default: the largest prompt bucket).")
        parser.add_argument("--task", choices=("generate", "embed", "transcribe"),
                            help="generate: chat and completions; embed: /v1/embeddings from an encoder; "
                                 "transcribe: /v1/audio/transcriptions from a speech recognition model (default: "
                                 "embed for a sentence-transformers folder, transcribe for Whisper or a CTC model, "
                                 "else generate; the default embedding model is the packaged all-MiniLM-L6-v2).")
        parser.add_argument("--prompt-logprobs", action="store_true",
                            help="Let completions score their prompt (`echo` with `logprobs`, as lm-eval's "
                                 "loglikelihood tasks ask): compiles a scoring prefill per prompt bucket and chunk "
                                 "too (sharing all but its head with the prefill of its shape).")
        parser.add_argument("--enable-prefix-caching", action="store_true",
                            help="Reuse the keys and values of a prompt's first tokens that a slot holds from an "
                                 "earlier request (a shared system prompt, a chat's earlier turns): compiles the "
                                 "pieces that follow a prefix too (a graph per prompt bucket and context bucket "
                                 "beyond it).")
        parser.add_argument("--speculative-config",
                            help="Speculative decoding of a request decoding alone, greedy, as a JSON object (vLLM's "
                                 "fields): {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                                 "\"prompt_lookup_max\": 3, \"prompt_lookup_min\": 2} (prompt lookup) or "
                                 "{\"method\": \"draft_model\", \"model\": FOLDER, \"num_speculative_tokens\": 4}; "
                                 "compiles a verify graph per context bucket (and the draft model's graphs).")
        parser.add_argument("--enable-lora", action="store_true",
                            help="Serve LoRA adapters (PEFT's), named by requests as their `model`, loaded at the "
                                 "start (--lora-modules) or while serving (POST /v1/load_lora_adapter, "
                                 "/v1/unload_lora_adapter): rows of different adapters share each step, and adding "
                                 "one compiles nothing.")
        parser.add_argument("--lora-modules", nargs="+", metavar="NAME=FOLDER",
                            help="LoRA adapters to load at the start (implies --enable-lora).")
        parser.add_argument("--max-loras", type=positive, default=4, help="LoRA adapters loaded at once (default 4).")
        parser.add_argument("--max-lora-rank", type=positive, default=16,
                            help="The largest rank of a LoRA adapter (default 16): the graphs' fixed shape.")
        parser.add_argument("--tool-call-parser", choices=("hermes", "llama3_json", "mistral"),
                            help="How the model writes tool calls, which answers to requests with `tools` are read "
                                 "for (default: the format its chat template names, if any).")
        parser.add_argument("--api-key",
                            help="Clients must send `Authorization: Bearer KEY` (default: the environment variable "
                                 "OPTIMUM_NEURON_TORCH_API_KEY; none: no key needed).")
        add_tensor_parallel_size(parser)

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
              prompt_logprobs=args.prompt_logprobs, tool_call_parser=args.tool_call_parser, task=args.task,
              prefix_caching=args.enable_prefix_caching, speculative_config=args.speculative_config,
              enable_lora=args.enable_lora, lora_modules=args.lora_modules, max_loras=args.max_loras,
              max_lora_rank=args.max_lora_rank,
              tp_size=args.tp_size, dtype=args.dtype)
        return 0
