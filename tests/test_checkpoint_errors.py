"""Bad checkpoints give a clear error naming the file and tensor, never a crash, never a
half-loaded model, and the device memory taken is given back."""

from __future__ import annotations

import gc
import json
import mmap
import re
import shutil
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import optimum_neuron_torch.device
from optimum_neuron_torch.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    InsufficientDeviceMemoryError,
    UnsafeCheckpointError,
)
from optimum_neuron_torch.loading.safetensors_file import MADV_POPULATE_READ, SafetensorsFile
from testing_utils import run_python
from tiny_models import TINY_MODELS

TINY = TINY_MODELS["llama"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    single = TINY.save(tmp_path_factory.mktemp("single") / "m")
    sharded = TINY.save(tmp_path_factory.mktemp("sharded") / "m", shard_size="20KB")
    return single, sharded


@pytest.fixture
def single(pristine, tmp_path):
    return shutil.copytree(pristine[0], tmp_path / "single")


@pytest.fixture
def sharded(pristine, tmp_path):
    return shutil.copytree(pristine[1], tmp_path / "sharded")


def header_of(path):
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_with_header(path, header, data, align=1):
    """A safetensors file of `header` and `data`; the header padded with spaces so that the data starts at a
    multiple of `align` bytes."""
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % align)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def assert_refused(folder, match, **kwargs):
    before = torch.neuron.memory_allocated()
    with pytest.raises(CheckpointError, match=match):
        TINY.neuron_class.from_pretrained(folder, **kwargs)
    assert torch.neuron.memory_allocated() == before


def test_truncated_shard(single):
    path = single / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    assert_refused(single, r"model.safetensors, tensor '.*': .*past the end of the file.*truncated or corrupted")


def test_corrupted_header(single):
    path = single / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[12:20] = b"\xff" * 8
    path.write_bytes(bytes(raw))
    assert_refused(single, r"file .*model.safetensors: the header is not valid JSON")


def test_header_claiming_bytes_past_the_end(single):
    path = single / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    assert_refused(single, r"model.safetensors: the header claims \d+ bytes but the file has \d+")


def test_unknown_dtype(single):
    path = single / "model.safetensors"
    header, data = header_of(path)
    header["model.norm.weight"]["dtype"] = "F128"
    write_with_header(path, header, data)
    assert_refused(single, r"model.safetensors, tensor 'model.norm.weight': unknown dtype 'F128'")


def _by_offset(header: dict) -> list[str]:
    return sorted((name for name in header if name != "__metadata__"), key=lambda name: header[name]["data_offsets"])


@pytest.mark.parametrize("change", [-4, 4, -1])
def test_byte_span_must_equal_shape_times_dtype_size(single, change):
    """A tensor whose data_offsets span a few bytes fewer or more than its shape needs: the first tensor
    (growing into the next one) or the last (shrinking, the file then has spare bytes)."""
    path = single / "model.safetensors"
    header, data = header_of(path)
    name = _by_offset(header)[0 if change > 0 else -1]
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end + change]
    write_with_header(path, header, data)
    with pytest.raises(CheckpointError) as refused:
        TINY.neuron_class.from_pretrained(single)
    assert refused.value.file == str(path) and refused.value.tensor == name
    assert f"data_offsets [{begin}, {end + change}] span {end + change - begin} bytes but shape " in str(refused.value)
    assert f"needs {end - begin}" in str(refused.value)


def test_offsets_running_backwards_are_refused(single):
    path = single / "model.safetensors"
    header, data = header_of(path)
    name = _by_offset(header)[1]
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [end, begin]
    write_with_header(path, header, data)
    assert_refused(single, rf"model.safetensors, tensor '{name}': data_offsets \[{end}, {begin}\] span")


def test_overlapping_tensors_are_refused(single):
    """Two tensors sharing 4 bytes, each with the right span: the later one is named, with the other."""
    path = single / "model.safetensors"
    header, data = header_of(path)
    first, second = _by_offset(header)[:2]
    begin, end = header[second]["data_offsets"]
    header[second]["data_offsets"] = [begin - 4, end - 4]
    write_with_header(path, header, data)
    with pytest.raises(CheckpointError) as refused:
        TINY.neuron_class.from_pretrained(single)
    assert refused.value.file == str(path) and refused.value.tensor == second
    assert f"its bytes overlap those of tensor {first!r}" in str(refused.value)


