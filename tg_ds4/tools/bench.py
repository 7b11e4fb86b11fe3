"""`tg_ds4 bench`: prefill and decode speed, kernels and bytes per decode step, effective bandwidth against what this
machine can stream, peak resident memory against the file's size, and (with --vs-llama-cpp) llama.cpp on the same file,
thread count and tokens, in a process of its own: its memory is then its own (a repacked copy of the weights, besides the
mapped file), and a llama.cpp build that aborts on the file ends that process, not the benchmark. The two engines'
repeats alternate, so a machine whose speed drifts moves both sides of a ratio alike. Warm-up (kernel compilation, JIT
capture) is excluded; every number is a median over steps or repeats."""
from __future__ import annotations

import json, multiprocessing, os, pathlib, resource, signal, statistics, threading, time

import numpy as np
from tinygrad import Device, GlobalCounters

from tg_ds4.backend import on_cpu
from tg_ds4.backend.cache import cache_dir
from tg_ds4.backend.cpu.replay import engine_threads
from tg_ds4.io.hf_folder import Checkpoint, open_model
from tg_ds4.io.registry import resolve
from tg_ds4.models.families import config_of, mtp_unavailable
from tg_ds4.quant import activations, settings
from tg_ds4.runtime.batcher import Batcher, Request
from tg_ds4.runtime.runner import Runner, reusable_prefix
from tg_ds4.text.tokenizer import Tokenizer

TEXT = ("The ocean covers most of the planet and holds most of its water. Its currents move heat from the equator toward "
        "the poles, and the life in it, from plankton to whales, shapes the air we breathe. ")

def read_bandwidth(threads: int | None = None) -> float:
  """Streaming-read GB/s of this machine with `threads` threads (default: as many as the engine's replay uses), each
  summing its own slice of one 512 MB float32 array with numpy (which drops the GIL); best wall time of 5. One thread
  cannot stream what two cores together can, so a multi-threaded step measured against one core's read could show more
  than 100%. Measured once per thread count and cached."""
  threads = max(1, threads or engine_threads())
  path = cache_dir() / "read_bandwidth.json"
  try: known = json.loads(path.read_text()).get("by_threads", {})
  except (OSError, ValueError): known = {}
  if str(threads) in known: return known[str(threads)]["gbps"]
  a = np.ones(128 << 20, dtype=np.float32)
  parts = np.array_split(a, threads)
  def once() -> float:
    workers = [threading.Thread(target=p.sum) for p in parts]
    t0 = time.perf_counter()
    for w in workers: w.start()
    for w in workers: w.join()
    return time.perf_counter() - t0
  gbps = a.nbytes / min(once() for _ in range(5)) / 1e9
  known[str(threads)] = {"gbps": gbps, "method": f"numpy sum of 512 MB in {threads} slices on {threads} threads, best of 5"}
  path.parent.mkdir(parents=True, exist_ok=True); path.write_text(json.dumps({"by_threads": known}, indent=1))
  return gbps

