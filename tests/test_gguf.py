"""GGUF loading: metadata, packed zero-copy tensors in tinygrad order, splits, and clear errors on bad input."""
import pathlib, struct, subprocess, sys

import numpy as np
import pytest
from ggufgen import stored_values, write_tiny
from gguf import GGUFReader
from tinygrad import dtypes

from tg_ds4.io.gguf import GGUFError, GGUFFile

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
  return path, write_tiny(path)

def test_metadata(tiny):
  path, _ = tiny
  gf = GGUFFile(path)
  assert gf.arch == "deepseek2" and gf.get("general.name") == "tiny test model"
  assert gf.get("{arch}.attention.head_count") == 4 and isinstance(gf.get("{arch}.attention.head_count"), int)
  assert gf.get("{arch}.rope.freq_base") == 10000.0 and gf.get("{arch}.expert_weights_norm") is True
  assert gf.get("tokenizer.ggml.tokens") == [f"t{i}" for i in range(16)]
  assert gf.get("{arch}.attention.compress_ratios") == [0, 4, 128]
  assert gf.get("GGUF.version") == 3 and gf.get("GGUF.tensor_count") == 6

def test_tensors_match_written_values(tiny):
  path, written = tiny
  gf = GGUFFile(path)
  for name, (x, qt) in written.items():
    info = gf.infos[name]
    assert info.shape == x.shape, name  # tinygrad order == numpy order of what was written
    assert info.qtype.name == qt.name
    got = gf.tensor(name).dequant(dtypes.float32).numpy()
    np.testing.assert_array_equal(got, stored_values(x, qt), err_msg=name)

def test_tensors_are_zero_copy_views_of_the_file(tiny):
  path, written = tiny
  gf = GGUFFile(path)
  mm = gf._mmap(path)
  lo, hi = mm.ctypes.data, mm.ctypes.data + len(mm)
  for name in written:
    t = gf.tensor(name, "CPU")
    buf = t.blocks.uop.buffer
    assert buf.dtype == dtypes.uint8 and buf.options is not None and lo <= buf.options.external_ptr < hi, name
    assert buf.options.external_ptr - lo == gf.infos[name].offset
    assert t.blocks.shape == gf.infos[name].block_shape

def test_expert_rows_gather(tiny):
  path, written = tiny
  x, qt = written["blk.0.ffn_up_exps.weight"]
  gf = GGUFFile(path)
  from tinygrad import Tensor
  sel = Tensor([3, 1], dtype=dtypes.int32)
  got = gf.tensor("blk.0.ffn_up_exps.weight")[sel].dequant().numpy()
  np.testing.assert_array_equal(got, stored_values(x, qt)[[3, 1]])

def test_split_files(tmp_path):
  written = write_tiny(tmp_path / "m.gguf", split_max_tensors=2)
  parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
  assert len(parts) == 3, parts
  gf = GGUFFile(parts[0])
  assert set(gf.infos) == set(written) and gf.paths == parts
  for name, (x, qt) in written.items():
    np.testing.assert_array_equal(gf.tensor(name).dequant(dtypes.float32).numpy(), stored_values(x, qt), err_msg=name)
  with pytest.raises(GGUFError, match="open the first split"): GGUFFile(parts[1])
  parts[2].unlink()
  with pytest.raises(GGUFError, match="missing split files"): GGUFFile(parts[0])

# ---------------------------------------------------------------- bad input

def _tensor_field_pos(path: pathlib.Path, name: str) -> dict[str, int]:
  """Byte positions of a tensor-info entry's fields, found with gguf-py's own reader."""
  r = GGUFReader(path)
  t = next(t for t in r.tensors if t.name == name)
  pos, out = t.field.offset, {}
  for key, part in zip(["name_len", "name", "n_dims", "dims", "type", "offset"], t.field.parts):
    out[key] = pos; pos += part.nbytes
  return out

def _patch(src: pathlib.Path, dst: pathlib.Path, at: int, data: bytes) -> pathlib.Path:
  b = bytearray(src.read_bytes()); b[at:at+len(data)] = data; dst.write_bytes(bytes(b)); return dst

def test_missing_path(tmp_path):
  with pytest.raises(GGUFError, match="no such file") as e: GGUFFile(tmp_path / "nope.gguf")
  assert "nope.gguf" in str(e.value)

def test_wrong_magic(tiny, tmp_path):
  p = _patch(tiny[0], tmp_path / "m.gguf", 0, b"GGML")
  with pytest.raises(GGUFError, match=r"magic is b'GGML', expected b'GGUF'"): GGUFFile(p)

def test_unsupported_version(tiny, tmp_path):
  p = _patch(tiny[0], tmp_path / "v.gguf", 4, struct.pack("<I", 7))
  with pytest.raises(GGUFError, match=r"version 7 is not supported \(expected 2 or 3\)"): GGUFFile(p)

