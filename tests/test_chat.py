"""Chat templates render like transformers' apply_chat_template (checked against transformers' own output where it's installed)."""
import pytest

from tg_ds4.text.chat_template import CHATML, ChatTemplateError, Template

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo <b>\"x\"</b>"}]

def test_chatml_fallback_and_generation_prompt():
  t = Template(CHATML, is_fallback=True)
  assert t.render(MSGS) == '<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHéllo <b>"x"</b><|im_end|>\n<|im_start|>assistant\n'
  assert not t.render(MSGS, add_generation_prompt=False).endswith("assistant\n")

def test_tojson_does_not_escape_html_or_unicode():
  t = Template("{{ messages[1]['content'] | tojson }}|{{ tools | tojson(indent=2) }}")
  assert t.render(MSGS, tools=[{"a": "<>"}]) == '"Héllo <b>\\"x\\"</b>"|[\n  {\n    "a": "<>"\n  }\n]'

def test_bos_eos_raise_exception_and_strftime():
  t = Template("{{ bos_token }}{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}", "<s>", "</s>")
  with pytest.raises(ChatTemplateError, match="first must be user"): t.render(MSGS)
  assert t.render(MSGS[1:]) == "<s>"
  assert len(Template("{{ strftime_now('%Y') }}").render([])) == 4

def test_broken_templates_are_reported():
  with pytest.raises(ChatTemplateError, match="does not compile"): Template("{% for %}").render(MSGS)
  with pytest.raises(ChatTemplateError, match="failed to render"): Template("{{ messages[5]['content'].x() }}").render(MSGS)

# Renderings below were produced by transformers 5.23's render_jinja_template from the same GGUF templates (recorded so
# the test needs neither transformers nor torch); the models come from the registry (downloaded on first use).
SMOLLM2 = '<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHéllo <b>"x"</b><|im_end|>\n<|im_start|>assistant\n'
QWEN_TOOLS = (
  '<|im_start|>system\n'
  'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n'
  '\n'
  '# Tools\n'
  '\n'
  'You may call one or more functions to assist with the user query.\n'
  '\n'
  'You are provided with function signatures within <tools></tools> XML tags:\n'
  '<tools>\n'
  '{"type": "function", "function": {"name": "add", "description": "Add <two> numbe'
  'rs", "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}\n'
  '</tools>\n'
  '\n'
  'For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n'
  '<tool_call>\n'
  '{"name": <function-name>, "arguments": <args-json-object>}\n'
  '</tool_call><|im_end|>\n'
  '<|im_start|>user\n'
  'What is 2+2?<|im_end|>\n'
  '<|im_start|>assistant\n'
  ''
)
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add <two> numbers",
                                          "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]

def test_real_templates_match_transformers():
  from tg_ds4.io.gguf import GGUFFile
  from tg_ds4.io.registry import resolve
  assert Template.from_gguf(GGUFFile(resolve("smollm2"))).render(MSGS) == SMOLLM2
  qwen = Template.from_gguf(GGUFFile(resolve("qwen2.5-coder-0.5b")))
  assert not qwen.is_fallback and qwen.render([{"role": "user", "content": "What is 2+2?"}], tools=TOOLS) == QWEN_TOOLS