def test_a_failure_part_way_through_copying_gives_back_all_device_memory(single, monkeypatch):
    """The fifth tensor read fails after four are on the device: the error propagates, no device memory
    stays taken (the partly loaded model is emptied), and a later load works."""
    from optimum_neuron_torch.loading import safetensors_file

    original, reads, before = safetensors_file.SafetensorsFile.tensor, [], None

    def failing(self, name, part=None):
        reads.append(torch.neuron.memory_allocated())
        if len(reads) == 5:
            raise OSError(f"injected read failure at {name}")
        return original(self, name, part)

    gc.collect()
    before = torch.neuron.memory_allocated()
    monkeypatch.setattr(safetensors_file.SafetensorsFile, "tensor", failing)
    with pytest.raises(OSError, match="injected read failure") as failure:
        TINY.neuron_class.from_pretrained(single)
    assert reads[-1] > before  # four tensors were on the device when it failed
    # The traceback (kept alive by `failure`) still holds the model's frames: its tensors must be gone all the same.
    assert failure.traceback and torch.neuron.memory_allocated() == before
    del failure
    monkeypatch.undo()
    model = TINY.neuron_class.from_pretrained(single)
    assert torch.neuron.memory_allocated() > before
    del model


def test_duplicate_tensor_names(single):
    path = single / "model.safetensors"
    header, data = header_of(path)
    text = json.dumps(header)
    entry = json.dumps({"model.norm.weight": header["model.norm.weight"]})[1:-1]
    text = text[:-1] + ", " + entry + "}"
    path.write_bytes(struct.pack("<Q", len(text)) + text.encode() + data)
    assert_refused(single, r"model.safetensors, tensor 'model.norm.weight': the header names the tensor twice")