@pytest.mark.parametrize("keep", [0, 10, 23, 40, 200])
def test_truncated_header(tiny, tmp_path, keep):
  p = tmp_path / "t.gguf"; p.write_bytes(tiny[0].read_bytes()[:keep])
  with pytest.raises(GGUFError, match="truncated") as e: GGUFFile(p)
  assert str(p) in str(e.value)

def test_truncated_data(tiny, tmp_path):
  p = tmp_path / "d.gguf"; p.write_bytes(tiny[0].read_bytes()[:-100])
  with pytest.raises(GGUFError, match=r"tensor 'blk.0.bf.weight' \(BF16 32x3, 192 bytes at offset \d+\) extends past the end of the file"):
    GGUFFile(p)

def test_tensor_offset_beyond_file(tiny, tmp_path):
  pos = _tensor_field_pos(tiny[0], "blk.0.attn_q.weight")
  p = _patch(tiny[0], tmp_path / "o.gguf", pos["offset"], struct.pack("<Q", 1 << 30))
  with pytest.raises(GGUFError, match=r"tensor 'blk.0.attn_q.weight' \(Q4_0 64x32.*extends past the end of the file"): GGUFFile(p)

def test_unknown_type(tiny, tmp_path):
  pos = _tensor_field_pos(tiny[0], "output.weight")
  p = _patch(tiny[0], tmp_path / "u.gguf", pos["type"], struct.pack("<I", 99))
  with pytest.raises(GGUFError, match=r"tensor 'output.weight' has unknown or unsupported ggml type id 99 \(supported: F32=0"): GGUFFile(p)

def test_row_not_multiple_of_block(tiny, tmp_path):
  pos = _tensor_field_pos(tiny[0], "blk.0.attn_q.weight")
  p = _patch(tiny[0], tmp_path / "b.gguf", pos["dims"], struct.pack("<Q", 48))
  with pytest.raises(GGUFError, match=r"tensor 'blk.0.attn_q.weight' \(Q4_0\) has 48 elements per row, not a multiple of the block size 32"):
    GGUFFile(p)

def test_huge_array_length_does_not_hang(tiny, tmp_path):
  # the token array's length field set to 2^40: upstream GGUFReader would loop ~forever on short reads
  r = GGUFReader(tiny[0]); f = r.fields["tokenizer.ggml.tokens"]
  at = f.offset + sum(p.nbytes for p in f.parts[:4])  # key len, key, value type, array item type -> array length
  p = _patch(tiny[0], tmp_path / "h.gguf", at, struct.pack("<Q", 1 << 40))
  with pytest.raises(GGUFError, match="truncated after 'tokenizer.ggml.model'"): GGUFFile(p)

def test_cli_errors_are_one_line_exit_2(tiny, tmp_path):
  bad = _patch(tiny[0], tmp_path / "m.gguf", 0, b"XXXX")
  for args in (["inspect", str(bad)], ["inspect", str(tmp_path / "missing.gguf")], ["inspect", "no-such-model"],
               ["inspect", str(tiny[0]), "--dump", "nope", "--out", str(tmp_path / "x.npy")]):
    r = subprocess.run([sys.executable, "-m", "tg_ds4", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (args, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("tg_ds4: error: "), (args, r.stderr)

def test_cli_inspect_and_dump(tiny, tmp_path):
  path, written = tiny
  r = subprocess.run([sys.executable, "-m", "tg_ds4", "inspect", str(path)], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and "deepseek2" in r.stdout and "Q4_0" in r.stdout and "attention.head_count" in r.stdout, r.stdout
  out = tmp_path / "e.npy"
  r = subprocess.run([sys.executable, "-m", "tg_ds4", "inspect", str(path), "--dump", "blk.0.ffn_up_exps.weight", "--out", str(out)],
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  x, qt = written["blk.0.ffn_up_exps.weight"]
  got = np.load(out)
  assert got.dtype == np.float32 and got.shape == (4, 8, 32)
  np.testing.assert_array_equal(got, stored_values(x, qt))

def test_misaligned_float32_tensor_is_copied_aligned(tmp_path):
  # GGUF allows general.alignment 8; float32 kernels load 8 floats at a time from 32-byte aligned addresses
  import gguf
  from tinygrad import Tensor
  x = np.arange(1, 65, dtype=np.float32)
  for pad in (2, 4, 6):  # 8, 16, 24 bytes of padding before it: one of them leaves it off a 32-byte boundary
    path = tmp_path / f"align8_{pad}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(8)
    w.add_tensor("pad", np.zeros(pad, np.float32))
    w.add_tensor("norm.weight", x)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    gf = GGUFFile(path)
    if (gf._mmap(path).ctypes.data + gf.infos["norm.weight"].offset) % 32: break
  else: pytest.fail("no misaligned layout")
  t = gf.tensor("norm.weight", "CPU")
  buf = t.blocks.uop.buffer
  buf.ensure_allocated()
  assert buf._buf.va_addr % 32 == 0
  got = (t.dequant(dtypes.float32) * Tensor.ones(64)).contiguous()  # an 8-float-load kernel over it
  np.testing.assert_array_equal(got.numpy(), x)
