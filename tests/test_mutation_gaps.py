"""Fast, in-process tests that kill the mutants the other tests let survive (see
benchmarks/MUTATION.md): the safetensors validation, the compile-cache key and cache, and the
generation buckets."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import time

import pytest
import torch
from transformers import LlamaConfig, PretrainedConfig

from optimum_neuron_torch.compiler import cache as cache_module
from optimum_neuron_torch.compiler.cache import CompileCache, Entry, graph_key
from optimum_neuron_torch.errors import CheckpointError, ConfigurationError
from optimum_neuron_torch.generation.buckets import Buckets
from optimum_neuron_torch.loading.safetensors_file import (
    MAX_HEADER_BYTES,
    SafetensorsFile,
    TensorEntry,
)

CORRUPT = "the file is truncated or corrupted: download it again or re-save the checkpoint"
ALL_DTYPES = "F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U64, U32, U16, U8, BOOL"


# --- safetensors validation ---------------------------------------------------------------------


def write(path, header, data=b"", length=None):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def refused(path, message, tensor=None):
    """Opening `path` raises CheckpointError with exactly this message, naming file and tensor."""
    with pytest.raises(CheckpointError) as caught:
        SafetensorsFile(path)
    where = f"file {path}" + (f", tensor {tensor!r}" if tensor else "")
    assert str(caught.value) == f"{where}: {message}"
    assert caught.value.file == str(path) and caught.value.tensor == tensor


def test_tensors_are_read_exactly_with_their_offsets(tmp_path):
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    scalar = torch.tensor(2.5, dtype=torch.float64)
    byte = torch.tensor([7], dtype=torch.uint8)
    data = weight.numpy().tobytes() + scalar.numpy().tobytes() + byte.numpy().tobytes()
    header = {"__metadata__": {"format": "pt"}, "w": entry("F32", [2, 3], 0, 24), "s": entry("F64", [], 24, 32),
              "b": entry("U8", [1], 32, 33), "e": entry("BF16", [0, 4], 33, 33)}
    path = write(tmp_path / "m.safetensors", header, data)
    data_start = 8 + len(json.dumps(header).encode())
    with SafetensorsFile(path) as file:
        assert set(file.entries) == {"w", "s", "b", "e"}
        assert file.entries["w"] == TensorEntry("w", torch.float32, (2, 3), data_start, data_start + 24)
        assert file.entries["s"] == TensorEntry("s", torch.float64, (), data_start + 24, data_start + 32)
        assert file.entries["b"].nbytes == 1 and file.entries["e"].nbytes == 0
        file.prefetch()
        assert torch.equal(file.tensor("w"), weight)
        assert torch.equal(file.tensor("s"), scalar)
        assert torch.equal(file.tensor("b"), byte)  # one byte: read, not taken for an empty tensor
        empty = file.tensor("e")
        assert empty.shape == (0, 4) and empty.dtype == torch.bfloat16
        file.release("w")
        file.release("e")
        assert torch.equal(file.tensor("w"), weight)  # released pages are read again from the file
    assert file._map is None and file._file.closed


def test_release_drops_the_pages_of_that_tensor_only(tmp_path):
    """The mapping is private (copy-on-write): a page that `release` drops loses this process's
    changes and is read from the file again, so changed bytes show which pages were dropped."""
    page = mmap.PAGESIZE
    header = {"a": entry("U8", [2 * page], 0, 2 * page), "b": entry("U8", [2 * page], 2 * page, 4 * page),
              "z": entry("U8", [0], 10, 10)}
    with SafetensorsFile(write(tmp_path / "m.safetensors", header, bytes(4 * page))) as file:
        assert file.entries["z"].start % page  # z's (empty) range starts inside a page that holds a's bytes
        a, b = file.tensor("a"), file.tensor("b")
        a.fill_(1)
        b.fill_(2)
        file.release("z")  # no bytes: no page dropped
        assert a.eq(1).all() and b.eq(2).all()
        file.release("b")
        kept = file.entries["b"].start // page * page - file.entries["a"].start  # a's bytes before b's first page
        assert b.eq(0).all() and kept > 0 and a[:kept].eq(1).all()


def resident_file_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssFile:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_reading_a_tensor_maps_its_pages_not_the_whole_file(tmp_path):
    big = 32 << 20
    header = {"small": entry("U8", [16], 0, 16), "big": entry("U8", [big], 16, 16 + big)}
    with SafetensorsFile(write(tmp_path / "m.safetensors", header, bytes(16 + big))) as file:
        before = resident_file_bytes()
        assert file.tensor("small").sum().item() == 0
        assert resident_file_bytes() - before < big // 4  # host memory bounded by the tensor, not the file


def test_every_dtype_name_maps_to_its_torch_dtype(tmp_path):
    names = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
             "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16,
             "U8": torch.uint8, "BOOL": torch.bool}
    header, offset = {}, 0
    for name, dtype in names.items():
        header[name] = entry(name, [2], offset, offset + 2 * dtype.itemsize)
        offset += 2 * dtype.itemsize
    with SafetensorsFile(write(tmp_path / "m.safetensors", header, bytes(offset))) as file:
        assert {name: e.dtype for name, e in file.entries.items()} == names
        assert all(file.tensor(name).dtype == dtype for name, dtype in names.items())


def test_pages_of_a_tensor_are_page_aligned():
    page = mmap.PAGESIZE
    assert SafetensorsFile._pages(TensorEntry("t", torch.uint8, (10,), page + 5, page + 15)) == (page, 15)
    assert SafetensorsFile._pages(TensorEntry("t", torch.uint8, (10,), 2 * page, 2 * page + 10)) == (2 * page, 10)


def test_a_header_only_file_and_adjacent_tensors_are_accepted(tmp_path):
    with SafetensorsFile(write(tmp_path / "empty.safetensors", {})) as file:  # header fills the file exactly
        assert file.entries == {}
    header = {"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 4, 8), "z": entry("U8", [0], 2, 2)}
    with SafetensorsFile(write(tmp_path / "m.safetensors", header, bytes(range(8)))) as file:  # ends exactly at EOF
        assert file.tensor("b").tolist() == [4, 5, 6, 7]


def test_an_unopenable_file_is_named(tmp_path):
    path = tmp_path / "missing.safetensors"
    with pytest.raises(CheckpointError) as caught:
        SafetensorsFile(path)
    assert str(caught.value) == f"file {path}: cannot open the file: No such file or directory"


def test_a_file_shorter_than_the_length_prefix(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"\x01\x02\x03\x04\x05")
    refused(path, f"the file has 5 bytes, fewer than a safetensors header; {CORRUPT}")


def test_a_header_longer_than_the_file(tmp_path):
    path = write(tmp_path / "m.safetensors", {}, length=3)  # the file has 8 + 2 bytes: 8 + 3 is past its end
    refused(path, f"the header claims 3 bytes but the file has 10; {CORRUPT}")


def test_the_header_size_limit_is_safetensors_own(tmp_path):
    path = tmp_path / "m.safetensors"
    with open(path, "wb") as file:  # a sparse file whose header is exactly the limit: read, not refused by size
        file.write(struct.pack("<Q", MAX_HEADER_BYTES))
        file.truncate(8 + MAX_HEADER_BYTES)
    with pytest.raises(CheckpointError, match="the header is not valid JSON"):
        SafetensorsFile(path)
    with open(path, "r+b") as file:
        file.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        file.truncate(8 + MAX_HEADER_BYTES + 2)
    refused(path, f"the header claims {MAX_HEADER_BYTES + 1} bytes but the file has {MAX_HEADER_BYTES + 10}; "
                  f"{CORRUPT}")


def test_a_header_that_is_not_json_or_not_an_object(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(CheckpointError) as caught:
        SafetensorsFile(path)
    assert str(caught.value).startswith(f"file {path}: the header is not valid JSON (Expecting property name")
    assert str(caught.value).endswith(f"); {CORRUPT}")
    path.write_bytes(struct.pack("<Q", 2) + b"\xff\xfe")
    with pytest.raises(CheckpointError, match="the header is not valid JSON"):
        SafetensorsFile(path)
    refused(write(path, [1, 2]), f"the header is not a JSON object; {CORRUPT}")


def test_a_tensor_named_twice(tmp_path):
    path = tmp_path / "m.safetensors"
    text = (b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
            b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}')
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\x00")
    refused(path, f"the header names the tensor twice; {CORRUPT}", tensor="a")


@pytest.mark.parametrize("info, message", [
    ([1], "the header entry lacks dtype, shape or data_offsets"),
    ({"dtype": "F32", "shape": [1]}, "the header entry lacks dtype, shape or data_offsets"),
    ({"shape": [1], "data_offsets": [0, 4]}, "the header entry lacks dtype, shape or data_offsets"),
    ({"dtype": "F32", "data_offsets": [0, 4]}, "the header entry lacks dtype, shape or data_offsets"),
    (entry("F32", [-1], 0, 4), "invalid shape [-1]"),
    (entry("F32", [True], 0, 4), "invalid shape [True]"),
    (entry("F32", [1.0], 0, 4), "invalid shape [1.0]"),
    (entry("F32", 4, 0, 4), "invalid shape 4"),
    (entry("F32", [1, -2], 0, 4), "invalid shape [1, -2]"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}, "invalid data_offsets [0, 4, 8]"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "invalid data_offsets [0]"),
    ({"dtype": "F32", "shape": [1], "data_offsets": "0,4"}, "invalid data_offsets '0,4'"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [False, 4]}, "invalid data_offsets [False, 4]"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}, "invalid data_offsets [0, 4.0]"),
    (entry("F32", [2, 3], 0, 20), "data_offsets [0, 20] span 20 bytes but shape [2, 3] of F32 needs 24"),
    (entry("F32", [1], 8, 4), "data_offsets [8, 4] span -4 bytes but shape [1] of F32 needs 4"),
    (entry("U8", [0], 4, 2), "data_offsets [4, 2] span -2 bytes but shape [0] of U8 needs 0"),
    (entry("F32", [1], -4, 0), "data_offsets [-4, 0] span 4 bytes but shape [1] of F32 needs 4"),
    (entry("F32", [3], 0, 12), "the tensor's bytes end at {end}, past the end of the file ({size} bytes)"),
])
def test_bad_header_entries_name_the_tensor(tmp_path, info, message):
    header = {"t": info}
    path = write(tmp_path / "m.safetensors", header, bytes(8))
    data_start = 8 + len(json.dumps(header).encode())
    message = message.format(end=data_start + 12, size=data_start + 8)
    refused(path, f"{message}; {CORRUPT}", tensor="t")


@pytest.mark.parametrize("dtype", ["F31", 32, None, ["F32"]])
def test_an_unknown_dtype_lists_the_known_ones(tmp_path, dtype):
    path = write(tmp_path / "m.safetensors", {"t": entry(dtype, [1], 0, 4)}, bytes(4))
    refused(path, f"unknown dtype {dtype!r}; this loader reads {ALL_DTYPES}", tensor="t")


def test_overlapping_tensors_are_named(tmp_path):
    header = {"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 3, 7)}
    refused(write(tmp_path / "m.safetensors", header, bytes(8)), f"its bytes overlap those of tensor 'a'; {CORRUPT}",
            tensor="b")
    header = {"b": entry("U8", [2], 2, 4), "a": entry("U8", [8], 0, 8)}  # one inside the other
    refused(write(tmp_path / "m.safetensors", header, bytes(8)), f"its bytes overlap those of tensor 'a'; {CORRUPT}",
            tensor="b")


# --- compile cache ------------------------------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)
        self.register_buffer("scale", torch.ones(2))

    def forward(self, x):
        return self.linear(x) * self.scale


def traced(module=None):
    torch.manual_seed(0)
    return torch.fx.symbolic_trace(module if module is not None else Net())


def key(gm=None, inputs=None, environment=None, options=None):
    return graph_key(gm if gm is not None else traced(), inputs if inputs is not None else [torch.zeros(4, 3)],
                     environment if environment is not None else {"torch": "2.13", "cc": "g++"},
                     options if options is not None else {"mode": "default"})


def test_describe_names_shape_stride_dtype_device_and_grad():
    value = torch.zeros(2, 3).t()
    assert cache_module._describe(value) == "tensor((3, 2), (1, 3), torch.float32, cpu, False)"
    assert cache_module._describe(torch.ones(1, requires_grad=True)) == "tensor((1,), (1,), torch.float32, cpu, True)"
    assert cache_module._describe((1, "a")) == "(1, 'a')"


def test_the_key_is_stable_and_hashes_everything_the_code_depends_on():
    base = key()
    assert len(base) == 64 and base == key()
    assert key(environment={"cc": "g++", "torch": "2.13"}) == base  # order of the dicts does not matter
    assert (key(options={"mode": "default", "dtype": torch.float32})
            == key(options={"dtype": torch.float32, "mode": "default"}))
    others = [
        key(inputs=[torch.zeros(5, 3)]),  # shape
        key(inputs=[torch.zeros(3, 4).t()]),  # stride
        key(inputs=[torch.zeros(4, 3, dtype=torch.float16)]),  # dtype
        key(inputs=[torch.zeros(4, 3, requires_grad=True)]),
        key(inputs=[torch.zeros(4, 3), 2]),
        key(inputs=[torch.zeros(4, 3), 3]),
        key(environment={"torch": "2.14", "cc": "g++"}),
        key(options={"mode": "max-autotune"}),
        key(options={"mode": "default", "dtype": torch.float32}),
    ]
    assert len({base, *others}) == len(others) + 1


def test_the_key_hashes_the_code_the_weights_and_the_buffers():
    base = key()
    code = traced(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()))
    assert key(code) != key(traced(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh())))
    weights, buffers = traced(), traced()
    with torch.no_grad():
        weights.linear.weight[0, 0] += 1
    buffers.scale[1] = 2
    assert len({base, key(weights), key(buffers)}) == 3
    transposed = traced()
    transposed.scale = torch.arange(4.0).reshape(2, 2).t()
    swapped = traced()
    swapped.scale = torch.arange(4.0).reshape(2, 2)[[1, 0]].t()
    assert key(transposed) != key(swapped)  # a non-contiguous buffer is hashed by its values


def test_the_key_of_a_graph_with_meta_weights_depends_on_their_shapes_and_dtypes():
    with torch.device("meta"):
        small, large, half = (traced(torch.nn.Linear(3, 2)), traced(torch.nn.Linear(3, 4)),
                              traced(torch.nn.Linear(3, 2)))
    half.half()
    assert small.code == large.code and key(small) == key(small)  # only the weights' description tells them apart
    assert len({key(small), key(large), key(half)}) == 3


def test_stats_are_copied_and_reset():
    cache_module.STATS.hits, cache_module.STATS.compile_seconds = 3, 1.5
    copy = cache_module.cache_stats()
    copy.hits = 99
    assert cache_module.STATS.hits == 3 and copy is not cache_module.STATS
    cache_module.reset_cache_stats()
    assert cache_module.cache_stats() == cache_module.CacheStats(0, 0, 0.0, 0.0)


def test_an_entry_is_built_with_its_metadata_and_found_again(tmp_path):
    cache = CompileCache(tmp_path)
    key_ = "0123" + "f" * 60
    assert cache.path(key_) == tmp_path / "01" / "23" / key_
    assert cache.get(key_) is None
    before = time.time()

    def build(folder):
        (folder / "sub").mkdir()
        (folder / "sub" / "graph.bin").write_bytes(b"12345")
        return {"size": 5}

    entry, built = cache.get_or_build(key_, build)
    assert built and entry.key == key_ and entry.path == cache.path(key_)
    assert before <= entry.metadata["created"] <= time.time()
    assert entry.metadata == {"key": key_, "created": entry.metadata["created"], "size": 5,
                              "files": {"sub/graph.bin": hashlib.sha256(b"12345").hexdigest()}}
    assert (entry.path / "entry.json").read_text() == json.dumps(entry.metadata, indent=1, sort_keys=True)
    assert cache.get(key_) == entry and entry.size == 5 + len((entry.path / "entry.json").read_bytes())
    assert (tmp_path / "locks" / f"{key_}.lock").exists() and list((tmp_path / "tmp").iterdir()) == []
    assert cache.get_or_build(key_, lambda folder: pytest.fail("built twice")) == (entry, False)


def test_an_incomplete_entry_is_replaced_and_unreadable_metadata_is_a_miss(tmp_path):
    cache = CompileCache(tmp_path)
    key_ = "ab" * 32
    cache.path(key_).mkdir(parents=True)
    (cache.path(key_) / "stale.bin").write_bytes(b"x")
    assert cache.get(key_) is None
    (cache.path(key_) / "entry.json").write_text("{not json")
    assert cache.get(key_) is None
    entry, built = cache.get_or_build(key_, lambda folder: {})
    assert built and not (entry.path / "stale.bin").exists()


def test_an_entry_built_while_waiting_for_the_lock_is_not_rebuilt(tmp_path):
    class Racing(CompileCache):
        calls = 0

        def get(self, key_):
            self.calls += 1
            if self.calls == 1:  # the first look misses; another process finishes before the lock is taken
                CompileCache(self.root).get_or_build(key_, lambda folder: {"by": "other"})
                return None
            return super().get(key_)

    entry, built = Racing(tmp_path).get_or_build("cd" * 32, lambda folder: pytest.fail("built twice"))
    assert not built and entry.metadata["by"] == "other"


def test_add_list_and_clear(tmp_path):
    source = CompileCache(tmp_path / "a")
    first, _ = source.get_or_build("aa" * 32, lambda folder: (folder / "g.bin").write_bytes(b"1") and {"n": 1})
    time.sleep(0.01)
    second, _ = source.get_or_build("bb" * 32, lambda folder: {"n": 2})
    (source.root / "tmp" / "leftover").mkdir()
    assert [entry.key for entry in source.entries()] == [first.key, second.key]  # oldest first

    target = CompileCache(tmp_path / "b")
    added = target.add(first.path)
    assert added.key == first.key and added.path == target.path(first.key)
    assert (added.path / "g.bin").read_bytes() == b"1" and added.metadata["n"] == 1
    assert added.metadata["created"] > first.metadata["created"]  # added now, not when first built
    assert target.add(first.path) == added
    assert list(target.entries()) == [added]
    (first.path / "g.bin").write_bytes(b"2")  # a shipped entry whose file changed is refused, named
    with pytest.raises(cache_module.CompileCacheError) as refused:
        CompileCache(tmp_path / "c").add(first.path)
    assert str(refused.value) == (f"compiled graph {first.key} in {first.path} cannot be added to the compile cache: "
                                  "its file g.bin is not the one compiled (SHA-256 differs: truncated or modified).")
    assert list(CompileCache(tmp_path / "c").entries()) == []

    (source.root / cache_module.SLOTS_DIR).mkdir()  # (the warm starts' records go with the entries)
    assert source.clear() == 2 and list(source.entries()) == [] and not (source.root / "tmp").exists()
    assert not (source.root / cache_module.SLOTS_DIR).exists()
    assert source.clear() == 0


def test_clear_counts_an_entry_removed_meanwhile_by_another_process(tmp_path, monkeypatch):
    cache = CompileCache(tmp_path)
    monkeypatch.setattr(cache, "entries", lambda: iter([Entry("ef" * 32, tmp_path / "gone", {})]))
    assert cache.clear() == 1


def test_entry_size_counts_files_only(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"abc")
    (tmp_path / "g").write_bytes(b"de")
    assert Entry("k", tmp_path, {}).size == 5


# --- generation buckets -------------------------------------------------------------------------


def test_buckets_are_sorted_deduplicated_and_validated():
    buckets = Buckets([8, "2", 2], (32, 16), 33)
    assert buckets.batch_sizes == (2, 8) and buckets.prompt_buckets == (16, 32) and buckets.max_length == 33
    for bad in [(), (0, 1)]:
        with pytest.raises(ConfigurationError) as caught:
            Buckets(bad, (16,), 64)
        assert str(caught.value) == f"batch_sizes must hold at least one positive size, got {bad!r}."
    with pytest.raises(ConfigurationError) as caught:
        Buckets((1,), (-1, 4), 64)
    assert str(caught.value) == "prompt_buckets must hold at least one positive size, got (-1, 4)."
    assert Buckets((1,), (1,), 2).prompt_buckets == (1,)
    with pytest.raises(ConfigurationError) as caught:
        Buckets((1,), (16, 64), 64)
    assert str(caught.value) == ("the largest prompt bucket (64) must be below max_length (64), to leave room for new "
                                 "tokens.")


@pytest.mark.parametrize("context, max_length, expected", [
    (512, None, ((16, 64, 256), 512)),
    (4096, None, ((16, 64, 256, 1024), 2048)),
    (None, None, ((16, 64, 256, 1024), 2048)),
    (4096, 128, ((16, 64), 128)),
    (4096, 127, ((16,), 127)),
    (20, None, ((10,), 20)),
])
def test_default_buckets(context, max_length, expected):
    config = PretrainedConfig() if context is None else LlamaConfig(
        max_position_embeddings=context, num_hidden_layers=1, hidden_size=8, intermediate_size=8,
        num_attention_heads=1)
    buckets = Buckets.default(config, max_length)
    assert (buckets.prompt_buckets, buckets.max_length) == expected and buckets.batch_sizes == (1, 2, 4, 8)


def test_default_buckets_follow_the_decoders_text_config():
    config = PretrainedConfig()
    config.text_config = LlamaConfig(max_position_embeddings=512)
    assert Buckets.default(config).max_length == 512  # not the flat config's missing value (2048)
    config.text_encoder = LlamaConfig(max_position_embeddings=1024)
    assert Buckets.default(config).max_length == 512  # the decoder's, not the text encoder's


def test_bucket_lookup_boundaries_and_round_trip():
    buckets = Buckets((1, 4), (16, 64), 256)
    assert [buckets.batch_size_for(n) for n in (1, 2, 4, 5)] == [1, 4, 4, None]
    assert [buckets.prompt_shape_for(n) for n in (1, 16, 17, 64, 65, 128, 129)] == [
        (16, 16), (16, 16), (64, 64), (64, 64), (128, 64), (128, 64), (192, 64)]
    assert Buckets((1,), (16, 64, 256), 512).prompt_shape_for(300) == (512, 256)  # chunks of the largest bucket
    assert buckets.to_dict() == {"batch_sizes": [1, 4], "prompt_buckets": [16, 64], "max_length": 256,
                                 "context_buckets": [256]}
    assert Buckets.from_dict({"batch_sizes": [4, 1], "prompt_buckets": [64, 16], "max_length": "256"}) == buckets


# --- device memory accounting (the C++ allocator, mutated by hand: see benchmarks/MUTATION.md) ---


def test_reserved_memory_holds_the_cached_blocks_until_empty_cache():
    torch.neuron.empty_cache()
    start_allocated, start_reserved = torch.neuron.memory_allocated(), torch.neuron.memory_reserved()
    held = torch.empty(1 << 16, dtype=torch.uint8, device="neuron")
    assert torch.neuron.memory_reserved() == start_reserved + (1 << 16)
    stats = torch.neuron.memory_stats()
    assert stats["reserved_bytes.all.current"] == start_reserved + (1 << 16)
    assert stats["allocated_bytes.all.current"] == start_allocated + (1 << 16)
    del held
    assert torch.neuron.memory_allocated() == start_allocated
    assert torch.neuron.memory_reserved() == start_reserved + (1 << 16)  # cached
    torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved() == start_reserved


# --- the streaming loader -----------------------------------------------------------------------


def test_a_loaded_parameter_keeps_whether_it_requires_grad():
    from optimum_neuron_torch.loading.loader import _set_tensor

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0].bias.requires_grad_(False)  # a frozen parameter stays frozen once loaded
    _set_tensor(model, "0.weight", torch.ones(2, 2))
    _set_tensor(model, "0.bias", torch.zeros(2))
    assert isinstance(model[0].bias, torch.nn.Parameter) and model[0].bias.requires_grad is False
    assert model[0].weight.requires_grad is True and torch.equal(model[0].weight, torch.ones(2, 2))


def test_the_loading_progress_bar_counts_bytes_of_the_model():
    from optimum_neuron_torch.loading.loader import _progress

    with _progress(3 * 2**20, "org/model") as bar:
        assert (bar.total, bar.unit, bar.unit_scale, bar.unit_divisor) == (3 * 2**20, "B", True, 1024)
        assert bar.desc == "Loading org/model" and bar.leave is False


@pytest.mark.parametrize("rank, shown", [(0, True), (1, False)])
def test_one_loading_progress_bar_per_job(monkeypatch, rank, shown):
    from optimum_neuron_torch.loading import loader

    monkeypatch.setenv("TQDM_DISABLE", "0")
    monkeypatch.setattr(loader.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(loader.dist, "get_rank", lambda: rank)
    with loader._progress(10, "org/model") as bar:
        assert bar.disable is not shown  # (rank 0 shows it)
