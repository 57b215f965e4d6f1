"""Mutation testing of the modules where a silent bug costs users most, with mutmut.

    pip install -e ".[dev,mutation]"
    python benchmarks/mutation.py            # the whole campaign (14-45 minutes on 2 cores, see MUTATION.md)
    python benchmarks/mutation.py --report   # the table of the last campaign, without running it
    python benchmarks/mutation.py --markdown # EQUIVALENT as MUTATION.md's list of equivalent mutants

mutmut copies `optimum_neuron_torch` into `mutants/` (git-ignored), mutates only the modules listed
in `[tool.mutmut] only_mutate` of pyproject.toml, runs the fast in-process tests of
`pytest_add_cli_args_test_selection` once to learn which tests reach which function, then runs, for
each mutant, only those tests (fastest first, stopping at the first failure). Tests that spawn a
Python subprocess are left out: the subprocess would import the unmutated package.

The table gives per module: mutants, killed (a test failed or the mutant timed out), survived, the
survivors judged equivalent (listed below with their reason), the mutants not tested yet (a campaign
stopped part-way resumes with `--keep`) and the score killed / (tested - equivalent).
The exit status is 1 when a module scores below 95% or a survivor is neither killed nor judged
equivalent. Results: benchmarks/MUTATION.md. This is not part of `python -m pytest`.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_SCORE = 0.95
MODULES = [
    "optimum_neuron_torch.loading.safetensors_file",
    "optimum_neuron_torch.compiler.cache",
    "optimum_neuron_torch.generation.buckets",
    "optimum_neuron_torch.generation.padding",
    "optimum_neuron_torch.loading.loader",
    "optimum_neuron_torch.fallbacks.policy",
    "optimum_neuron_torch.serving.protocol",
    "optimum_neuron_torch.serving.app",
    "optimum_neuron_torch.serving.server",
    "optimum_neuron_torch.device.reference.distributed",
    "optimum_neuron_torch.loading.sharding",
    "optimum_neuron_torch.training.collator",
    "optimum_neuron_torch.training.trainer_integration",
    "optimum_neuron_torch.training.activation_checkpointing",
]
KILLED = {"killed", "timeout", "segfault"}
# A mutant can make a test allocate without bound (one reached 10 GB on a 24 GB machine): each test
# process gets this much address space, and a mutant that needs more fails its test (killed).
MEMORY_LIMIT_BYTES = 6 * 1024**3

# Survivors that no test can kill because the mutated program behaves the same: name -> reason.
EQUIVALENT: dict[str, str] = {
    "optimum_neuron_torch.generation.buckets.xǁBucketsǁdefault__mutmut_24":
        "`max_length // 2` -> `max_length / 2` in the first bucket: only taken when below 16, and "
        "Buckets.__post_init__ applies int(), which truncates 10.5 to 10 like // does",
    "optimum_neuron_torch.generation.buckets.xǁBucketsǁdefault__mutmut_31":
        "`<= max_length // 2` -> `<= max_length / 2` in the loop: the left side is an integer, and for an "
        "integer n, n <= m / 2 holds exactly when n <= m // 2",
    "optimum_neuron_torch.generation.buckets.xǁBucketsǁfrom_dict__mutmut_13":
        "`stacklevel=2` dropped: only the line the warning is attributed to changes; under mutmut every call "
        "goes through a trampoline (one more frame), so no test run by mutmut can check the attribution",
    "optimum_neuron_torch.generation.buckets.xǁBucketsǁfrom_dict__mutmut_20":
        "`stacklevel=2` -> `3`: same as from_dict__mutmut_13",
    "optimum_neuron_torch.generation.buckets.xǁBucketsǁfor_slots__mutmut_11":
        "`2**power < slots` -> `2 * power < slots`: the two differ only for the largest power, when slots is "
        "that power of two, and then the extra batch size is slots itself, which __post_init__ deduplicates",
    "optimum_neuron_torch.generation.buckets.xǁBucketsǁfor_slots__mutmut_13":
        "`2**power < slots` -> `<=`: same as for_slots__mutmut_11 (slots itself, deduplicated)",
    "optimum_neuron_torch.generation.buckets.x_graph_plan__mutmut_31":
        "`len(context_buckets) > 1` -> `>= 1` (context windows with one bucket): the one bucket is "
        "max_length, so the prefills' and decode steps' contexts are the same, and the chunk graphs it adds "
        "have the shapes of the largest prefill, which the plan deduplicates",
    "optimum_neuron_torch.generation.buckets.x_graph_plan__mutmut_35":
        "contexts always the context buckets: with one bucket that is (max_length,) either way",
    "optimum_neuron_torch.generation.buckets.x_graph_plan__mutmut_49":
        "prefill context always context_bucket_for(length): with one context bucket that is max_length either"
        " way",
    "optimum_neuron_torch.generation.buckets.x_graph_plan__mutmut_108":
        "the deduplication key's flag `role == 'sampling decode'` -> `!=`: the flag is negated for every "
        "graph alike, so the same graphs are told apart",
    "optimum_neuron_torch.generation.buckets.x_distinct_programs__mutmut_5":
        "the engine's `role != 'decode'` -> `==` in the key of its ends: negated for every graph alike, the "
        "same number of distinct keys",
    "optimum_neuron_torch.generation.buckets.x_distinct_programs__mutmut_32":
        "the name 'logits' -> 'XXlogitsXX' for the ends that are not an encoder's or a sampler's: a label, "
        "renamed for all of them alike",
    "optimum_neuron_torch.generation.buckets.x_distinct_programs__mutmut_33":
        "'logits' -> 'LOGITS': same as distinct_programs__mutmut_32",
    "optimum_neuron_torch.compiler.cache.xǁCompileCacheǁadd__mutmut_24":
        "`'key'` -> `'XXkeyXX'` in the names `add` drops from the copied metadata: a kept 'key' is the "
        "entry's own key, so {'key': key, **copied} is the same dict",
    "optimum_neuron_torch.compiler.cache.xǁCompileCacheǁadd__mutmut_25":
        "`'key'` -> `'KEY'`: same as add__mutmut_24",
    "optimum_neuron_torch.compiler.cache.xǁCompileCacheǁdiscard__mutmut_4":
        "`stacklevel=3` dropped: attribution only, see from_dict__mutmut_13",
    "optimum_neuron_torch.compiler.cache.xǁCompileCacheǁdiscard__mutmut_7":
        "`stacklevel=3` -> `4`: attribution only",
    "optimum_neuron_torch.compiler.cache.xǁCompileCacheǁdiscard__mutmut_13":
        "`uuid4().hex[:8]` -> `[:9]` in the discarded entry's temporary name: still unique, removed at once",
    "optimum_neuron_torch.compiler.cache.xǁCompileCacheǁdiscard__mutmut_14":
        "`mkdir(parents=True)` -> `parents=None`: the parent is the cache's root, which exists whenever an "
        "entry does",
    "optimum_neuron_torch.compiler.cache.xǁCompileCacheǁdiscard__mutmut_16":
        "`parents=True` dropped: same as discard__mutmut_14",
    "optimum_neuron_torch.compiler.cache.x_file_digest__mutmut_13":
        "the checksum read in one block instead of 1 MiB blocks: the same SHA-256 (memory only)",
    "optimum_neuron_torch.compiler.cache.x_file_digest__mutmut_15":
        "2 MiB blocks instead of 1 MiB: the same SHA-256",
    "optimum_neuron_torch.compiler.cache.x_file_digest__mutmut_16":
        "`1 << 21` blocks: the same SHA-256",
    "optimum_neuron_torch.fallbacks.policy.xǁ_Policyǁ__init____mutmut_1":
        "`self._mode = ''` -> `None`: the initial mode only has to differ from 'error' (set() then clears "
        "TorchNeuron's tracking on entering it); None differs too",
    "optimum_neuron_torch.fallbacks.policy.xǁ_Policyǁ__init____mutmut_2":
        "`self._mode = ''` -> `'XXXX'`: same as __init____mutmut_1",
    "optimum_neuron_torch.fallbacks.policy.xǁ_Policyǁ__init____mutmut_3":
        "`self.explicit = False` -> `None`: the set() call that ends __init__ assigns it before anything "
        "reads it",
    "optimum_neuron_torch.fallbacks.policy.xǁ_Policyǁ__init____mutmut_4":
        "`self.explicit = False` -> `True`: same as __init____mutmut_3",
    "optimum_neuron_torch.fallbacks.policy.xǁ_Policyǁ__init____mutmut_9":
        "`self._forks_watched = False` -> `None`: read only as a truth value",
    "optimum_neuron_torch.fallbacks.policy.xǁ_Policyǁ_warn_new_fallbacks__mutmut_14":
        "`stacklevel=2` dropped: attribution only, see buckets from_dict__mutmut_13 (the text names the op "
        "and the module)",
    "optimum_neuron_torch.fallbacks.policy.xǁ_Policyǁ_warn_new_fallbacks__mutmut_15":
        "`stacklevel=2` -> `3`: attribution only",
    "optimum_neuron_torch.fallbacks.policy.x__name_caller__mutmut_20":
        "`*error.args[1:]` -> `[2:]`: the refused-fallback error comes from the C++ dispatcher with one "
        "argument, so both slices are empty",
    "optimum_neuron_torch.generation.padding.x_pad_token_id__mutmut_6":
        "`0 <= pad` -> `1 <= pad`: differs only for pad == 0, where the else branch returns the same 0",
    "optimum_neuron_torch.generation.padding.x_pad_token_id__mutmut_7":
        "`0 <= pad` -> `0 < pad`: same as x_pad_token_id__mutmut_6",
    "optimum_neuron_torch.generation.padding.x_pad_prompt__mutmut_9":
        "the id padding made on the CPU instead of the ids' device: equal results here because the reference "
        "device's torch.cat accepts a CPU operand (compiled generation pads on the host anyway); TorchNeuron "
        "would refuse the mix, a leniency of the reference device recorded in MUTATION.md",
    "optimum_neuron_torch.generation.padding.x_pad_prompt__mutmut_13":
        "same as x_pad_prompt__mutmut_9 (device argument dropped)",
    "optimum_neuron_torch.generation.padding.x_pad_prompt__mutmut_17":
        "same as x_pad_prompt__mutmut_9, for the mask padding",
    "optimum_neuron_torch.generation.padding.x_pad_prompt__mutmut_20":
        "same as x_pad_prompt__mutmut_17 (device argument dropped)",
    "optimum_neuron_torch.generation.padding.xǁPromptStreamedǁput__mutmut_1":
        "`self.first = False` -> `None`: read only as a truth value",
    "optimum_neuron_torch.training.collator.xǁBucketingDataCollatorǁ__post_init____mutmut_8":
        "`zip(..., strict=False)` -> `strict=None`: the default, and the two sequences differ in length by "
        "one by construction",
    "optimum_neuron_torch.training.collator.xǁBucketingDataCollatorǁ__post_init____mutmut_11":
        "`strict=False` dropped: the default",
    "optimum_neuron_torch.training.collator.xǁBucketingDataCollatorǁ__call____mutmut_36":
        "`zip(ids, labels, strict=True)` loosened: ids and labels are built from the same features, so they "
        "are always as long",
    "optimum_neuron_torch.training.collator.xǁBucketingDataCollatorǁ__call____mutmut_39":
        "`zip(ids, labels, strict=True)` loosened: ids and labels are built from the same features, so they "
        "are always as long",
    "optimum_neuron_torch.training.collator.xǁBucketingDataCollatorǁ__call____mutmut_40":
        "`zip(ids, labels, strict=True)` loosened: ids and labels are built from the same features, so they "
        "are always as long",
    "optimum_neuron_torch.training.collator.xǁBucketingDataCollatorǁ__call____mutmut_84":
        "`zip(ids, labels, strict=True)` loosened: ids and labels are built from the same features, so they "
        "are always as long",
    "optimum_neuron_torch.training.collator.xǁBucketingDataCollatorǁ__call____mutmut_87":
        "`zip(ids, labels, strict=True)` loosened: ids and labels are built from the same features, so they "
        "are always as long",
    "optimum_neuron_torch.training.collator.xǁBucketingDataCollatorǁ__call____mutmut_88":
        "`zip(ids, labels, strict=True)` loosened: ids and labels are built from the same features, so they "
        "are always as long",
    "optimum_neuron_torch.training.collator.xǁBucketingDataCollatorǁ__call____mutmut_63":
        "`dtype=torch.long` dropped (or None) in torch.full: a Python int fill value gives int64, torch.long,"
        " anyway",
    "optimum_neuron_torch.training.collator.xǁBucketingDataCollatorǁ__call____mutmut_66":
        "`dtype=torch.long` dropped (or None) in torch.full: a Python int fill value gives int64, torch.long,"
        " anyway",
    "optimum_neuron_torch.training.collator.xǁBucketingDataCollatorǁ__call____mutmut_77":
        "`dtype=torch.long` dropped (or None) in torch.full: a Python int fill value gives int64, torch.long,"
        " anyway",
    "optimum_neuron_torch.training.collator.xǁBucketingDataCollatorǁ__call____mutmut_80":
        "`dtype=torch.long` dropped (or None) in torch.full: a Python int fill value gives int64, torch.long,"
        " anyway",
    "optimum_neuron_torch.loading.sharding.x_check_divisible__mutmut_29":
        "the degrees listed up to max + 1 instead of max: max + 1 divides no positive count, so it is never "
        "listed",
    "optimum_neuron_torch.device.reference.distributed.x__all_gather_into_tensor_out__mutmut_5":
        "`AllgatherOptions()` -> None: the group's _allgather_base takes None for default options",
    "optimum_neuron_torch.device.reference.distributed.x__all_gather_into_tensor_out__mutmut_8":
        "options dropped: same as _all_gather_into_tensor_out__mutmut_5",
    "optimum_neuron_torch.serving.app.x__chat_prompt__mutmut_23":
        "`tokenize=True` dropped: apply_chat_template's default (Transformers 5)",
    "optimum_neuron_torch.serving.app.x__chat_prompt__mutmut_24":
        "`return_dict=True` dropped: apply_chat_template's default (Transformers 5)",
    "optimum_neuron_torch.loading.loader.x_plan_loading__mutmut_5":
        "tensors of a file planned in name order instead of byte order: only the order of reads changes "
        "(sequential reads are faster), every tensor is read either way",
    "optimum_neuron_torch.loading.loader.x_plan_loading__mutmut_7":
        "same as x_plan_loading__mutmut_5 (no sort key)",
    "optimum_neuron_torch.loading.loader.x__tied_targets__mutmut_5":
        "getattr default `{}` -> `None`: `None or {}` is the same empty set",
    "optimum_neuron_torch.loading.loader.x_check_device_memory__mutmut_4":
        "`mem_get_info(device)` -> `mem_get_info(None)` (the current device): the same device in every test "
        "process, which has one device, and from_pretrained resolves `neuron` to the current device before "
        "the check",
    "optimum_neuron_torch.loading.loader.x_release__mutmut_4":
        "`!= 'meta'` -> `!= 'XXmetaXX'`: a tensor already on meta is replaced by another empty meta tensor, "
        "the same thing",
    "optimum_neuron_torch.loading.loader.x_release__mutmut_5":
        "`!= 'meta'` -> `!= 'META'`: same as x_release__mutmut_4",
    "optimum_neuron_torch.loading.loader.x_release__mutmut_6":
        "released tensors set to None instead of meta tensors: release() runs only on a failed load whose "
        "model is then dropped; the device memory is given back either way (tested)",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_2":
        "the progress bar's total left out: display only (the bar itself is tested through _progress)",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_3":
        "the progress bar's name left out: display only",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_7":
        "`previous_file = None` -> `''`: differs from every file object alike",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_8":
        "prefetch() skipped on a file change (called for the other tensors instead): prefetch only starts "
        "kernel readahead, speed only",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_9":
        "prefetch() called for every tensor: readahead again, speed only",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_11":
        "`source = None` -> `''`: same as x_stream_into__mutmut_10",
    "optimum_neuron_torch.loading.loader.x_finalize__mutmut_6":
        "`conversion_errors={}` -> `None`: Transformers' finalization reads it only when non-empty",
    "optimum_neuron_torch.loading.loader.x_finalize__mutmut_7":
        "`skipped_pp_keys=set()` -> `None`: read only for pipeline-parallel loading, which the library does "
        "not do",
    "optimum_neuron_torch.loading.safetensors_file.xǁSafetensorsFileǁ__init____mutmut_23":
        "`if size` -> `if size or True`: the header check before it refuses files under 8 bytes, so size is "
        "never 0 there",
    "optimum_neuron_torch.serving.app.x__respond__mutmut_76":
        "the header name `Cache-Control` -> `cache-control`: HTTP header names are case-insensitive",
    "optimum_neuron_torch.serving.app.x__respond__mutmut_77":
        "`Cache-Control` -> `CACHE-CONTROL`: same as _respond__mutmut_76",
    "optimum_neuron_torch.serving.app.x__respond__mutmut_151":
        "`model_dump(mode='json')` -> `mode=None`: the answer holds strings, numbers and None only, which "
        "both modes dump alike",
    "optimum_neuron_torch.serving.app.x__respond__mutmut_153":
        "`mode='json'` dropped: same as _respond__mutmut_151",
    "optimum_neuron_torch.serving.app.x__respond__mutmut_155":
        "`mode='json'` -> `'XXjsonXX'` (pydantic's python mode): same as _respond__mutmut_151",
    "optimum_neuron_torch.serving.app.x__respond__mutmut_156":
        "`mode='json'` -> `'JSON'`: same as _respond__mutmut_155",
    "optimum_neuron_torch.serving.app.x__read_body__mutmut_4":
        "`headers.get('content-length')` -> `'CONTENT-LENGTH'`: Starlette's headers are case-insensitive",
    "optimum_neuron_torch.serving.protocol.x_parse__mutmut_37":
        "the message of a validation error without a field: parse() refuses every body that is not a JSON "
        "object before validating, and pydantic names a field (or an index under one) for every error of an "
        "object",
    "optimum_neuron_torch.serving.protocol.x_parse__mutmut_40":
        "same as x_parse__mutmut_37 (the branch without a field)",
    "optimum_neuron_torch.serving.protocol.x_parse__mutmut_41":
        "same as x_parse__mutmut_37 (the branch without a field)",
    "optimum_neuron_torch.compiler.cache.x__without_current_device_index__mutmut_6":
        "the text that replaces the current device in the graph's code -> another constant: the code is only "
        "hashed into the key, so every device still gets the same key",
    "optimum_neuron_torch.generation.buckets.x_default_context_buckets__mutmut_2":
        "`buckets[0] // 4 >= 128` -> `buckets[0] / 4 >= 128`: for an integer x, x / 4 >= 128 holds exactly "
        "when x // 4 >= 128",
    "optimum_neuron_torch.generation.buckets.x_distinct_programs__mutmut_13":
        "`role == 'encoder'` -> `!=` in the key of the code before the layers: negated for every graph alike,"
        " the same graphs told apart (the mutants that merge encoders with decoders are killed)",
    "optimum_neuron_torch.generation.buckets.x_distinct_programs__mutmut_21":
        "`role == 'encoder'` -> `!=` in the key of the layer programs: same as distinct_programs__mutmut_13",
    "optimum_neuron_torch.training.trainer_integration.x__reference_neuron_available__mutmut_1":
        "the default of `check_device` (Transformers' and accelerate's argument), which the answer for the "
        "reference device does not read",
    "optimum_neuron_torch.training.activation_checkpointing.x_with_random_ops_saved__mutmut_6":
        "`kwargs.get('use_reentrant', False)` -> default None: both false",
    "optimum_neuron_torch.training.activation_checkpointing.x_with_random_ops_saved__mutmut_8":
        "the default False dropped (None): both false",
    "optimum_neuron_torch.serving.app.x_build_app__mutmut_14":
        "`headers.get('authorization')` -> `'AUTHORIZATION'`: Starlette's headers are case-insensitive",
    "optimum_neuron_torch.serving.app.x_build_app__mutmut_15":
        "a missing Authorization header read as 'XXXX' instead of '': no scheme 'Bearer' either way, so 401",
    "optimum_neuron_torch.serving.app.x_build_app__mutmut_36":
        "the application's title (None): shown only in the API description, which the server does not serve "
        "(tested: /docs, /redoc, /openapi.json are 404)",
    "optimum_neuron_torch.serving.app.x_build_app__mutmut_39":
        "the title dropped: same as build_app__mutmut_36",
    "optimum_neuron_torch.serving.app.x_build_app__mutmut_45":
        "the title 'XXoptimum-neuron-torchXX': same as build_app__mutmut_36",
    "optimum_neuron_torch.serving.app.x_build_app__mutmut_46":
        "the title in capitals: same as build_app__mutmut_36",
    "optimum_neuron_torch.compiler.cache.x__without_current_device_index__mutmut_7":
        "the replacement text in capitals: same as _without_current_device_index__mutmut_6",
    "optimum_neuron_torch.compiler.cache.x_autocast_state__mutmut_14":
        "the text for a device type autocast does not know: torch 2.13's autocast knows both 'neuron' "
        "(PrivateUse1) and 'cpu', so the branch is not reached; it guards other versions",
    "optimum_neuron_torch.compiler.cache.xǁCompileCacheǁdiscard__mutmut_18":
        "`mkdir(parents=True)` -> `parents=False`: the parent of the cache's tmp folder is the cache's root, "
        "which exists",
    "optimum_neuron_torch.compiler.cache.xǁCompileCacheǁdiscard__mutmut_26":
        "`rmtree(trash, ignore_errors=True)` -> `None`: the folder was just renamed to a name of this "
        "process's own, so removing it meets no error",
    "optimum_neuron_torch.compiler.cache.xǁCompileCacheǁdiscard__mutmut_28":
        "`ignore_errors` dropped: same as discard__mutmut_26",
    "optimum_neuron_torch.compiler.cache.xǁCompileCacheǁdiscard__mutmut_29":
        "`ignore_errors=False`: same as discard__mutmut_26",
    "optimum_neuron_torch.generation.buckets.x_default_context_buckets__mutmut_11":
        "the quarters computed with / instead of //: __post_init__ applies int(), and for a positive x, int(x"
        " / 4) == x // 4 (the loop's test on the float gives the same floor too)",
    "optimum_neuron_torch.loading.sharding.x_as_parameter_value__mutmut_5":
        "`run_check=False` -> None: DTensor.from_local's default is False, and None is false",
    "optimum_neuron_torch.loading.sharding.x_as_parameter_value__mutmut_11":
        "`run_check=False` dropped: DTensor.from_local's default",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_12":
        "`source = None` -> `''`: a placeholder overwritten before use; neither holds device memory",
    "optimum_neuron_torch.loading.loader.x_stream_into__mutmut_38":
        "`value = source = None` -> `''` after the copy: both drop the references, which is the point",
    "optimum_neuron_torch.loading.safetensors_file.xǁSafetensorsFileǁprefetch__mutmut_1":
        "`if self._map is not None` -> `is None` makes prefetch() a no-op (a file that opens always has a "
        "map): MADV_WILLNEED only starts kernel readahead, nothing a test can observe but speed",
    "optimum_neuron_torch.serving.app.x_build_app__mutmut_41":
        "`docs_url=None` dropped: FastAPI serves /docs only with an OpenAPI description, which "
        "`openapi_url=None` turns off (tested: 404)",
    "optimum_neuron_torch.serving.app.x_build_app__mutmut_42":
        "`redoc_url=None` dropped: same as build_app__mutmut_41, for /redoc",
    "optimum_neuron_torch.loading.loader.x_check_device_memory__mutmut_19":
        "`needed > free` -> `>=` before giving the allocator's cached blocks back: when equal, the blocks are"
        " given back and the same free memory is read again, so the same answer",
    "optimum_neuron_torch.loading.loader.x_check_device_memory__mutmut_21":
        "`mem_get_info(device)` -> `mem_get_info(None)` (the current device) after emptying the cache: the "
        "same device in every test process, which has one, and from_pretrained resolves `neuron` to the "
        "current device before the check",
    "optimum_neuron_torch.loading.safetensors_file.xǁSafetensorsFileǁ_read_header__mutmut_71":
        "`zip(..., strict=False)` -> `strict=None`: False is zip's default and None is false",
    "optimum_neuron_torch.loading.safetensors_file.xǁSafetensorsFileǁ_read_header__mutmut_74":
        "`strict=False` dropped: zip's default",
    "optimum_neuron_torch.loading.safetensors_file.xǁSafetensorsFileǁtensor__mutmut_35":
        "`0 <= first < nbytes` -> `first <= nbytes`: a piece of at least one element starts before the "
        "tensor's last byte, so its first byte is never nbytes",
    "optimum_neuron_torch.loading.safetensors_file.xǁSafetensorsFileǁtensor__mutmut_45":
        "`zip(piece.shape, piece.stride(), strict=True)` -> `strict=None`: a tensor has one stride per "
        "dimension, so the lengths never differ",
    "optimum_neuron_torch.loading.safetensors_file.xǁSafetensorsFileǁtensor__mutmut_48":
        "`strict=True` dropped: same as tensor__mutmut_45",
    "optimum_neuron_torch.loading.safetensors_file.xǁSafetensorsFileǁtensor__mutmut_49":
        "`strict=True` -> `strict=False`: same as tensor__mutmut_45",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁ_failure__mutmut_4":
        "`exited: list[int] = []` -> `None`: the loop assigns it before it is read",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁ_failure__mutmut_12":
        "`time.monotonic() >= deadline` -> `>`: they differ only when the clock reads the deadline exactly, "
        "and then the loop stops one 50 ms poll later",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁalltoall__mutmut_67":
        "`zip(outputs, receive.split(sizes of outputs), strict=True)` -> `strict=None`: one chunk per output "
        "by construction, so the lengths never differ",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁalltoall__mutmut_70":
        "`strict=True` dropped: same as alltoall__mutmut_67",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁalltoall__mutmut_72":
        "`strict=True` -> `strict=False`: same as alltoall__mutmut_67",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁbarrier__mutmut_6":
        "the host views kept alive until gloo is done, `()` -> `None`: a barrier has none either way (both "
        "flatten to nothing)",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁallgather__mutmut_33":
        "`zip(output_lists, inputs, strict=True)` -> `strict=None`: `_check_pairs` refuses lists of different lengths "
        "just before, so the lengths never differ",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁallgather__mutmut_36":
        "`strict=True` dropped: same as allgather__mutmut_33",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁallgather__mutmut_37":
        "`strict=True` -> `strict=False`: same as allgather__mutmut_33",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁreduce_scatter__mutmut_35":
        "`zip(outputs, input_lists, strict=True)` -> `strict=None`: `_check_pairs` refuses lists of different lengths "
        "just before, so the lengths never differ",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁreduce_scatter__mutmut_38":
        "`strict=True` dropped: same as reduce_scatter__mutmut_35",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁreduce_scatter__mutmut_39":
        "`strict=True` -> `strict=False`: same as reduce_scatter__mutmut_35",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁ_each__mutmut_25":
        "`zip(outputs, inputs, strict=True)` -> `strict=None`: `_check_pairs` refuses lists of different lengths "
        "just before, so the lengths never differ",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁ_each__mutmut_28":
        "`strict=True` dropped: same as _each__mutmut_25",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁ_each__mutmut_29":
        "`strict=True` -> `strict=False`: same as _each__mutmut_25",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁ_each__mutmut_31":
        "an empty coalesced op's `DoneWork(self, ...)` -> `DoneWork(None, ...)`: a DoneWork's work is a "
        "finished future, which never fails, so the group (read only to name a failure) is never read",
    "optimum_neuron_torch.device.reference.distributed.xǁProcessGroupNeuronǁ_each__mutmut_32":
        "`DoneWork(self, op, [])` -> `DoneWork(self, None, [])`: same as _each__mutmut_31 (the op's name is "
        "read only to name a failure)",
}


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def mutmut(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    executable = Path(sys.executable).with_name("mutmut")
    command = [str(executable)] if executable.exists() else [sys.executable, "-m", "mutmut"]
    return subprocess.run([*command, *args], cwd=ROOT, check=not capture, text=True,
                          capture_output=capture, preexec_fn=None if capture else limit_memory)


def results() -> dict[str, str]:
    """{mutant name: status} of every mutant of the last campaign."""
    output = mutmut("results", "--all", "true", capture=True)
    if output.returncode:
        sys.exit(f"mutmut results failed:\n{output.stderr}")
    statuses = {}
    for line in output.stdout.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and name:
            statuses[name] = status.strip()
    return statuses


def module_of(mutant: str) -> str:
    return next((module for module in MODULES if mutant.startswith(module + ".")), mutant.rsplit(".", 1)[0])


def report(statuses: dict[str, str]) -> bool:
    """Prints the table; True when every module was tested in full, scores at least TARGET_SCORE and
    has no survivor left unexplained."""
    by_module: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    for name, status in statuses.items():
        by_module[module_of(name)].append((name, status))
    ok = True
    print(f"{'module':<52} {'total':>6} {'killed':>7} {'survived':>9} {'equivalent':>11} {'unchecked':>10} "
          f"{'score':>7}")
    for module in MODULES:
        mutants = by_module.get(module, [])
        killed = sum(status in KILLED for _, status in mutants)
        unchecked = sum(status == "not checked" for _, status in mutants)  # (a campaign stopped before them)
        survivors = [name for name, status in mutants if status not in KILLED and status != "not checked"]
        equivalent = [name for name in survivors if name in EQUIVALENT]
        relevant = len(mutants) - unchecked - len(equivalent)
        score = killed / relevant if relevant else 1.0
        ok &= score >= TARGET_SCORE and len(survivors) == len(equivalent) and bool(mutants) and not unchecked
        print(f"{module:<52} {len(mutants):>6} {killed:>7} {len(survivors):>9} {len(equivalent):>11} {unchecked:>10} "
              f"{score:>7.1%}")
    unexplained = [(name, status) for name, status in statuses.items()
                   if status not in KILLED and status != "not checked" and name not in EQUIVALENT]
    if unexplained:
        print("\nSurvivors neither killed nor judged equivalent (`mutmut show NAME` shows the diff):")
        for name, status in unexplained:
            print(f"  {name}: {status}")
    return ok


def equivalent_markdown() -> str:
    """EQUIVALENT as the list of benchmarks/MUTATION.md (one home for the reasons: this file)."""
    lines = [f"### Equivalent mutants ({len(EQUIVALENT)})", "",
             "The same list, with the same reasons, is `EQUIVALENT` in `benchmarks/mutation.py`, which fails the run",
             "on a survivor not in it (this list is its output with `--markdown`).", ""]
    for name, reason in EQUIVALENT.items():
        lines.append(f"- `{name.removeprefix('optimum_neuron_torch.')}`: {reason.rstrip('.')}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="print the last campaign's table only")
    parser.add_argument("--markdown", action="store_true", help="print EQUIVALENT for MUTATION.md")
    parser.add_argument("--keep", action="store_true", help="keep mutants/ and mutmut's cached results")
    parser.add_argument("--max-children", type=int, default=1, help="mutants tested at once (default 1)")
    args = parser.parse_args()
    os.chdir(ROOT)
    if args.markdown:
        print(equivalent_markdown())
        return
    if not args.report:
        if not args.keep:
            shutil.rmtree(ROOT / "mutants", ignore_errors=True)
        start = time.monotonic()
        mutmut("run", "--max-children", str(args.max_children))
        print(f"\nmutmut run took {time.monotonic() - start:.0f} s")
    sys.exit(0 if report(results()) else 1)


if __name__ == "__main__":
    main()