def _prompt(tok: Tokenizer, n: int) -> list[int]:
  ids = tok.encode(TEXT * (1 + n // 20), add_special=True)[:n]
  if len(ids) < n: raise ValueError(f"could not build a {n}-token prompt")
  return ids

class TgSide:
  """tg_ds4's side of the benchmark: loaded and warmed up (kernels compiled, both JITs captured) at construction; `once`
  runs one repeat (a prefill of the prompt, then `gen` tokens), `result` gives the medians and one decode step's counters."""
  def __init__(self, path, prompt: list[int], gen: int, numerics: str = settings.DEFAULT_NUMERICS):
    self.prompt, self.gen, self.prefill, self.steps = prompt, gen, [], []
    self.runner = Runner.load(path, max_ctx=len(prompt) + gen + 8, numerics=numerics)
    for _ in range(2): list(self.runner.generate(prompt, 4))  # compile + capture both JITs

  def once(self) -> None:
    t, last = [], None
    for _ in self.runner.generate(self.prompt, self.gen):
      now = time.perf_counter()
      if last is not None: t.append(now - last)
      last = now
    st = self.runner.stats
    self.prefill.append(st.prefill_tps)
    # a run-ahead generation (runtime/runner.py's steps) hands its tokens over in bursts: its rate is the whole decode's
    self.steps += t if self.runner.run_ahead == 1 else [st.decode_s / max(st.generated - 1, 1)]

  def result(self) -> dict:
    # one more decode step with the counters on: what a replayed step launches and moves
    GlobalCounters.reset()
    self.runner.next_token(self.prompt[-1], len(self.prompt)).item()
    step = statistics.median(self.steps)
    return {"prefill_tps": statistics.median(self.prefill), "decode_tps": 1 / step, "ms_per_token": 1000 * step,
            "kernels_per_step": GlobalCounters.kernel_count, "bytes_per_step": GlobalCounters.global_mem,
            "gbps": GlobalCounters.global_mem / step / 1e9, "peak_rss": peak_rss(), "run_ahead": self.runner.run_ahead}

def bench_parallel(path, prompt: list[int], gen: int, repeat: int, n: int, numerics: str = settings.DEFAULT_NUMERICS) -> dict:
  """n requests at once through batch.Batcher (each its own rotation of the prompt, so no slot reuses another's
  prefix): the median wall of a step in which all n rows produced a token gives the aggregate and per-stream decode
  tok/s; then the time to first token of a short request (8 tokens, none of them in a cache), idle and while n - 1
  long generations run."""
  try: runner = Runner.load(path, max_ctx=len(prompt) + gen + 8, parallel=n, numerics=numerics)
  except ValueError as e: raise BenchError(str(e)) from None
  b = Batcher(runner)
  reqs = lambda r, g: [Request(tuple(prompt[(r * n + i) % len(prompt):] + prompt[:(r * n + i) % len(prompt)]), g) for i in range(n)]
  for r in range(2): b.run([Request(q.prompt, 2 + i) for i, q in enumerate(reqs(r, 4))])  # capture every batch size up to n
  steps = []
  for r in range(repeat):
    for q in reqs(2 + r, gen): b.submit(q)
    while b.busy:
      t0 = time.perf_counter()
      got = sum(e.step is not None for e in b.step())
      if got == n: steps.append(time.perf_counter() - t0)
  GlobalCounters.reset()
  runner.batch_step(prompt[:n], list(range(n)), [len(prompt)] * n)
  kernels, nbytes = GlobalCounters.kernel_count, GlobalCounters.global_mem
  def short() -> Request:
    # 8 tokens whose first no slot's cache starts with: a shared prefix would be reused, leaving a one-token request
    firsts = {t[0] for t in b.slot_tokens if t}
    first = next((t for t in prompt if t not in firsts), None)
    if first is None: raise BenchError(f"the {len(prompt)}-token prompt has too few distinct tokens for an uncached request")
    q = (first, *prompt[-7:])
    assert all(reusable_prefix(q, t) == 0 for t in b.slot_tokens)
    return Request(q, 2)
  def ttft(load: int) -> float:
    rids = [b.submit(q) for q in reqs(9, gen)[:load]]
    while any(b.timings.get(i) is None or b.timings[i].first is None for i in rids): b.step()
    rid = b.submit(short())
    while b.timings.get(rid) is None or b.timings[rid].first is None: b.step()
    for i in rids: b.cancel(i)
    while b.busy: b.step()
    return b.timings[rid].first - b.timings[rid].submitted
  idle, loaded = statistics.median(ttft(0) for _ in range(3)), statistics.median(ttft(n - 1) for _ in range(3))
  step = statistics.median(steps)
  return {"parallel": n, "aggregate_decode_tps": n / step, "per_stream_decode_tps": 1 / step, "ms_per_step": 1000 * step,
          "kernels_per_step": kernels, "bytes_per_step": nbytes, "ttft_idle_s": idle, "ttft_loaded_s": loaded}

class SpeculativeSide:
  """TgSide's runner decoding with speculation (runtime/speculative.py): `draft` proposes k tokens per verify step. The
  rate is tokens over the whole decode (steps are uneven: each round emits 1..k+1 tokens), set against plain decode's
  over the same tokens; the acceptance is the share of drafts kept."""
  def __init__(self, tg: TgSide, draft, k: int, numerics: str, gf=None):
    """`draft`: the draft model's file, or a file holding only a multi-token-prediction block for `gf`; None: `gf`'s
    own block. A block drafts in a runner of its own (its steps also fill the block's cache), so that plain decode
    stays the runner a plain `generate` loads."""
    from tg_ds4.runtime.speculative import DraftModel, MTPDraft, mtp_source
    self.tg, self.k, self.rates, self.acceptance = tg, k, [], []
    if mtp := mtp_source(draft):
      self.runner = Runner.load(gf, max_ctx=tg.runner.model.max_ctx, numerics=numerics, mtp=mtp)
      self.drafter = MTPDraft(self.runner)
    else: self.runner, self.drafter = tg.runner, DraftModel(Runner.load(draft, max_ctx=tg.runner.model.max_ctx, numerics=numerics))
    for _ in range(2): self._run(8)  # compile + capture the draft's steps and the verify step

  def _run(self, n: int):
    from tg_ds4.runtime.speculative import speculate
    for _ in speculate(self.runner, self.drafter, self.tg.prompt, n, self.k): pass
    return self.runner.stats

  def once(self) -> None:
    st = self._run(self.tg.gen)
    self.rates.append(st.decode_tps); self.acceptance.append(st.acceptance)

  def result(self) -> dict:
    plain = len(self.tg.steps) / sum(self.tg.steps)
    rate = statistics.median(self.rates)
    return {"k": self.k, "decode_tps": rate, "plain_decode_tps": plain, "vs_plain": rate / plain,
            "acceptance": statistics.median(self.acceptance)}

class LlamaSide:
  """llama.cpp's side, as TgSide's: the same prompt tokens, threads and context; the first repeat is its warm-up."""
  def __init__(self, path, prompt: list[int], gen: int, threads: int):
    from llama_cpp import Llama
    self.prompt, self.gen, self.prefill, self.steps = prompt, gen, [], []
    self.llm = Llama(str(path), n_ctx=len(prompt) + gen + 8, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
    self.once(); self.prefill, self.steps = [], []

  def once(self) -> None:
    llm = self.llm
    llm.reset(); t0 = time.perf_counter(); llm.eval(self.prompt); t1 = time.perf_counter()
    for _ in range(self.gen - 1):  # the last logits from the context: llm.scores holds none without logits_all
      s = time.perf_counter(); llm.eval([int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))])
      self.steps.append(time.perf_counter() - s)
    self.prefill.append(len(self.prompt) / (t1 - t0))

  def result(self) -> dict:
    step = statistics.median(self.steps)
    return {"prefill_tps": statistics.median(self.prefill), "decode_tps": 1 / step, "ms_per_token": 1000 * step}

def bench_llama_cpp_parallel(path, prompt: list[int], gen: int, repeat: int, threads: int, n: int) -> dict:
  """llama.cpp's own batched decode, for bench_parallel's side: n sequences (the same prompt rotations), each prefilled
  in one llama_decode, then one llama_decode a step holding each sequence's next (greedy) token; the median step after a
  warm-up run."""
  import llama_cpp
  from llama_cpp import Llama, _internals
  ctx_len = len(prompt) + gen + 8
  llm = Llama(str(path), n_ctx=ctx_len, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
  params = llm.context_params
  params.n_seq_max, params.n_ctx, params.kv_unified = n, n * ctx_len, False  # a cache of ctx_len rows per sequence
  ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
  batch, vocab = llama_cpp.llama_batch_init(max(len(prompt), n), 0, 1), llm.n_vocab()
  def decode(items: list[tuple[int, int, int]], every: bool) -> list[int]:
    """(token, position, sequence) items -> the greedy next token of every item (`every`) or of the last"""
    batch.n_tokens = len(items)
    for j, (t, p, q) in enumerate(items):
      batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = t, p, 1, every or j == len(items) - 1
      batch.seq_id[j][0] = q
    if llama_cpp.llama_decode(ctx.ctx, batch) != 0: raise RuntimeError("llama_decode failed")
    rows = range(len(items)) if every else (len(items) - 1,)
    return [int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx.ctx, j), shape=(vocab,)))) for j in rows]
  steps = []
  try:
    for r in range(repeat + 1):
      llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx.ctx), True)
      rots = [prompt[(r * n + i) % len(prompt):] + prompt[:(r * n + i) % len(prompt)] for i in range(n)]
      toks = [decode([(t, p, i) for p, t in enumerate(q)], False)[0] for i, q in enumerate(rots)]
      for g in range(gen - 1):
        t0 = time.perf_counter(); toks = decode([(toks[i], len(prompt) + g, i) for i in range(n)], True)
        if r: steps.append(time.perf_counter() - t0)  # run 0 is warm-up
  finally:
    llama_cpp.llama_batch_free(batch); ctx.close(); llm.close()
  step = statistics.median(steps)
  return {"parallel": n, "aggregate_decode_tps": n / step, "ms_per_step": 1000 * step}

