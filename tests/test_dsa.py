"""DeepSeek Sparse Attention (deepseek32: DeepSeek V3.2; glm-dsa: GLM-5) against transformers and llama.cpp: the tiny
random models of tests/fixtures/dsa (make_dsa_fixtures.py), converted by llama.cpp's converter, 300-token prompts
against an indexer top-k of 32, so past the 32nd position every query attends to a strict subset (transformers with the
indexer off is O(1) away: manifest hf_dense_vs_sparse_rel). F32 files: exact mode over the prompt and the continuation,
the engine path (captured chunks, then per-token steps over the cached indexer keys) and greedy generation vs
transformers. Quantized files: with llama.cpp's activation rounding vs llama.cpp's own logits (transformers on the
dequantized weights is no reference there: the rounding flips the indexer's near-tied choices)."""
import functools, json, pathlib

import numpy as np
import pytest

from family import NEAR_TIE, dequantized_twin, file_formats, rel
from tg_ds4.runtime.runner import Runner

ROOT = pathlib.Path(__file__).parent / "fixtures" / "dsa"
NAMES = ["ds32", "glmdsa", "ds32k"]

@functools.cache
def manifest(name: str) -> dict: return json.loads((ROOT / name / "manifest.json").read_text())

@functools.cache
def run(name: str) -> dict:
  m = manifest(name)
  ids, gen = m["token_ids"], m["hf"]["greedy_ids"]
  seq, r = ids + gen[:-1], Runner.load(ROOT / name / m["ggufs"]["F32"]["file"], max_ctx=512)
  K = r.chunked(len(ids))
  assert m["index_topk"] < K < len(ids)  # chunks past the top-k, then per-token steps
  return {"prefill": r.prefill(seq, chunk=len(seq)).numpy()[0], "engine": r.engine_logits(seq, prefill_tokens=K), "K": K,
          "greedy": list(r.generate(ids, len(gen))), "cfg": r.model.cfg, "caches": [c[0] for c in r.model.cache_tensors()]}

# ds32k's F32 file (11 MB) is not committed: its K-quant file is held to its twin and to llama.cpp below
@pytest.mark.parametrize("name", ["ds32", "glmdsa"])
def test_dsa_matches_transformers(name):
  m = manifest(name)
  r, ref = run(name), np.load(ROOT / name / m["hf"]["logits"])
  print(f"\n{name} ({m['arch']}): exact mode {rel(r['prefill'], ref):.1e}, engine rows {r['K'] - 1}.. {rel(r['engine'], ref[r['K'] - 1:]):.1e} "
        f"(llama.cpp: {m['ggufs']['F32']['llama_vs_hf_prompt_rel']:.1e}; transformers without the indexer: {m['hf']['hf_dense_vs_sparse_rel']:.2f})")
  assert rel(r["prefill"], ref) <= 2e-5 and rel(r["engine"], ref[r["K"] - 1:]) <= 2e-5 and m["hf"]["hf_dense_vs_sparse_rel"] > 0.1
  assert r["greedy"] == m["hf"]["greedy_ids"] and min(m["hf"]["greedy_top2_margin"]) > 1e-2

QUANT = [(n, q) for n in NAMES for q in manifest(n)["ggufs"] if q != "F32"]

@pytest.mark.parametrize("name,q", QUANT)
def test_dsa_packed_equals_dequantized_weights(name, q):
  """Packed formats in the fused kernels vs the same model on gguf-py's float dequantization of its weights, prompt in
  one forward: the same selections, the same logits to float noise."""
  m = manifest(name)
  path, ids = ROOT / name / m["ggufs"][q]["file"], m["token_ids"]
  packed = Runner.load(path, max_ctx=512, numerics="exact").prefill(ids, chunk=len(ids)).numpy()[0]
  twin = dequantized_twin(file_formats(path, max_ctx=512)).prefill(ids, chunk=len(ids)).numpy()[0]
  print(f"\n{name} {q}: packed vs dequantized twin {rel(packed, twin):.1e}")
  assert rel(packed, twin) <= 1e-4

@pytest.mark.parametrize("name,q", QUANT)
def test_dsa_quantized_vs_llama_cpp(name, q):
  """With llama.cpp's activation rounding: top-1 equal to llama.cpp's own run on >= 95% of the prompt positions where its
  top-2 margin is clear (NEAR_TIE), and the greedy continuation llama.cpp's for as long as its margins are clear of
  what two summation orders of the same rounded math already move (our prefill vs our decode over the prompt, measured
  here): a rounded activation on the other side of an indexer near-tie swaps a selected row and moves that row's logits
  by O(0.1-1) (glm-dsa Q8_0: 1.9 of a max|logit| 4.7, where llama.cpp's greedy margins are 0.04-0.6; rows before
  position 32, which select everything, move 0.09), so logits are held to no bound here."""
  m = manifest(name)
  g, ids = m["ggufs"][q], m["token_ids"]
  r = Runner.load(ROOT / name / g["file"], max_ctx=512, numerics="llama.cpp")
  got, ll = r.prefill(ids, chunk=len(ids)).numpy()[0], np.load(ROOT / name / g["llama_logits"])
  noise = float(np.abs(got - r.engine_logits(ids, prefill_tokens=0)).max())  # the per-token step generate runs below
  top2 = np.sort(ll, -1)[..., -2:]
  clear = (top2[..., 1] - top2[..., 0]) >= NEAR_TIE
  agree = float((got.argmax(-1) == ll.argmax(-1))[clear].mean())
  n = next((i for i, mg in enumerate(g["llama_greedy_top2_margin"]) if mg < max(NEAR_TIE, noise)), m["n_gen"])
  greedy = list(r.generate(ids, m["n_gen"]))
  print(f"\n{name} {q} vs llama.cpp: max|d| / max|logit| {rel(got, ll):.2e}, top-1 agreement {agree:.1%} on {int(clear.sum())} clear "
        f"positions; our prefill vs decode {noise:.2f}; greedy {'identical' if greedy == g['llama_greedy_ids'] else 'differs'} "
        f"(first {n} steps compared)")
  assert agree >= 0.95 and greedy[:n] == g["llama_greedy_ids"][:n]

