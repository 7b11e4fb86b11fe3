"""bench reports what it promises (on a tiny fixture; speed itself is a benchmark, never a test assertion)."""
import json, pathlib

import pytest

from tg_ds4.backend.cpu.replay import engine_threads
from tg_ds4.tools import bench

def test_bench_report_fields():
  path = pathlib.Path(__file__).parent / "fixtures" / "deepseek2" / "ds3" / "ds3-Q4_0.gguf"
  r = bench.run(str(path), prompt_tokens=8, gen=4, repeat=1)
  t = r["tg_ds4"]
  assert t["prefill_tps"] > 0 and t["decode_tps"] > 0 and t["ms_per_token"] > 0
  assert t["kernels_per_step"] >= 3 * 16 and t["bytes_per_step"] > 0  # 3 blocks of >= 16 kernels each
  assert 0 < t["bandwidth_fraction"] < 1 and r["read_gbps"] > 0
  assert r["threads"] == engine_threads()  # the roofline is read with the engine's threads
  text = bench.format_text(r)
  assert "kernels/step" in text and "GB/s" in text

def test_bench_parallel_report_fields():
  """--parallel: aggregate and per-stream decode from steps where every stream produced a token, and time to first
  token idle and under load; deepseek4 (no batch slots) is a usage error, not a traceback."""
  root = pathlib.Path(__file__).parent / "fixtures"
  r = bench.run(str(root / "deepseek2" / "ds3" / "ds3-Q4_0.gguf"), prompt_tokens=8, gen=4, repeat=1, parallel=2)
  p = r["parallel"]
  assert p["parallel"] == 2 and p["aggregate_decode_tps"] == 2 * p["per_stream_decode_tps"] > 0
  assert p["vs_one_stream"] == p["aggregate_decode_tps"] / r["tg_ds4"]["decode_tps"]
  assert p["kernels_per_step"] > r["tg_ds4"]["kernels_per_step"] and p["ttft_idle_s"] > 0 and p["ttft_loaded_s"] > 0
  assert "2 streams" in bench.format_text(r)
  with pytest.raises(bench.BenchError, match="deepseek4 runs one sequence at a time"):
    bench.run(str(root / "deepseek4" / "flash" / "flash-MXFP4.gguf"), prompt_tokens=8, gen=4, repeat=1, parallel=2)

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