def peak_rss() -> int:
  """This process's peak resident set in bytes, the pages of mapped files it touched included: Linux's VmHWM, which
  starts anew at exec (getrusage's maximum carries the RSS a spawned child had when forked from its parent)."""
  try: return next(int(ln.split()[1]) for ln in pathlib.Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmHWM:")) * 1024
  except (OSError, StopIteration): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux

def model_bytes(path) -> int:
  """The size of a model on disk: a GGUF file, or a checkpoint folder's weight files."""
  p = pathlib.Path(path)
  return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.iterdir() if f.suffix in (".safetensors", ".gguf"))

# llama.cpp's CMake options for an x86 CPU's flags (/proc/cpuinfo names), never GGML_NATIVE: llama-cpp-python 0.3.36
# built natively on a CPU with AMX aborts on MoE files (GGML_ASSERT(*cur_backend_id != -1), from its AMX buffer type)
_GGML_X86 = (("avx", "AVX"), ("avx2", "AVX2"), ("fma", "FMA"), ("f16c", "F16C"), ("bmi2", "BMI2"), ("avx512f", "AVX512"),
             ("avx512vbmi", "AVX512_VBMI"), ("avx512_vnni", "AVX512_VNNI"), ("avx512_bf16", "AVX512_BF16"), ("avx_vnni", "AVX_VNNI"))

