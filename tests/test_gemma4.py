"""gemma4 (dense text: sliding and full layers of their own head sizes, V from the K projection on full layers, a
weightless V norm, proportional RoPE, layers attending over earlier layers' KV, per-layer embeddings, per-layer output
scales) against transformers and llama.cpp: the tiny random models of tests/fixtures/gemma4 (make_gemma4_fixtures.py),
converted by llama.cpp's converter; "ple" has every feature, "plain" none of the last three. The reference is
transformers in float64 on each file's gguf-py-dequantized weights. Exact mode over the prompt and the continuation,
the engine path (a captured 32-token chunk, then per-token steps: the shared-KV layers read caches written in the same
captured step), greedy generation, the tokenizer, and llama.cpp's own logits with its activation rounding."""
import json, pathlib

import gguf
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from family import assert_matches_transformers, llama_cpp_rounded
from tg_ds4.io.gguf import GGUFError, GGUFFile
from tg_ds4.runtime.runner import Runner
from tg_ds4.text.tokenizer import Tokenizer

ROOT = pathlib.Path(__file__).parent / "fixtures" / "gemma4"
MAN = json.loads((ROOT / "manifest.json").read_text())
IDS = MAN["token_ids"]
FILES = [(m, q) for m, spec in MAN["models"].items() for q in spec["ggufs"]]

@pytest.mark.parametrize("m,q", FILES)
def test_gemma4_matches_transformers(m, q):
  assert_matches_transformers(f"gemma4 {m} {q}", ROOT, MAN["models"][m]["ggufs"][q], IDS)

def test_gemma4_q8_0_matches_llama_cpp_rounding():
  """llama.cpp's Q8_0 run is 0.17 of max|logit| from transformers on the same weights: its activations are rounded to
  Q8_0 (and to fp16 for the F16 per-layer projections). With the same rounding the prompt logits are llama.cpp's to
  float noise on 38 of the 40 rows (measured 1e-7); on the other two a rounded activation lands on the other side of a
  rounding boundary (float32 sums in another order) and this chaotic tiny model amplifies it to 0.6% and 1.4% of
  max|logit|, still 10x closer than without the rounding. The greedy continuation is llama.cpp's own."""
  g = MAN["models"]["ple"]["ggufs"]["Q8_0"]
  (got, greedy), lcp = llama_cpp_rounded(ROOT, g, IDS, MAN["n_gen"]), np.load(ROOT / g["llama_logits"])
  rows = np.abs(got - lcp).max(-1) / np.abs(lcp).max()
  print(f"\ngemma4 ple Q8_0 with llama.cpp rounding: {int((rows <= 2e-5).sum())} of {len(rows)} rows within 2e-5 of llama.cpp, "
        f"all within {rows.max():.1e} (llama.cpp is {g['llama_vs_hf_prompt_rel']:.1e} from transformers)")
  assert (rows <= 2e-5).mean() >= 0.9 and rows.max() <= 0.02 < g["llama_vs_hf_prompt_rel"] / 5
  assert greedy == g["llama_greedy_ids"]

def test_gemma4_tokenizer_matches_transformers():
  tok = Tokenizer(GGUFFile(ROOT / MAN["models"]["ple"]["ggufs"]["F32"]["file"]))
  for case in MAN["tokenizer_cases"]:
    assert tok.encode(case["text"], add_special=True, parse_special=True) == case["ids"], case["text"]
    assert tok.decode(case["ids"][1:]) == case["text"]

def test_gemma4_config_from_the_file():
  """What the ple file tells: two head sizes, per-layer KV heads and FFN widths, which layers own a cache and whose the
  others read (llama.cpp's rule: the last full / sliding cache-owning layer), V from K on the cache-owning full layer."""
  r = Runner.load(ROOT / MAN["models"]["ple"]["ggufs"]["F32"]["file"], max_ctx=64)
  cfg = r.model.cfg
  assert (cfg.head_dim, cfg.head_dim_swa, cfg.n_kv_heads, cfg.ff_dims) == (32, 16, (2, 2, 1, 2, 2, 1), (96, 96, 96, 192, 192, 192))
  assert [cfg.kv_source(i) for i in range(6)] == [None, None, None, 1, 1, 2] and cfg.v_from_k == (False, False, True, False, False, False)
  assert [c[0] for c in r.model.cache_tensors()] == [f"blk.{i}.attn.cache" for i in range(3)]
  assert cfg.kq_scale == 1.0 and cfg.per_layer_dim == 8 and cfg.layer_output_scale

def _rewrite(dst: pathlib.Path, src: pathlib.Path, kv: dict, extra: dict[str, np.ndarray] | None = None) -> None:
  """`src` with metadata keys in `kv` replaced (as uint32) and tensors in `extra` added."""
  r = GGUFReader(src)
  w = GGUFWriter(str(dst), "gemma4")
  for name, f in r.fields.items():
    if name.startswith("GGUF.") or name == "general.architecture": continue
    if name in kv: w.add_uint32(name, kv[name]); continue
    t = f.types[0]
    if t == GGUFValueType.ARRAY: w.add_array(name, f.contents())
    elif t == GGUFValueType.STRING: w.add_string(name, f.contents())
    else: w.add_key_value(name, f.contents(), t)
  for t in r.tensors: w.add_tensor(t.name, np.asarray(t.data).reshape([int(x) for x in reversed(t.shape)]), raw_dtype=t.tensor_type)
  for name, a in (extra or {}).items(): w.add_tensor(name, a)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

def test_gemma4_unsupported_files_say_why(tmp_path):
  src = ROOT / MAN["models"]["plain"]["ggufs"]["F32"]["file"]
  _rewrite(moe := tmp_path / "moe.gguf", src, {}, {"blk.0.ffn_gate_inp.weight": np.zeros((4, 64), np.float32)})
  with pytest.raises(GGUFError, match=r"gemma4 with experts .* is not supported"): Runner.load(moe, max_ctx=64)
  # 2 shared layers of 6: layer 4 (sliding) would read layer 2, a full layer
  _rewrite(bad := tmp_path / "shared.gguf", src, {"gemma4.attention.shared_kv_layers": 2})
  with pytest.raises(GGUFError, match=r"layer 4 shares the KV of layer 2 \(gemma4.attention.shared_kv_layers = 2\)"): Runner.load(bad, max_ctx=64)
  assert gguf.GGUFReader(bad).fields["gemma4.attention.shared_kv_layers"].contents() == 2