def test_duplicate_tensor_across_shards(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    first, second = sharded / shards[0], sharded / shards[1]
    header, data = header_of(second)
    extra_name = next(iter(header_of(first)[0].keys() - {"__metadata__"}))
    moved = next(name for name in header if name != "__metadata__")
    header[extra_name] = header.pop(moved)
    write_with_header(second, header, data)
    message = (f"file {second}, tensor '{extra_name}': the tensor is also in {first.name}: "
               "a checkpoint names each tensor once")
    assert_refused(sharded, "^" + re.escape(message) + "$")


def test_shape_mismatch_with_the_config(single):
    path = single / "model.safetensors"
    header, data = header_of(path)
    header["model.norm.weight"]["shape"] = [16, 2]
    write_with_header(path, header, data)
    assert_refused(single, "^" + re.escape(
        f"file {path}, tensor 'model.norm.weight': its shape [16, 2] does not match the model's [32] for "
        "model.norm.weight (config LlamaConfig); check that the config belongs to these weights, or pass "
        "ignore_mismatched_sizes=True to initialize the mismatched weights afresh") + "$")


def test_missing_shard_named_in_the_index(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (sharded / victim).unlink()
    assert_refused(sharded, rf"model.safetensors.index.json, tensor '.*': the index names the shard {victim}, "
                            r"which is missing")


def test_index_pointing_outside_the_folder(sharded, tmp_path):
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../../etc/passwd"
    index_path.write_text(json.dumps(index))
    assert_refused(sharded, rf"tensor '{name}': the shard '../../etc/passwd' lies outside the checkpoint folder")


def test_index_naming_a_tensor_its_shard_lacks(sharded):
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.ghost.weight"] = shard
    index_path.write_text(json.dumps(index))
    assert_refused(sharded, "^" + re.escape(f"file {sharded / shard}, tensor 'model.ghost.weight': the index places "
                                            f"the tensor in {shard}, which does not contain it") + "$")


def test_index_placing_a_tensor_in_another_shard_than_its_own(sharded):
    """A tensor the index assigns to a shard that does not hold it is refused (it used to be skipped,
    leaving the weight at its random initialization)."""
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(name for name, shard in index["weight_map"].items() if shard == shards[0])
    index["weight_map"][name] = shards[1]
    index_path.write_text(json.dumps(index))
    assert_refused(sharded, "^" + re.escape(f"file {sharded / shards[1]}, tensor '{name}': the index places the "
                                            f"tensor in {shards[1]}, which does not contain it") + "$")


def test_a_tensor_the_index_leaves_out_is_loaded_from_its_shard(sharded):
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.norm.weight"]
    index_path.write_text(json.dumps(index))
    loaded = TINY.neuron_class.from_pretrained(sharded)
    assert torch.equal(loaded.model.norm.weight.cpu(), TINY.build().model.norm.weight)


def test_no_config(single):
    (single / "config.json").unlink()
    assert_refused(single, r"no config.json in the folder")


def test_pickled_checkpoints_are_refused_unless_allowed(tmp_path):
    folder = TINY.save(tmp_path / "m")
    model = TINY.build()
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(UnsafeCheckpointError, match=r"only pickled weights.*arbitrary code.*allow_pickle=True"):
        TINY.neuron_class.from_pretrained(folder)
    loaded = TINY.neuron_class.from_pretrained(folder, allow_pickle=True)
    assert torch.equal(loaded.model.norm.weight.cpu(), model.model.norm.weight)
    # weights_only=True: a pickle that is not plain tensors is refused, not executed.
    torch.save({"weights": model.state_dict(), "payload": TinyPayload()}, folder / "pytorch_model.bin")
    assert_refused(folder, r"pytorch_model.bin: cannot read the pickled weights with weights_only=True",
                   allow_pickle=True)


class TinyPayload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_model_larger_than_free_device_memory_is_refused_before_loading(tmp_path):
    folder = TINY.save(tmp_path / "m")
    result = run_python(
        f"""
        import torch, optimum_neuron_torch as ont
        from optimum_neuron_torch.errors import InsufficientDeviceMemoryError
        try:
            ont.NeuronAutoModelForCausalLM.from_pretrained({str(folder)!r})
        except InsufficientDeviceMemoryError as error:
            print(error)
        print(torch.neuron.memory_allocated())
        """,
        env={"OPTIMUM_NEURON_TORCH_DEVICE_MEMORY": "50KB"},
    )
    assert result.returncode == 0, result.stderr
    message, allocated = result.stdout.strip().splitlines()
    model = TINY.build()
    needed = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert (f"needs {needed / 1024:.2f} KiB of device memory in torch.float32 "
            "but neuron:0 has 48.83 KiB free (of 48.83 KiB)" in message)
    assert "dtype=torch.bfloat16" in message
    assert allocated == "0"


def test_the_memory_check_in_process_names_needed_free_and_total():
    """The same refusal in this process (the subprocess above sets a small device): a model on the
    meta device larger than the device, and the sizes written in the largest unit they reach."""
    from optimum_neuron_torch.loading.loader import _size, check_device_memory

    sizes = [0, 1023, 1024, 1536, 2**20 - 1, 2**20, 5 * 2**30 + 2**29]
    assert [_size(n) for n in sizes] == ["0 bytes", "1023 bytes", "1.00 KiB", "1.50 KiB", "1024.00 KiB", "1.00 MiB",
                                         "5.50 GiB"]
    torch.neuron.empty_cache()  # (the check returns kept blocks before it refuses, and reports what is free then)
    free, total = optimum_neuron_torch.device.mem_get_info()
    with torch.device("meta"):
        # one float32 weight > total
        model = torch.nn.Sequential(torch.nn.Linear(total // 4 // 1024 + 1, 1024, bias=False))
    needed = model[0].weight.numel() * 4
    with pytest.raises(InsufficientDeviceMemoryError) as caught:
        check_device_memory(model, torch.device("neuron:0"), "huge-model")
    assert str(caught.value) == (
        f"huge-model needs {_size(needed)} of device memory in torch.float32 but neuron:0 has {_size(free)} free "
        f"(of {_size(total)}). Load it in a smaller dtype (dtype=torch.bfloat16), free device memory (del unused "
        "models), or use another device."
    )
    with torch.device("meta"):
        small = torch.nn.Linear(4, 4)
    check_device_memory(small, torch.device("neuron:0"), "small")  # fits: nothing raised


def test_device_bytes_count_tied_weights_once_and_every_buffer():
    from transformers import LlamaConfig, LlamaForCausalLM

    from optimum_neuron_torch.loading.loader import _device_bytes

    config = LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        model.register_buffer("persistent", torch.ones(7, dtype=torch.float64))  # in the state dict too
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expected = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])  # each tensor once
    assert _device_bytes(model) == expected
    # As on the meta model the loader builds, before Transformers ties it: two tensors, one of them tied.
    model.lm_head.weight = torch.nn.Parameter(torch.empty(96, 16, device="meta"))
    assert model.all_tied_weights_keys and _device_bytes(model) == expected
    model.all_tied_weights_keys = {}  # not tied at all: both count
    assert _device_bytes(model) == expected + 96 * 16 * 4
    model.lm_head.weight = model.model.embed_tokens.weight  # shared without being declared tied: once
    assert _device_bytes(model) == expected


def test_a_model_that_fills_free_device_memory_exactly_is_accepted():
    from optimum_neuron_torch.loading.loader import check_device_memory

    torch.neuron.empty_cache()  # (else its kept blocks would be returned for the one byte more)
    free, _ = optimum_neuron_torch.device.mem_get_info()
    with torch.device("meta"):
        model = torch.nn.Linear(1, 1, bias=False)  # 4 bytes
        model.register_buffer("rest", torch.empty(free - 4, dtype=torch.uint8))
    check_device_memory(model, torch.device("neuron:0"), "exact")  # needed == free: it fits
    with torch.device("meta"):
        model.register_buffer("rest", torch.empty(free - 3, dtype=torch.uint8))
    with pytest.raises(InsufficientDeviceMemoryError, match=r"^one-byte-more needs "):
        check_device_memory(model, torch.device("neuron:0"), "one-byte-more")


@st.composite
def mutations(draw):
    kind = draw(st.sampled_from(["header_byte", "data_byte", "truncate", "length"]))
    return kind, draw(st.integers(min_value=0, max_value=2**31)), draw(st.integers(min_value=0, max_value=255))


@pytest.mark.slow
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # examples: the profile's (conftest)
@given(mutation=mutations())
def test_mutated_checkpoints_load_correctly_or_fail_cleanly(pristine, tmp_path_factory, mutation):
    """Any mutation of a small checkpoint: a clean CheckpointError, or a model equal to what the
    (mutated) file says; never a crash, never leaked device memory."""
    from safetensors.torch import load_file

    kind, position, value = mutation
    folder = shutil.copytree(pristine[0], tmp_path_factory.mktemp("fuzz") / "m")
    path = folder / "model.safetensors"
    raw = bytearray(path.read_bytes())
    header_length = struct.unpack("<Q", raw[:8])[0]
    if kind == "header_byte":
        raw[8 + position % header_length] = value
    elif kind == "data_byte":
        raw[8 + header_length + position % (len(raw) - 8 - header_length)] = value
    elif kind == "truncate":
        del raw[position % len(raw) :]
    else:
        raw[:8] = struct.pack("<Q", position)
    path.write_bytes(bytes(raw))

    # device memory of unreachable objects left by earlier tests is freed before the baseline, not during the load
    gc.collect()
    before = torch.neuron.memory_allocated()
    try:
        model = TINY.neuron_class.from_pretrained(folder, dtype=torch.float32)
    except CheckpointError as error:
        assert str(path) in str(error) or "config" in str(error)
    else:
        on_disk = load_file(path)  # the file parses, so the model must hold exactly its tensors
        state = model.state_dict()
        info = model.neuron_loading_info
        for name, tensor in on_disk.items():
            if name in state:
                torch.testing.assert_close(state[name].cpu(), tensor.float(), rtol=0, atol=0, equal_nan=True, msg=name)
            else:
                assert name in info["unexpected_keys"]
        absent = set(state) - set(on_disk)
        # lm_head.weight is tied to the embeddings: reported missing only when they are
        assert absent - {"lm_head.weight"} <= info["missing_keys"] <= absent
        del model, state
    assert torch.neuron.memory_allocated() == before


def test_a_device_of_unknown_memory_skips_the_check_and_says_so(monkeypatch, caplog):
    from optimum_neuron_torch.loading import loader

    monkeypatch.setattr(loader, "mem_get_info", lambda device: (0, 0))  # (what a backend that cannot tell answers)
    with torch.device("meta"):
        model = torch.nn.Linear(1024, 1024, bias=False)
    with caplog.at_level("INFO", logger=loader.logger.name):
        loader.check_device_memory(model, torch.device("neuron:0"), "big")  # not refused
    assert caplog.messages == ["big: the memory of neuron:0 is unknown to the backend (total_memory 0); the check "
                               "that 4.00 MiB fits is skipped"]


# SafetensorsFile itself: opening, and a rank's piece of a tensor (tensor parallelism) ------------------
ROW = mmap.PAGESIZE // 4  # float32 elements in one page


def page_aligned_file(path, tensors: dict[str, torch.Tensor]):
    """A safetensors file whose data starts on a page, each tensor's too (its byte size a whole number of
    pages, or zero), so that the pages a piece spans are known."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    write_with_header(path, header, b"".join(t.numpy().tobytes() for t in tensors.values()), align=mmap.PAGESIZE)
    return path


class RecordingMap(mmap.mmap):  # the file's mapping, noting the requests made of the kernel
    def madvise(self, *request):
        self.requests.append(request)
        return super().madvise(*request)


def test_safetensors_file_opens_or_names_why_not(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"cannot open the file: No such file or directory"):
        SafetensorsFile(tmp_path / "missing.safetensors")
    (tmp_path / "folder.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"cannot open the file: Is a directory") as caught:
        SafetensorsFile(tmp_path / "folder.safetensors")
    assert not isinstance(caught.value, CheckpointNotFoundError)  # (it exists: downloading it again is no help)


def test_a_piece_of_a_tensor_is_a_view_whose_pages_are_read_in_one_request(tmp_path):
    """`tensor(name, part)` returns the piece `part` selects, a view of the mapping, and asks the kernel
    to map in the pages it spans, exactly those, in one request (a rank reads its rows or columns, not
    the whole tensor)."""
    whole = torch.arange(64 * ROW, dtype=torch.float32).reshape(64, ROW)  # a row per page
    path = page_aligned_file(tmp_path / "model.safetensors", {"empty": torch.zeros(0, 4), "whole": whole})
    data = mmap.PAGESIZE  # (where the tensor's bytes start in the file)
    cases = [  # part; the first byte of the piece and the byte after its last, from the start of the tensor
        (lambda t: t[10:14], 10 * ROW * 4, 14 * ROW * 4),
        (lambda t: t[0:3], 0, 3 * ROW * 4),  # (from the tensor's first byte)
        (lambda t: t[60:], 60 * ROW * 4, 64 * ROW * 4),  # (to its last)
        (lambda t: t[8:, ROW // 2:], (8 * ROW + ROW // 2) * 4, 64 * ROW * 4),  # (columns: not contiguous)
        (lambda t: t[5:7, 3:5], (5 * ROW + 3) * 4, (6 * ROW + 5) * 4),
        (lambda t: t[[1, 3]], None, None),  # gathered: a copy, nothing of the mapping to ask for
    ]
    for part, first, after in cases:
        with SafetensorsFile(path) as file:
            file._map.close()
            file._map = RecordingMap(file._file.fileno(), 0, access=mmap.ACCESS_COPY)
            file._map.requests = []
            piece = file.tensor("whole", part)
            assert torch.equal(piece, part(whole))
            aligned = data + first - (data + first) % mmap.PAGESIZE if first is not None else None
            assert file._map.requests == ([] if first is None else
                                          [(MADV_POPULATE_READ, aligned, data + after - aligned)]), first
            assert torch.equal(file.tensor("empty", lambda t: t[:, 2:]), torch.zeros(0, 2))
            assert torch.equal(file.tensor("empty"), torch.zeros(0, 4)) and len(file._map.requests) <= 1
            del piece