def llama_cpp_cmake_args(cpu_flags: str) -> str:
  """CMAKE_ARGS that build llama-cpp-python for this x86 CPU with its vector extensions and without AMX."""
  flags = set(cpu_flags.split())
  on = [f"-DGGML_{name}={'ON' if flag in flags else 'OFF'}" for flag, name in _GGML_X86]
  return " ".join(["-DGGML_NATIVE=OFF", *on, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])

def _llama_cpp_child(conn, path: str, prompt: list[int], gen: int, threads: int, parallel: int, repeat: int) -> None:
  """LlamaSide in a process of its own: "ready" once warmed up, a repeat per "once", then on "end" its medians (and the
  batched side), the build and the peak RSS."""
  import llama_cpp
  side = LlamaSide(path, prompt, gen, threads)
  conn.send("ready")
  try:
    while conn.recv() == "once": side.once(); conn.send("done")
  except EOFError: return  # the benchmark stopped (an error on its side)
  res = side.result()
  if parallel > 1: res["parallel"] = bench_llama_cpp_parallel(path, prompt, gen, repeat, threads, parallel)
  info = llama_cpp.llama_print_system_info().decode()
  features = [f.split("=")[0].split(":")[-1].strip() for f in info.split("|") if f.strip().endswith("= 1")]  # "CPU : AVX = 1 | ..."
  res["build"], res["peak_rss"] = {"version": llama_cpp.__version__, "features": features}, peak_rss()
  conn.send(res)

class LlamaProcess:
  """llama.cpp's side in a child process (see the module's docstring), driven a repeat at a time so that its repeats
  alternate with tg_ds4's: a machine whose speed drifts during the run then moves both sides alike."""
  def __init__(self, path, prompt: list[int], gen: int, threads: int, parallel: int, repeat: int):
    self.path, mp = path, multiprocessing.get_context("spawn")
    self.conn, theirs = mp.Pipe()
    self.child = mp.Process(target=_llama_cpp_child, args=(theirs, str(path), prompt, gen, threads, parallel, repeat))
    self.child.start(); theirs.close()
    self._recv()

  def _recv(self):
    try: return self.conn.recv()
    except EOFError: pass
    self.child.join()
    code = self.child.exitcode or 0
    why = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    hint = (f"; a llama-cpp-python built with AMX aborts on MoE files: rebuild it with CMAKE_ARGS=\"{llama_cpp_cmake_args(cpu_flags())}\""
            if code == -signal.SIGABRT else "")
    raise BenchError(f"{self.path}: llama.cpp {why}{hint}")

  def once(self) -> None: self.conn.send("once"); self._recv()

  def result(self) -> dict:
    self.conn.send("end")
    res = self._recv()
    self.child.join()
    return res

