"""GGUF files parsed once per load, with gguf's own values (`backends.gguf_reads.parsed_once`)."""

from __future__ import annotations

import gguf
import numpy as np

from assistgen.backends.gguf_reads import parsed_once


def small_gguf(path) -> None:
    """A GGUF file with a vocabulary-like string array, a number array, scalars and two tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_token_list([f"tok{i}" for i in range(3000)])
    writer.add_token_scores([float(i) / 7 for i in range(3000)])
    writer.add_string("general.name", "small")
    writer.add_tensor("a.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.add_tensor("b.weight", np.ones((4, 16), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_one_reader_per_file_inside_the_block_with_ggufs_own_values(tmp_path):
    path = tmp_path / "small.gguf"
    small_gguf(path)
    theirs = gguf.GGUFReader(path)
    with parsed_once():
        ours = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is ours  # transformers' second and third reads get the first parse
    assert type(gguf.GGUFReader(path)) is type(theirs)  # the block is over: gguf's own class again
    assert ours.fields.keys() == theirs.fields.keys()
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.data, mine.types, mine.offset) == (field.data, field.types, field.offset), key
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True)), key
    assert [t.name for t in ours.tensors] == ["a.weight", "b.weight"] == [t.name for t in theirs.tensors]
    for mine, tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert np.array_equal(mine.data, tensor.data) and mine.tensor_type == tensor.tensor_type
    assert not isinstance(ours.data, np.memmap)  # indexed as a plain array (the speed-up)


def test_each_file_has_its_own_reader(tmp_path):
    small_gguf(tmp_path / "one.gguf")
    small_gguf(tmp_path / "two.gguf")
    with parsed_once():
        assert gguf.GGUFReader(tmp_path / "one.gguf") is not gguf.GGUFReader(tmp_path / "two.gguf")


def test_the_tensor_name_map_is_built_once_per_architecture_and_depth():
    with parsed_once():
        first = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30) is first
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is not first
    assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30) is not first
