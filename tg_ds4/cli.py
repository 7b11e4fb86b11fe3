"""Command line: `python -m tg_ds4 <command>`. Errors in user input print one line and exit 2.

Each command imports what it runs inside its own function, so that `--help`, `models`, `cache` and `inspect` start
without loading the runner, the server's web stack, jinja2 or the tokenizers library."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from tg_ds4.io.gguf import GGUFError
from tg_ds4.quant.settings import DEFAULT_NUMERICS, NUMERICS

DEFAULT_PARALLEL = 4  # serve's cache slots: requests generated together (llama.cpp's server has --parallel too)

class UsageError(ValueError):
  """Bad command-line input: reported as one line, exit 2."""

def _open(args):
  """The -m model: a GGUF file, a checkpoint folder (with --quantize, quantized at load) or a registry name."""
  from tg_ds4.io.hf_folder import open_model
  from tg_ds4.io.registry import resolve
  return open_model(resolve(args.model), getattr(args, "quantize", None))

def cmd_inspect(args) -> int:
  from tg_ds4.tools.inspect import format_text, summarize
  gf = _open(args)
  if args.dump:
    import numpy as np
    from tinygrad import dtypes
    if not args.out: raise GGUFError("--dump needs --out FILE.npy")
    if args.dump not in gf: raise GGUFError(f"{gf.path}: no tensor named {args.dump!r} (try `inspect --json` for the list)")
    np.save(args.out, gf.tensor(args.dump).dequant(dtypes.float32).numpy())
    print(f"wrote {args.out}: {args.dump} {gf.infos[args.dump].qtype.name} {list(gf.infos[args.dump].shape)} as float32")
    return 0
  s = summarize(gf)
  if args.json:
    s["tensors"] = {n: {"type": i.qtype.name, "shape": list(i.shape), "offset": i.offset, "bytes": i.nbytes} for n, i in gf.infos.items()}
    print(json.dumps(s, indent=1, default=str))
  else: print(format_text(s))
  return 0

def cmd_logits(args) -> int:
  import numpy as np

  from tg_ds4.runtime.runner import Runner
  try: tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
  except ValueError: raise UsageError(f"--tokens must be comma-separated integers, got {args.tokens!r}") from None
  if not tokens: raise UsageError("--tokens is empty")
  if args.max_context and len(tokens) > args.max_context:
    raise UsageError(f"--tokens has {len(tokens)} tokens; --max-context {args.max_context} holds fewer")
  runner = Runner.load(_open(args), max_ctx=args.max_context or len(tokens), numerics=args.numerics)
  if bad := [t for t in tokens if not 0 <= t < runner.model.cfg.n_vocab]:
    raise UsageError(f"token ids {bad[:5]} are outside the vocabulary [0, {runner.model.cfg.n_vocab})")
  if args.prefill_tokens is not None and (args.mode != "engine" or not 0 <= args.prefill_tokens <= len(tokens)):
    raise UsageError(f"--prefill-tokens goes with --mode engine and is in [0, {len(tokens)}] (the number of --tokens)")
  if args.mode == "prefill": logits = runner.prefill(tokens, chunk=len(tokens)).numpy()[0]
  elif args.mode == "engine": logits = runner.engine_logits(tokens, args.prefill_tokens)
  else: logits = np.stack([runner.decode(t, i).numpy()[0, 0] for i, t in enumerate(tokens)])
  logits = logits.astype(np.float32)
  if args.out: np.save(args.out, logits)
  print(f"logits {list(logits.shape)} ({args.mode}) argmax {logits.argmax(-1).tolist()}" + (f" -> {args.out}" if args.out else ""))
  return 0

def cmd_probe(args) -> int:
  from tg_ds4.tools import probe
  from tg_ds4.runtime.runner import Runner
  from tg_ds4.text.tokenizer import Tokenizer
  gf = _open(args)
  tok = Tokenizer.from_gguf(gf)
  if args.tokens is not None:
    try: tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError: raise UsageError(f"--tokens must be comma-separated integers, got {args.tokens!r}") from None
  else: tokens = tok.encode(args.prompt)
  if not tokens: raise UsageError("nothing to probe: the prompt or --tokens is empty")
  runner = Runner.load(gf, max_ctx=len(tokens))
  n_layer, n_vocab = len(runner.model.blk), runner.model.cfg.n_vocab
  if bad := [t for t in tokens if not 0 <= t < n_vocab]: raise UsageError(f"token ids {bad[:5]} are outside the vocabulary [0, {n_vocab})")
  try: layers = None if args.layers is None else sorted({int(x) for x in args.layers.split(",") if x.strip()})
  except ValueError: raise UsageError(f"--layers must be comma-separated block numbers, got {args.layers!r}") from None
  if layers is not None and (not layers or not all(0 <= i < n_layer for i in layers)):
    raise UsageError(f"--layers {args.layers!r}: block numbers in [0, {n_layer})")
  piece = lambda i: tok.token_to_piece(i).decode("utf-8", "replace")
  summary = probe.write(probe.run(runner, tokens), pathlib.Path(args.out), gf.path.name, piece, layers)
  print(probe.lens_table(summary))
  moe = any("experts" in r for r in summary["layers"])
  files = "embed.npy, blk.N.{hidden,attn}.npy" + (", blk.N.{experts,expert_weights}.npy" if moe else "") + ", summary.json, probe.png"
  print(f"wrote {args.out}: {files}")
  return 0

def _load(args):
  """The -m model's file, its runner, tokenizer and (with --speculative) the drafter: the draft model's, or the file's
  own multi-token-prediction block."""
  from tg_ds4.models.families import default_context
  from tg_ds4.runtime.runner import Runner
  from tg_ds4.runtime.speculative import DraftModel, MTPDraft, mtp_source
  from tg_ds4.text.tokenizer import Tokenizer
  gf = _open(args)
  dgf = _draft_file(args, gf)
  spec = bool(getattr(args, "speculative", 0))
  mtp = spec and mtp_source(dgf)
  runner = Runner.load(gf, max_ctx=args.max_context or default_context(gf), numerics=args.numerics, mtp=mtp)
  drafter = None if not spec else MTPDraft(runner) if mtp else DraftModel(Runner.load(dgf, max_ctx=runner.model.max_ctx, numerics=args.numerics))
  return gf, runner, Tokenizer.from_gguf(gf), drafter

def _sampling(args):
  from tg_ds4.runtime.sampling import SamplingParams
  try: return SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed)
  except ValueError as e: raise UsageError(str(e)) from None

MAX_SPECULATIVE = 16  # drafts checked per step: a verify step holds k + 1 rows

def _draft_file(args, gf):
  """--speculative K's draft, opened (None without --speculative, or without --draft on a file whose own
  multi-token-prediction layers draft): a draft model, or a file holding only a multi-token-prediction block for this
  target. Checked before any model loads: a file with nothing to draft with, a draft of another vocabulary, or a block
  that does not fit, is a usage error."""
  if not getattr(args, "speculative", 0): return None
  if not 1 <= args.speculative <= MAX_SPECULATIVE: raise UsageError(f"--speculative must be in [1, {MAX_SPECULATIVE}], got {args.speculative}")
  if args.draft is None:
    from tg_ds4.models.families import mtp_unavailable
    if (why := mtp_unavailable(gf)) is None: return None
    raise UsageError(f"{args.model} has nothing to draft with ({why}): pass --draft MODEL, a smaller model of the same vocabulary")
  from tg_ds4.io.hf_folder import open_model
  from tg_ds4.io.registry import resolve
  from tg_ds4.runtime.speculative import draft_unusable
  dgf = open_model(resolve(args.draft), getattr(args, "quantize", None))
  if (why := draft_unusable(gf, dgf)) is not None: raise UsageError(f"--draft {args.draft} cannot draft for {args.model}: {why}")
  return dgf

def _stream(runner, tok, ids, args, sp, out=sys.stdout, drafter=None) -> list[int]:
  from tg_ds4.runtime.speculative import speculate
  from tg_ds4.text.tokenizer import StreamDecoder
  dec, got = StreamDecoder(tok), []
  stop = set(tok.stop_ids)
  tokens = runner.generate(ids, args.n_predict, sp, stop=stop) if drafter is None else \
    speculate(runner, drafter, ids, args.n_predict, args.speculative, sp, stop=stop)
  for t in tokens:
    got.append(t)
    if t in tok.stop_ids: break
    out.write(dec.feed(t)); out.flush()
  out.write(dec.flush()); out.flush()
  return got

def _n_predict(args) -> None:
  if args.n_predict < 1: raise UsageError(f"-n/--n-predict must be at least 1, got {args.n_predict}")

def cmd_generate(args) -> int:
  from tg_ds4.text.chat_template import Template
  if not args.prompt: raise UsageError("the prompt is empty (-p TEXT)")
  _n_predict(args)
  sp = _sampling(args)
  gf, runner, tok, drafter = _load(args)
  template = Template.from_gguf(gf) if args.chat else None
  text = template.render([{"role": "user", "content": args.prompt}]) if template else args.prompt
  ids = tok.encode(text, add_special=template.encode_add_special(text) if template else True, parse_special=args.chat)  # no double BOS
  if len(ids) >= runner.model.max_ctx: raise UsageError(f"the prompt is {len(ids)} tokens; the context holds {runner.model.max_ctx} (--max-context)")
  _stream(runner, tok, ids, args, sp, drafter=drafter)
  st = runner.stats
  spec = f", {st.accepted} of {st.drafted} drafts accepted ({100 * st.acceptance:.0f}%)" if drafter is not None else ""
  print(f"\n[prefill {st.prompt_tokens} tokens at {st.prefill_tps:.1f} tok/s, decode {st.generated} tokens at {st.decode_tps:.2f} tok/s{spec}; "
        f"a first run includes compiling the kernels]", file=sys.stderr)
  return 0

def cmd_tokenize(args) -> int:
  from tg_ds4.text.tokenizer import Tokenizer
  tok = Tokenizer.from_gguf(_open(args))
  print(json.dumps(tok.encode(args.text, add_special=not args.no_bos, parse_special=args.special)))
  return 0

def cmd_chat(args) -> int:
  from tg_ds4.text.chat_template import Template, assistant_message
  _n_predict(args)
  sp = _sampling(args)
  gf, runner, tok, drafter = _load(args)
  from tg_ds4.runtime.speculative import speculate
  template, messages, max_ctx = Template.from_gguf(gf), [], runner.model.max_ctx
  print(f"chat with {gf.get('general.name') or gf.path.name} (Ctrl-C stops a reply, Ctrl-D quits)", file=sys.stderr)
  while True:
    try: line = input("> ")
    except EOFError: print(file=sys.stderr); return 0
    except KeyboardInterrupt: print(file=sys.stderr); continue
    if not line.strip(): continue
    messages.append({"role": "user", "content": line})
    text = template.render(messages, thinking=args.think)
    ids = tok.encode(text, add_special=template.encode_add_special(text), parse_special=True)
    if len(ids) >= max_ctx:
      print(f"the conversation is {len(ids)} tokens, over the context of {max_ctx}; start a new chat", file=sys.stderr)
      return 0
    start = runner.reusable(ids)  # the cached prefix is not run again
    reply: list[int] = []
    from tg_ds4.text.tokenizer import StreamDecoder
    dec = StreamDecoder(tok)
    try:
      gen = runner.generate(ids, args.n_predict, sp, stop=set(tok.stop_ids), start_pos=start) if drafter is None else \
        speculate(runner, drafter, ids, args.n_predict, args.speculative, sp, stop=set(tok.stop_ids), start_pos=start)
      for t in gen:
        if t in tok.stop_ids: break
        reply.append(t); sys.stdout.write(dec.feed(t)); sys.stdout.flush()
      sys.stdout.write(dec.flush())
    except KeyboardInterrupt: pass
    print()
    messages.append(assistant_message(tok.decode(reply)))

def cmd_bench(args) -> int:
  from tg_ds4.tools import bench
  if args.vs_llama_cpp:
    import importlib.util  # found, not imported: llama.cpp runs in a process of its own (tools/bench.py)
    if importlib.util.find_spec("llama_cpp") is None:
      raise UsageError(f"--vs-llama-cpp needs llama-cpp-python: CMAKE_ARGS=\"{bench.llama_cpp_cmake_args(bench.cpu_flags())}\" "
                       "pip install llama-cpp-python==0.3.36")
  if args.prompt_tokens < 1 or args.gen < 2 or args.repeat < 1: raise UsageError("--prompt-tokens >= 1, --gen >= 2 and --repeat >= 1")
  if not 1 <= args.parallel <= 8: raise UsageError("--parallel must be in [1, 8]")
  _draft_file(args, _open(args))  # nothing to draft with, or a draft of another vocabulary: reported before anything loads
  try: r = bench.run(args.model, args.prompt_tokens, args.gen, args.repeat, args.vs_llama_cpp, args.quantize, args.parallel,
                    args.numerics, args.speculative, args.draft)
  except bench.BenchError as e: raise UsageError(str(e)) from None
  print(json.dumps(r, indent=1) if args.json else bench.format_text(r))
  return 0

def cmd_profile(args) -> int:
  import pathlib

  from tg_ds4.tools import profile
  from tg_ds4.tools.bench import read_bandwidth
  from tg_ds4.io.registry import resolve
  from tg_ds4.backend import on_cpu
  from tg_ds4.backend.cpu.replay import engine_threads
  from tg_ds4.runtime.runner import BATCHES, Runner
  if (args.pos is not None and args.pos < 0) or args.repeat < 1: raise UsageError("--pos >= 0 and --repeat >= 1")
  if args.parallel not in BATCHES: raise UsageError(f"--parallel: one of {', '.join(map(str, BATCHES))} (the batch sizes the engine captures)")
  if args.parallel > 1 and args.prefill: raise UsageError("--prefill profiles one sequence's chunk: not with --parallel")
  path = resolve(args.model)
  if args.checkout and not args.predict: raise UsageError("--checkout goes with --predict")
  if args.predict: return _predict(args, path)
  try: model = Runner.load(_open(args), max_ctx=(127 if args.pos is None else args.pos) + 1, parallel=args.parallel,
                            numerics=args.numerics).model
  except ValueError as e: raise UsageError(str(e)) from None
  pos = model.max_ctx - 1 if args.pos is None else args.pos
  if pos >= model.max_ctx: raise UsageError(f"--pos {pos} is past the model's context of {model.max_ctx}")
  res = {"model": args.model, "file": str(path), **profile.profile_model(model, pos, args.repeat, args.prefill, args.parallel)}
  # on the CPU kernels are timed one at a time on one core and the wall runs on the engine's threads: a roofline for
  # each. Another device's memory is not the host's: no roofline there
  if on_cpu(None): res["roofline"] = {"threads": engine_threads(), "read_gbps": read_bandwidth(), "read_gbps_one_core": read_bandwidth(1)}
  if args.out:
    for p in profile.write(res, pathlib.Path(args.out), pathlib.Path(path).stem, res.get("roofline", {}).get("read_gbps_one_core", 0.0)):
      print(f"wrote {p}", file=sys.stderr)
  print(json.dumps(res, indent=1) if args.json else profile.format_text(res))
  return 0

def _predict(args, path) -> int:
  import pathlib

  from tg_ds4.tools import gpu_cost
  if args.checkout and not (pathlib.Path(args.checkout) / "tg_ds4" / "__main__.py").is_file():
    raise UsageError(f"--checkout {args.checkout}: not a checkout of tg_ds4 (no tg_ds4/__main__.py there)")
  _open(args)  # a file that cannot be loaded says so here, in one line
  if (args.host_us is not None and args.host_us < 0) or args.run_ahead < 1: raise UsageError("--host-us must be >= 0, --run-ahead >= 1")
  try:
    rec = gpu_cost.record(str(path), args.checkout, args.prefill, args.parallel, args.pos)
    host, ahead = gpu_cost.host_us(str(path), args.checkout, args.parallel) if args.host_us is None else (args.host_us, args.run_ahead)
  except RuntimeError as e: raise UsageError(str(e)) from None
  res = {"model": args.model, "file": str(path), "checkout": args.checkout or "",
         **gpu_cost.predict(rec, gpu_cost.HARDWARE[args.predict], str(path), host, ahead)}
  if args.out:
    for p in gpu_cost.write(res, pathlib.Path(args.out), pathlib.Path(path).stem): print(f"wrote {p}", file=sys.stderr)
  print(json.dumps(res, indent=1) if args.json else gpu_cost.format_text(res))
  return 0

def cmd_serve(args) -> int:
  from tg_ds4.server.app import BindError, bind, serve
  if args.max_context and args.max_context < 2: raise UsageError("--max-context must be at least 2")
  if args.served_model_name is not None and not (args.served_model_name.strip() and args.served_model_name.isprintable()):
    raise UsageError(f"--served-model-name {args.served_model_name!r}: give a non-empty printable name")
  if min(args.max_queue, args.max_body_bytes, args.max_json_depth, args.max_connections, args.max_parsing) < 1:
    raise UsageError("--max-queue, --max-body-bytes, --max-json-depth, --max-connections, --max-parsing: >= 1")
  if not (args.head_timeout > 0 and args.body_timeout > 0): raise UsageError("--head-timeout, --body-timeout: > 0 seconds")
  from tg_ds4.runtime.runner import BATCHES
  if args.parallel is not None and not 1 <= args.parallel <= BATCHES[-1]: raise UsageError(f"--parallel must be in [1, {BATCHES[-1]}]")
  _draft_file(args, _open(args))  # a missing or unreadable model file (or draft) is reported before anything binds or loads
  args.parallel = args.parallel or DEFAULT_PARALLEL
  try: sock = bind(args.host, args.port)  # before the model loads: a bad address or a taken port is reported at once
  except BindError as e: raise UsageError(str(e)) from None
  return serve(args, sock)

def cmd_models(args) -> int:
  from tg_ds4.io.registry import registry
  for name, e in registry().items(): print(f"{name:<20} {'cached' if e.path.exists() else 'not cached':<11} {e.description}")
  return 0

def cmd_cache(args) -> int:
  import time
  from tg_ds4.runtime import stepcache
  if args.clear:
    n, size = stepcache.clear()
    print(f"removed {n} step cache entries ({size / 1e6:.1f} MB) from {stepcache.directory()}")
    return 0
  rows = stepcache.entries()
  for p, h, st in rows:
    age = time.time() - st.st_mtime
    what = f"{h['step']:<18} {h.get('device', '?'):<6} {h.get('model', '')}" if h else "(unreadable: ignored and replaced when met)"
    print(f"{p.stem[:12]}  {st.st_size / 1e6:7.2f} MB  used {age / 3600:6.1f} h ago  {what}")
  total = sum(st.st_size for _, _, st in rows)
  state = "off (TG_DS4_STEP_CACHE=0)" if not stepcache.enabled() else f"cap {stepcache.cap_bytes() / 1e6:.0f} MB"
  print(f"{len(rows)} entries, {total / 1e6:.1f} MB in {stepcache.directory()} ({state})")
  return 0

def add_quantize(s) -> None:
  from tg_ds4.io.hf_folder import QUANTIZE
  s.add_argument("--quantize", choices=QUANTIZE, help="a checkpoint folder's matrices quantized at load, one tensor at a time (default: "
                                                     "its own float types)")

def add_numerics(s) -> None:
  s.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS,
                 help="how quantized matmuls treat their inputs: auto (default) rounds them to 8 bits as llama.cpp does "
                      "where this device takes integer dot products for the weight's format "
                      "(Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K/Q4_K/Q6_K/IQ2_XXS on an AVX2 CPU: faster) and is exact float math elsewhere; "
                      "exact: float math everywhere (transformers' arithmetic on the same weights); "
                      "llama.cpp: every input rounded as llama.cpp rounds it")
  s.add_argument("--llama-cpp-rounding", dest="numerics", action="store_const", const="llama.cpp",
                 help="the same as --numerics llama.cpp")

def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="tg_ds4", description="DeepSeek-family GGUF inference on tinygrad")
  sub = p.add_subparsers(dest="command", required=True)
  s = sub.add_parser("inspect", help="summarise a GGUF file or registry model")
  s.add_argument("model", help="path to a .gguf file, a checkpoint folder or a short model name (see `models`)")
  add_quantize(s)
  s.add_argument("--json", action="store_true", help="machine-readable output, with every tensor")
  s.add_argument("--dump", metavar="TENSOR", help="write this tensor's dequantized values (float32, tinygrad order)")
  s.add_argument("--out", metavar="F.npy", help="output file for --dump")
  s.set_defaults(fn=cmd_inspect)
  s = sub.add_parser("logits", help="float32 logits [n_tokens, vocab] for a token-id sequence (the correctness probe)")
  s.add_argument("-m", "--model", required=True, help="a .gguf file, a Hugging Face checkpoint folder or a short model name")
  add_quantize(s)
  add_numerics(s)
  s.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
  s.add_argument("--mode", choices=["prefill", "decode", "engine"], default="prefill",
                 help="one forward over all tokens; one token at a time; or as generation runs: the first K tokens through its "
                      "captured prefill chunks, the rest through its per-token step (rows K-1..n-1)")
  s.add_argument("--prefill-tokens", type=int, metavar="K", help="--mode engine: K (default: what generate would prefill in chunks)")
  s.add_argument("--out", metavar="F.npy", help="write the logits here")
  s.add_argument("--max-context", type=int, default=0, help="KV cache length (default: the number of tokens)")
  s.set_defaults(fn=cmd_logits)
  def sampling_args(s):
    s.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    s.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    s.add_argument("--seed", type=int, default=None, help="same seed, same text")
    s.add_argument("--max-context", type=int, default=0, help="KV cache length (default 4096, or the model's context if smaller; "
                                                                 "past the model's: a warning)")
  s = sub.add_parser("generate", help="continue a prompt, streaming only the generated text to stdout")
  s.add_argument("-m", "--model", default="smollm2", help="a .gguf file, a Hugging Face checkpoint folder or a short model name (default smollm2)")
  add_quantize(s)
  add_numerics(s)
  add_beam(s)
  s.add_argument("-p", "--prompt", required=True, help="the prompt text")
  s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user message")
  sampling_args(s)
  add_speculative(s)
  s.set_defaults(fn=cmd_generate)
  s = sub.add_parser("chat", help="interactive multi-turn chat using the model's template")
  s.add_argument("-m", "--model", default="smollm2", help="a .gguf file, a Hugging Face checkpoint folder or a short model name (default smollm2)")
  add_quantize(s)
  add_numerics(s)
  add_beam(s)
  s.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                 help="reasoning on/off (template variables thinking / enable_thinking; default: the template's own)")
  sampling_args(s)
  add_speculative(s)
  s.set_defaults(fn=cmd_chat)
  s = sub.add_parser("probe", help="per-layer activations, MoE routing and a logit lens for a prompt, as .npy/JSON/PNG files")
  s.add_argument("-m", "--model", required=True, help="a .gguf file, a Hugging Face checkpoint folder or a short model name")
  add_quantize(s)
  g = s.add_mutually_exclusive_group(required=True)
  g.add_argument("-p", "--prompt", help="the prompt text (tokenized with the model's BOS/EOS rules)")
  g.add_argument("--tokens", help="comma-separated token ids instead of a prompt")
  s.add_argument("--layers", help="comma-separated block numbers whose arrays are written (default: all)")
  s.add_argument("--out", required=True, metavar="DIR", help="directory for the files")
  s.set_defaults(fn=cmd_probe)
  s = sub.add_parser("tokenize", help="print the token ids of TEXT as JSON")
  s.add_argument("-m", "--model", required=True, help="a .gguf file, a Hugging Face checkpoint folder or a short model name")
  add_quantize(s)
  s.add_argument("text")
  s.add_argument("--special", action="store_true", help="parse special-token texts (e.g. <|im_start|>) into their ids")
  s.add_argument("--no-bos", action="store_true", help="do not add the BOS/EOS tokens the model asks for")
  s.set_defaults(fn=cmd_tokenize)
  s = sub.add_parser("bench", help="prefill/decode tok/s, kernels and bytes per step, GB/s; optionally against llama.cpp")
  s.add_argument("-m", "--model", default="smollm2", help="a .gguf file, a Hugging Face checkpoint folder or a short model name (default smollm2)")
  add_quantize(s)
  add_numerics(s)
  add_beam(s)
  s.add_argument("--prompt-tokens", type=int, default=128)
  s.add_argument("--gen", type=int, default=64)
  s.add_argument("--repeat", type=int, default=3)
  s.add_argument("--json", action="store_true")
  s.add_argument("--vs-llama-cpp", action="store_true", help="also run llama.cpp (llama-cpp-python) on the same file and tokens")
  s.add_argument("--parallel", type=int, default=1, help="also decode N streams at once (batched steps): aggregate and per-stream tok/s, "
                 "time to first token under load")
  add_speculative(s)
  s.set_defaults(fn=cmd_bench)
  s = sub.add_parser("profile", help="time one decode step (and a prefill chunk) kernel by kernel, by block and op; CSV/JSON/PNG")
  s.add_argument("-m", "--model", default="smollm2", help="a .gguf file, a Hugging Face checkpoint folder or a short model name (default smollm2)")
  add_quantize(s)
  add_numerics(s)
  add_beam(s)
  s.add_argument("--pos", type=int, help="decode position: the step attends over pos+1 cache rows (default 127, or the context's end)")
  s.add_argument("--repeat", type=int, default=10, help="replays per kernel timing; the median is kept (default 10)")
  s.add_argument("--prefill", action="store_true", help="also profile one JIT prefill chunk")
  s.add_argument("--parallel", type=int, default=1, help="profile the batched decode step of N sequences (each its own slot and token)")
  s.add_argument("--out", help="directory for decode.{csv,json,png} (and prefill.*; predict-*.* with --predict)")
  s.add_argument("--json", action="store_true")
  s.add_argument("--predict", choices=["h200", "h100"], help="no timing: lower the steps for an NVIDIA GPU (any machine, no GPU needed) and "
                 "predict each kernel's time and the step's tok/s with the GPU cost model (tools/gpu_cost.py, docs/gpu.md)")
  s.add_argument("--checkout", help="with --predict: the steps of another checkout of this project (a git worktree), run by its own code")
  s.add_argument("--host-us", type=float, help="with --predict: the host's Python work a decode step, in us (default: timed here, the "
                 "checkout's own bench on tinygrad's NULL device)")
  s.add_argument("--run-ahead", type=int, default=1, help="with --host-us: decode steps its loop launches before it waits for them")
  s.set_defaults(fn=cmd_profile)
  s = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server (one inference worker, streaming, prefix KV reuse)")
  s.add_argument("-m", "--model", default="smollm2", help="a .gguf file, a Hugging Face checkpoint folder or a short model name (default smollm2)")
  add_quantize(s)
  add_numerics(s)
  add_beam(s)
  s.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
  s.add_argument("--port", type=int, default=8000)
  s.add_argument("--served-model-name", metavar="NAME", help="the model id /v1/models lists and responses carry (default: the short "
                                                             "model name, or the file's stem)")
  s.add_argument("--strict-model-name", action="store_true", help="answer requests naming another model with 404 (default: any "
                                                                  "model name is answered by the one model served)")
  s.add_argument("--max-context", type=int, default=0, help="KV cache length (default 4096, or the model's context if smaller; "
                                                               "past the model's: a warning)")
  s.add_argument("--parallel", type=int, default=None, metavar="N",
                 help=f"requests generated at once, each in its own cache slot (default {DEFAULT_PARALLEL}); more wait in the queue")
  s.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before new ones get 429 (default 64)")
  add_speculative(s, "greedy requests without logprobs, while they run alone")
  s.add_argument("--kv-cache-dir", metavar="DIR", help="persist prompt KV caches here and reuse them across restarts")
  s.add_argument("--kv-cache-size", default="2G", help="size cap of --kv-cache-dir, least recently used files evicted (default 2G)")
  s.add_argument("--kv-cache-min-tokens", type=int, default=256, help="save the KV state of prompts of at least this many tokens (default 256)")
  s.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413 (default 8 MiB)")
  s.add_argument("--max-json-depth", type=int, default=64, help="deeper-nested JSON bodies get 400 (default 64)")
  s.add_argument("--max-parsing", type=int, default=2, help="request bodies parsed at once, others wait: bounds parsing memory (default 2)")
  s.add_argument("--head-timeout", type=float, default=10.0, help="seconds a connection may take to send a request's headers (default 10)")
  s.add_argument("--body-timeout", type=float, default=30.0, help="seconds a request may take to send its body, else 408 (default 30)")
  s.add_argument("--max-connections", type=int, default=256, help="open connections; at the cap the longest idle one is closed (default 256)")
  s.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                 help="also accept requests whose Host is NAME (repeatable; '*' any). Default: the bound address and loopback names")
  s.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                 help="accept browser requests from ORIGIN, e.g. http://localhost:3000, with CORS (repeatable; '*' any). Default: none")
  s.set_defaults(fn=cmd_serve)
  s = sub.add_parser("models", help="list the short model names")
  s.set_defaults(fn=cmd_models)
  s = sub.add_parser("cache", help="list the persisted captured steps (what a warm start loads instead of lowering), or --clear them")
  s.add_argument("--clear", action="store_true", help="delete every entry")
  s.set_defaults(fn=cmd_cache)
  return p

def add_speculative(s: argparse.ArgumentParser, which: str = "") -> None:
  s.add_argument("--speculative", type=int, default=0, metavar="K",
                 help="speculative decoding" + (f" ({which})" if which else "") + ": the draft proposes K tokens, the model checks "
                      "them in one step (greedy: the same tokens as without it; sampled: the same distribution)")
  s.add_argument("--draft", metavar="MODEL", help="--speculative's draft: a smaller model of the same vocabulary (a file, folder or name); "
                                                  "without it, the file's own multi-token-prediction layers draft")

def add_beam(s: argparse.ArgumentParser) -> None:
  s.add_argument("--beam", type=int, default=0, metavar="N",
                 help="tune the captured kernels with tinygrad's BEAM search of width N (JITBEAM). The first run of a model "
                      "and context searches for minutes; tinygrad caches the results (~/.cache/tinygrad), later runs start at once")

def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  if getattr(args, "beam", 0):  # read by tinygrad when a TinyJit captures, so it must be set before the first step
    os.environ["JITBEAM"] = str(args.beam)
    print(f"tg_ds4: kernels tuned with BEAM={args.beam} (searching on a first run, cached afterwards)", file=sys.stderr)
  from tg_ds4.io.registry import ModelNotFound
  try: return args.fn(args)
  except (GGUFError, ModelNotFound, UsageError) as e:
    print(f"tg_ds4: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    return 130
