"""DeepSeek V4 chat templates and tokenizer against independent references, recorded in tests/fixtures/deepseek4/chat_vectors.json
by tests/fixtures/make_ds4_fixtures.py:
  * renderings of both V4 templates (copies of llama.cpp's models/templates/deepseek-ai-DeepSeek-V4*.jinja in
    deepseek4/templates/) by transformers 5.23's render_jinja_template: a 2-turn chat with thinking off / on / default,
    a tool call + tool result, reasoning effort max / high;
  * llama.cpp's token ids (llama-cpp-python 0.3.36, `Llama(vocab_only=True).tokenize`) on the fixture's V4-style vocab
    (byte-level BPE, tokenizer.ggml.pre "joyai-llm", V4 special tokens) for CJK, digits, code, whitespace runs, specials.
When transformers / llama-cpp-python are installed, the same comparisons also run live against them."""
import functools
import json
from pathlib import Path

import pytest

from tg_ds4.io.gguf import GGUFFile
from tg_ds4.text.chat_template import Template, assistant_message
from tg_ds4.text.tokenizer import Tokenizer

D = Path(__file__).parent / "fixtures" / "deepseek4"
GGUF = D / "flash" / "flash-MXFP4.gguf"

@functools.cache
def vectors() -> dict: return json.loads((D / "chat_vectors.json").read_text())

def template(name: str) -> Template:
  v = vectors()
  return Template((D / "templates" / name).read_text(), v["bos_token"], v["eos_token"])

def render(name: str, case: dict) -> str:
  v = vectors()
  return template(name).render(v["chats"][case["chat"]], tools=v["tools"] if case["tools"] else None, **case["kwargs"])

CASES = [(name, c) for name in ("deepseek-ai-DeepSeek-V4.jinja", "deepseek-ai-DeepSeek-V4-Flash-0731.jinja") for c in vectors()["cases"]]

@pytest.mark.parametrize("name,case", CASES, ids=[f"{n.split('-', 3)[-1]}:{c['case']}" for n, c in CASES])
def test_renderings_match_transformers(name, case):
  assert render(name, case) == vectors()["renderings"][f"{name}:{case['case']}"]

def test_thinking_switch_and_history():
  t, chat = template("deepseek-ai-DeepSeek-V4.jinja"), vectors()["chats"]["two_turns"]
  on, off, default = t.render(chat, thinking=True), t.render(chat, thinking=False), t.render(chat)
  assert on.endswith("<｜Assistant｜><think>") and off.endswith("<｜Assistant｜></think>") and default == off
  # the earlier assistant turn drops its reasoning either way (it precedes the last user message)
  assert on.startswith("<｜begin▁of▁sentence｜>You are terse.<｜User｜>What is 2+2?<｜Assistant｜></think>4<｜end▁of▁sentence｜><｜User｜>")
  # a reply generated after `<think>` goes back into the history as reasoning_content + content
  assert assistant_message("<think>hmm</think>4") == {"role": "assistant", "content": "4", "reasoning_content": "hmm"}
  assert assistant_message("4") == {"role": "assistant", "content": "4"}
  assert not t.encode_add_special(on) and Template("x", "<s>").encode_add_special("x")

def test_live_transformers():
  pytest.importorskip("transformers")
  from transformers.utils.chat_template_utils import render_jinja_template
  v = vectors()
  for name, case in CASES:
    kw = dict(case["kwargs"])
    if "thinking" in kw: kw["enable_thinking"] = kw["thinking"]
    want, _ = render_jinja_template([v["chats"][case["chat"]]], tools=v["tools"] if case["tools"] else None, add_generation_prompt=True,
                                    chat_template=template(name).source, bos_token=v["bos_token"], eos_token=v["eos_token"], **kw)
    assert render(name, case) == want[0], (name, case["case"])

def test_gguf_carries_the_v4_template_and_pre_tokenizer():
  gf = GGUFFile(GGUF)
  assert gf.get("tokenizer.ggml.pre") == "joyai-llm"
  t = Template.from_gguf(gf)
  assert t.source == (D / "templates" / "deepseek-ai-DeepSeek-V4.jinja").read_text()
  assert (t.bos_token, t.eos_token) == ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")

@pytest.mark.parametrize("backend", ["auto", "python"])
def test_tokenizer_matches_llama_cpp(backend):
  tok = Tokenizer(GGUFFile(GGUF).metadata, backend)
  vs = vectors()["tokenizer"]
  assert len(vs) >= 60
  bad = [(v["text"], v["add_special"], tok.encode(v["text"], v["add_special"], v["parse_special"]), v["ids"]) for v in vs
         if tok.encode(v["text"], v["add_special"], v["parse_special"]) != v["ids"]]
  assert not bad, bad[:3]
  for v in vs:   # and back: decoding the ids (specials rendered) gives the text, BOS aside
    if v["add_special"]: assert tok.decode(v["ids"][1:]) == v["text"], v["text"]

def test_live_llama_cpp():
  llama_cpp = pytest.importorskip("llama_cpp")
  llm = llama_cpp.Llama(str(GGUF), vocab_only=True, verbose=False)
  tok = Tokenizer(GGUFFile(GGUF).metadata)
  for v in vectors()["tokenizer"]:
    assert tok.encode(v["text"], v["add_special"], v["parse_special"]) == llm.tokenize(v["text"].encode(), add_bos=v["add_special"],
                                                                                       special=v["parse_special"]), v["text"]
  llm.close()

def test_cli_think_flag():
  from tg_ds4.cli import build_parser
  p = build_parser()
  assert [p.parse_args(["chat", *a]).think for a in ([], ["--think"], ["--no-think"])] == [None, True, False]
