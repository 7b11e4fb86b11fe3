"""bench reports what it promises (on a tiny fixture; speed itself is a benchmark, never a test assertion)."""
import json, pathlib


from tg_ds4.backend.cpu.replay import engine_threads
from tg_ds4.tools import bench

def test_bench_report_fields():
  path = pathlib.Path(__file__).parent / "fixtures" / "deepseek2" / "ds3" / "ds3-Q4_0.gguf"
  r = bench.run(str(path), prompt_tokens=8, gen=4, repeat=1, speculative=2, draft=str(path))
  t = r["tg_ds4"]
  assert t["prefill_tps"] > 0 and t["decode_tps"] > 0 and t["ms_per_token"] > 0
  assert t["kernels_per_step"] >= 3 * 16 and t["bytes_per_step"] > 0  # 3 blocks of >= 16 kernels each
  assert 0 < t["bandwidth_fraction"] < 1 and r["read_gbps"] > 0
  assert r["threads"] == engine_threads()  # the roofline is read with the engine's threads
  assert r["model_bytes"] == path.stat().st_size and t["peak_rss"] >= 1 << 20
  # speculation with the model drafting for itself: every draft accepted, the mechanism's ceiling against plain decode
  sp = r["speculative"]
  assert sp["k"] == 2 and sp["acceptance"] == 1.0 and sp["decode_tps"] > 0 and sp["vs_plain"] == sp["decode_tps"] / sp["plain_decode_tps"]
  text = bench.format_text(r)
  assert "kernels/step" in text and "GB/s" in text and "peak RSS" in text and "100% accepted" in text

def test_llama_cpp_build_flags_per_cpu_kind():
  """The CMake options bench names for building llama.cpp: this CPU's vector extensions, never GGML_NATIVE, AMX off
  (0.3.36's native build aborts on MoE files on AMX CPUs): an AVX2 AMD EPYC and an AVX-512 Xeon with VNNI and AMX."""
  epyc = "fpu sse sse2 avx f16c fma bmi2 avx2 sha_ni"
  xeon = epyc + " avx512f avx512dq avx512vbmi avx512_vnni avx512_bf16 avx_vnni amx_tile amx_int8 amx_bf16"
  a, x = (set(bench.llama_cpp_cmake_args(f).split()) for f in (epyc, xeon))
  assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AMX_INT8=OFF"} <= a
  assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
          "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= x

def test_bench_parallel_report_fields():
  """--parallel: aggregate and per-stream decode from steps where every stream produced a token, and time to first
  token idle and under load."""
  root = pathlib.Path(__file__).parent / "fixtures"
  r = bench.run(str(root / "deepseek2" / "ds3" / "ds3-Q4_0.gguf"), prompt_tokens=8, gen=4, repeat=1, parallel=2)
  p = r["parallel"]
  assert p["parallel"] == 2 and p["aggregate_decode_tps"] == 2 * p["per_stream_decode_tps"] > 0
  assert p["vs_one_stream"] == p["aggregate_decode_tps"] / r["tg_ds4"]["decode_tps"]
  assert p["kernels_per_step"] > r["tg_ds4"]["kernels_per_step"] and p["ttft_idle_s"] > 0 and p["ttft_loaded_s"] > 0
  assert "2 streams" in bench.format_text(r)

def test_bench_runs_deepseek4():
  """The V4 model class has its own config; bench reads the context length from it."""
  path = pathlib.Path(__file__).parent / "fixtures" / "deepseek4" / "flash" / "flash-MXFP4.gguf"
  t = bench.run(str(path), prompt_tokens=8, gen=4, repeat=1)["tg_ds4"]
  assert t["decode_tps"] > 0 and t["kernels_per_step"] >= 3 * 30

def test_read_bandwidth_is_measured_per_thread_count(tmp_path, monkeypatch):
  """The roofline uses as many reading threads as the engine's replay (one core cannot stream what two can): each count
  is measured and cached on its own, and the cache says how."""
  monkeypatch.setenv("TG_DS4_CACHE", str(tmp_path))
  one, many = bench.read_bandwidth(1), bench.read_bandwidth()
  known = json.loads((tmp_path / "read_bandwidth.json").read_text())["by_threads"]
  assert set(known) == {"1", str(engine_threads())} and one > 0 and many > 0
  assert f"on {engine_threads()} threads" in known[str(engine_threads())]["method"]
  assert bench.read_bandwidth() == many  # cached, not re-measured