def cpu_flags() -> str:
  try: return next((ln.split(":", 1)[1] for ln in pathlib.Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
  except OSError: return ""

NUMERICS_TEXT = {"auto": ("llama.cpp's 8-bit inputs and integer dots for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K/Q4_K/Q6_K/IQ2_XXS weights, "
                          "exact float elsewhere"),
                 "exact": "exact float matmuls", "llama.cpp": "llama.cpp's 8-bit matmul inputs"}

class BenchError(ValueError):
  """Settings that cannot run on this model (reported as a usage error)."""

def run(model: str, prompt_tokens: int = 128, gen: int = 64, repeat: int = 3, vs_llama_cpp: bool = False, quantize: str | None = None,
        parallel: int = 1, numerics: str = settings.DEFAULT_NUMERICS, speculative: int = 0, draft: str | None = None) -> dict:
  path = resolve(model)
  gf = open_model(path, quantize)
  if vs_llama_cpp and isinstance(gf, Checkpoint): raise BenchError(f"{path}: --vs-llama-cpp runs llama.cpp on a GGUF file, not a checkpoint folder")
  ctx = config_of(gf).ctx_len
  if prompt_tokens + gen + 8 > ctx:
    raise BenchError(f"{path}: {prompt_tokens} prompt + {gen} generated tokens do not fit its context of {ctx} (lower --prompt-tokens/--gen)")
  tok = Tokenizer.from_gguf(gf)
  prompt = _prompt(tok, prompt_tokens)
  res = {"model": model, "file": str(path), "prompt_tokens": prompt_tokens, "gen": gen, "repeat": repeat,
         "threads": engine_threads(), "beam": int(os.environ.get("JITBEAM", 0)), "numerics": activations.effective(numerics, Device.DEFAULT)}
  # the batched run first: a model without slots fails at once
  if parallel > 1: res["parallel"] = bench_parallel(gf, prompt, gen, repeat, parallel, numerics)
  dgf = None
  if speculative and draft is not None:
    from tg_ds4.runtime.speculative import draft_unusable
    dgf = open_model(resolve(draft), quantize)
    if (why := draft_unusable(gf, dgf)) is not None: raise BenchError(f"{draft} cannot draft for {model}: {why}")
  elif speculative and (why := mtp_unavailable(gf)) is not None: raise BenchError(f"{model} has nothing to draft with ({why}): pass a draft")
  tg = TgSide(gf, prompt, gen, numerics)
  spec = SpeculativeSide(tg, dgf, speculative, numerics, gf) if speculative else None
  ll = LlamaProcess(path, prompt, gen, res["threads"], parallel, repeat) if vs_llama_cpp else None  # the same threads
  for _ in range(repeat):
    tg.once()
    if spec is not None: spec.once()
    if ll is not None: ll.once()
  res["tg_ds4"], res["model_bytes"] = tg.result(), model_bytes(path)
  if spec is not None: res["speculative"] = spec.result() | {"draft": draft or "its multi-token-prediction block"}
  res["device"] = Device.DEFAULT
  if parallel > 1: res["parallel"]["vs_one_stream"] = res["parallel"]["aggregate_decode_tps"] / res["tg_ds4"]["decode_tps"]
  if on_cpu(None):  # the host's streaming read is the CPU's roofline; a GPU's memory is another
    res["read_gbps"] = read_bandwidth(res["threads"])
    res["tg_ds4"]["bandwidth_fraction"] = res["tg_ds4"]["gbps"] / res["read_gbps"]
  if vs_llama_cpp:
    res["llama_cpp"] = ll.result()
    res["ratio"] = {k: res["tg_ds4"][k] / res["llama_cpp"][k] for k in ("prefill_tps", "decode_tps")}
    # llama.cpp reads the same weights per token; its GB/s is estimated from tg_ds4's measured bytes per step
    res["llama_cpp"]["gbps_est"] = res["tg_ds4"]["bytes_per_step"] * res["llama_cpp"]["decode_tps"] / 1e9
    if parallel > 1:
      lp = res["llama_cpp"]["parallel"]
      lp["vs_one_stream"] = lp["aggregate_decode_tps"] / res["llama_cpp"]["decode_tps"]
  return res

def format_text(r: dict) -> str:
  t = r["tg_ds4"]
  lines = [f"{r['model']}: {r['prompt_tokens']}-token prompt, {r['gen']} generated, medians over {r['repeat']} runs"
           + (f", kernels tuned with BEAM={r['beam']}" if r.get("beam") else ", heuristic kernels")
           + ", " + NUMERICS_TEXT[r.get("numerics", "exact")],
           f"  tg_ds4     prefill {t['prefill_tps']:8.1f} tok/s   decode {t['decode_tps']:7.2f} tok/s ({t['ms_per_token']:.1f} ms/token)",
           f"             {t['kernels_per_step']} kernels/step, {t['bytes_per_step'] / 1e6:.1f} MB/step, {t['gbps']:.2f} GB/s "
           + (f"= {100 * t['bandwidth_fraction']:.1f}% of this machine's {r['read_gbps']:.1f} GB/s streaming read on {r['threads']} threads"
              if "read_gbps" in r else f"on {r.get('device', '?')} (launches counted as tinygrad replays them: a GPU graph is one)"),
           f"             peak RSS {t['peak_rss'] / 1e9:.2f} GB = {t['peak_rss'] / r['model_bytes']:.2f}x the {r['model_bytes'] / 1e9:.2f} GB "
           "model (its mapped pages that were touched included" + (", and the draft model's" if "speculative" in r else "") + ")"]
  if "parallel" in r:
    p = r["parallel"]
    lines += [f"  {p['parallel']} streams  decode {p['aggregate_decode_tps']:7.2f} tok/s together ({p['vs_one_stream']:.2f}x one stream), "
              f"{p['per_stream_decode_tps']:.2f} tok/s each ({p['ms_per_step']:.1f} ms/step, {p['kernels_per_step']} kernels, "
              f"{p['bytes_per_step'] / 1e6:.1f} MB/step)",
              f"             time to first token of an 8-token request: {1000 * p['ttft_idle_s']:.0f} ms idle, "
              f"{1000 * p['ttft_loaded_s']:.0f} ms beside {p['parallel'] - 1} generations ({p['ttft_loaded_s'] / p['ttft_idle_s']:.2f}x)"]
  if "speculative" in r:
    sp = r["speculative"]
    lines += [f"  speculative decode {sp['decode_tps']:7.2f} tok/s with {sp['draft']} drafting {sp['k']} tokens a step, "
              f"{100 * sp['acceptance']:.0f}% accepted: {sp['vs_plain']:.2f}x plain decode's {sp['plain_decode_tps']:.2f} tok/s "
              "(whole decodes, the same tokens)"]
  if "llama_cpp" in r:
    lc = r["llama_cpp"]
    lines += [f"  llama.cpp  prefill {lc['prefill_tps']:8.1f} tok/s   decode {lc['decode_tps']:7.2f} tok/s ({lc['ms_per_token']:.1f} ms/token), "
              f"~{lc['gbps_est']:.2f} GB/s at the same bytes per token"
              + (f" ({100 * lc['gbps_est'] / r['read_gbps']:.1f}%)" if "read_gbps" in r else ""),
              f"             llama-cpp-python {lc['build']['version']} built for {' '.join(lc['build']['features'])}; peak RSS "
              f"{lc['peak_rss'] / 1e9:.2f} GB = {lc['peak_rss'] / r['model_bytes']:.2f}x the model, in its own process",
              f"  tg_ds4 / llama.cpp: prefill {r['ratio']['prefill_tps']:.3f}x, decode {r['ratio']['decode_tps']:.3f}x"]
    if "parallel" in lc:
      lp = lc["parallel"]
      lines += [f"  llama.cpp  {lp['parallel']} streams decode {lp['aggregate_decode_tps']:7.2f} tok/s together ({lp['vs_one_stream']:.2f}x its one "
                f"stream; {lp['ms_per_step']:.1f} ms/step); tg_ds4 / llama.cpp at {lp['parallel']} streams: "
                f"{r['parallel']['aggregate_decode_tps'] / lp['aggregate_decode_tps']:.3f}x"]
  return "\n".join(lines)
