"""Tool-call parsing for the families we ship (qwen2.5/Hermes `<tool_call>` JSON, DeepSeek V3/V3.1 markup, DeepSeek DSML)
on crafted model outputs, including truncated and malformed ones (repaired, or reported with the raw text kept), and
the stream hold-back that keeps stop strings and tool-call markup out of streamed text."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from tg_ds4.server.textstream import Holdback
from tg_ds4.server.toolcalls import parse, repair_json

def calls(text):
  p = parse(text)
  return [(c.name, c.arguments, c.repaired) for c in p.calls], p.content, p.errors

def test_hermes_single_and_parallel():
  out = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
  assert calls(out) == ([("get_weather", {"city": "Paris", "days": 2}, False)], "Let me check.", [])
  two = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": [1, {"y": null}]}}\n</tool_call>'
  assert calls(two) == ([("a", {}, False), ("b", {"x": [1, {"y": None}]}, False)], "", [])

def test_glm_calls():
  """GLM's markup (GLM-4.5 .. 5): the name, then key/value pairs; strings raw, other values as JSON."""
  one = ('Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>'
         '<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>')
  assert calls(one) == ([("get_weather", {"city": "Paris", "days": 2}, False)], "Checking.", [])
  two = ('<tool_call>a</tool_call>\n<tool_call>b<arg_key>x</arg_key><arg_value>[1, {"y": null}]</arg_value>'
         '<arg_key>s</arg_key><arg_value>two words\nand a line</arg_value></tool_call>')
  assert calls(two) == ([("a", {}, False), ("b", {"x": [1, {"y": None}], "s": "two words\nand a line"}, False)], "", [])
  cut = '<tool_call>search<arg_key>query</arg_key><arg_value>tinygrad kern'
  assert calls(cut) == ([("search", {"query": "tinygrad kern"}, True)], "", [])
  bad = calls('<tool_call><arg_key>k</arg_key><arg_value>v</arg_value></tool_call>')
  assert bad[0] == [] and "no function name" in bad[2][0]

def test_hermes_string_arguments_and_parameters_key():
  assert calls('<tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>')[0] == [("f", {"q": 1}, False)]
  assert calls('<tool_call>{"name": "f", "parameters": {"q": 1}}</tool_call>')[0] == [("f", {"q": 1}, False)]

@pytest.mark.parametrize("cut", ['{"name": "f", "arguments": {"city": "Par', '{"name": "f", "arguments": {"city": "Paris",',
                                 '{"name": "f", "arguments": {"a": [1, 2', '{"name": "f", "arguments": {"city": "Paris"}}',
                                 '{"name": "f", "arguments": {"k'])
def test_hermes_truncated_is_repaired(cut):
  got, content, errors = calls("<tool_call>\n" + cut)
  assert len(got) == 1 and got[0][0] == "f" and got[0][2] and isinstance(got[0][1], dict) and not errors and content == ""

@pytest.mark.parametrize("bad", ["<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>[1, 2]</tool_call>",
                                 '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f"]</tool_call>'])
def test_malformed_is_reported_and_kept_as_text(bad):
  got, content, errors = calls("before " + bad + " after")
  assert got == [] and len(errors) == 1 and content == "before " + bad + " after"

def test_one_bad_call_does_not_lose_the_good_one():
  # (`<tool_call>oops</tool_call>` would be GLM's call of a function "oops" without arguments)
  got, content, errors = calls('<tool_call>{"name": "ok", "arguments": {}}</tool_call><tool_call>{oops</tool_call>')
  assert [g[0] for g in got] == ["ok"] and len(errors) == 1 and "oops" in content

DS_V3 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"location": "Tokyo"}\n```<｜tool▁call▁end｜>'
         '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')

def test_deepseek_v3():
  assert calls("Checking." + DS_V3) == ([("get_weather", {"location": "Tokyo"}, False), ("get_time", {}, False)], "Checking.", [])

def test_deepseek_v31_and_truncation():
  v31 = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{"q": "tinygrad"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
  assert calls(v31) == ([("search", {"q": "tinygrad"}, False)], "", [])
  assert calls(DS_V3[:DS_V3.index('"Tokyo"') + 4])[0] == [("get_weather", {"location": "Tok"}, True)]
  got, content, errors = calls("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function")  # cut before the name
  assert got == [] and len(errors) == 1

DSML = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">Hangzhou</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')

def test_deepseek_dsml():
  assert calls("Sure." + DSML) == ([("get_weather", {"location": "Hangzhou", "days": 3}, False)], "Sure.", [])
  cut = DSML[:DSML.index("Hangzhou") + 4]
  assert calls(cut)[0] == [("get_weather", {"location": "Hang"}, True)]
  assert calls('<｜DSML｜invoke name="">')[2]  # no name: reported

def test_plain_text_is_untouched():
  text = "no calls here, just <b>markup</b> and {json: 1}"
  assert calls(text) == ([], text, [])

@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list('<>{}[]",: abn\\') + ["<tool_call>", "</tool_call>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                                         "<｜DSML｜invoke name=\"f\">", '{"name": "f", "arguments": {']), max_size=30))
def test_parse_never_raises(parts):
  p = parse("".join(parts))
  assert all(isinstance(c.arguments, dict) and c.name for c in p.calls)
  json.dumps([c.arguments for c in p.calls])

def test_repair_json():
  assert repair_json('{"a": 1}') == ({"a": 1}, False)
  assert repair_json('{"a": [1, "x') == ({"a": [1, "x"]}, True)
  assert repair_json('{"a": 1,') == ({"a": 1}, True)
  with pytest.raises(ValueError): repair_json('{"a": 1]')

def test_holdback_never_leaks_a_partial_stop():
  h, out = Holdback(["</s>", "STOP"]), []
  for piece in ["ab<", "/", "s", "x", " ST", "OP rest"]:
    text, hit = h.feed(piece)
    out.append(text)
    if hit is not None: break
  assert "".join(out) == "ab</sx " and hit == "STOP rest"
  h = Holdback(["STOP"])
  assert h.feed("go S") == ("go ", None) and h.flush() == "S"  # at the end, a held-back tail that never became a stop is text

@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abST OP", max_size=40), st.lists(st.integers(1, 5), min_size=1, max_size=20))
def test_holdback_equals_cutting_the_whole_text(text, sizes):
  h, out, i, k, hit = Holdback(["STOP", "bb"]), [], 0, 0, None
  while i < len(text) and hit is None:
    n = sizes[k % len(sizes)]; k += 1
    piece, hit = h.feed(text[i:i + n]); out.append(piece); i += n
  if hit is None: out.append(h.flush())
  cuts = [j for j in (text.find("STOP"), text.find("bb")) if j >= 0]
  assert "".join(out) == (text[:min(cuts)] if cuts else text)