def test_dsa_config_from_the_file():
  """What the files tell: the indexer's heads, size and top-k; NEOX rotation and LayerNorm eps 1e-6 for deepseek32, NORM
  and eps 0 for glm-dsa; glm-dsa's shared layer (the middle one) has no indexer and no key cache."""
  ds, glm = run("ds32")["cfg"], run("glmdsa")["cfg"]
  assert (ds.idx_n_head, ds.idx_top_k, ds.idx_rope.name, ds.idx_norm_eps, ds.idx_full) == (16, 32, "NEOX", 1e-6, (True,) * ds.n_layer)
  assert (glm.idx_rope.name, glm.idx_norm_eps, glm.idx_full) == ("NORM", 0.0, (True, False, True))
  assert run("glmdsa")["caches"] == [f"blk.{i}.attn.cache" for i in range(3)] + ["blk.0.attn.idx_cache", "blk.2.attn.idx_cache"]

@pytest.mark.parametrize("name", ["ds32", "glmdsa"])
def test_dsa_serves_a_chat(name):
  """`serve`'s app on each arch's F32 file (its chat template: DeepSeek V3.2's, GLM's), asked through the official openai
  client: a greedy answer equal to the engine's own greedy continuation of the rendered prompt."""
  import asyncio
  import openai
  try: import httpx2 as httpx  # what the current SDKs are built on (tests/test_server.py)
  except ImportError: import httpx
  from tg_ds4.server.app import build_app, load
  from tg_ds4.server.guard import Allowed
  m = manifest(name)
  served = load(str(ROOT / name / m["ggufs"]["F32"]["file"]), max_context=512, warmup=False)
  msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers of the world"}]
  ids = served.render(msgs, None)
  want = list(served.worker.runner.generate(ids, 8))
  async def ask():
    app = build_app(served, allowed=Allowed("127.0.0.1", frozenset({"test"})))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
      oai = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)
      return await oai.chat.completions.create(model=served.model_id, messages=msgs, max_tokens=8, temperature=0)
  r = asyncio.run(ask())
  print(f"\n{name}: {served.tok.decode(ids)!r} -> {r.choices[0].message.content!r} ({r.usage.completion_tokens} tokens)")
  n = r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")  # an end-of-turn token ends the answer, not in it
  assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == served.tok.decode(want[:n]) and n > 0

  # thinking on/off, as each template writes it: V3.2's assistant turn opens <think> when thinking and writes an empty
  # <think></think> otherwise (its default: off); GLM-4.7's opens <think> unless enable_thinking is false, then </think>
  # (its default: on)
  assistant, off, default = {"ds32": ("<｜Assistant｜>", "<think></think>", False), "glmdsa": ("<|assistant|>", "</think>", True)}[name]
  text = {t: served.tok.decode(served.render(msgs, None, t)) for t in (True, False, None)}
  assert text[True].endswith(assistant + "<think>") and text[False].endswith(assistant + off) and text[None] == text[default], text
  async def prompt_tokens(**extra):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(served, allowed=Allowed("127.0.0.1", frozenset({"test"})))),
                                 base_url="http://test") as http:
      oai = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)
      try: return (await oai.chat.completions.create(model=served.model_id, messages=msgs, max_tokens=1, temperature=0, **extra)).usage.prompt_tokens
      except openai.BadRequestError as e: return e.body["message"]
  for on in (True, False):  # the OpenAI endpoint's chat_template_kwargs (llama.cpp's server and vLLM take the same)
    got = asyncio.run(prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": on}}))
    assert got == len(served.render(msgs, None, on)), (on, got)
  for bad in ("no", [1]): assert "must be one boolean" in asyncio.run(prompt_tokens(extra_body={"chat_template_kwargs": {"thinking": bad}}))
  assert "cannot be set" in asyncio.run(prompt_tokens(extra_body={"chat_template_kwargs": {"messages": []}}))
  async def anthropic_usage(body: dict) -> dict:  # Anthropic's thinking {"type": "disabled"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(served, allowed=Allowed("127.0.0.1", frozenset({"test"})))),
                                 base_url="http://test") as http:
      return (await http.post("/v1/messages", json=body)).json()["usage"]
  u = asyncio.run(anthropic_usage({"model": served.model_id, "max_tokens": 1, "system": "You are terse.", "thinking": {"type": "disabled"},
                                   "messages": [{"role": "user", "content": "Name three rivers of the world"}]}))
  assert u["input_tokens"] + u["cache_read_input_tokens"] == len(served.render(msgs, None, False)), u
