"""Command line: `python -m tg_ds4 <command>`. Errors in user input print one line and exit 2."""
from __future__ import annotations

import argparse
import json
import sys

from tg_ds4.gguf import GGUFError


class UsageError(ValueError):
  """Bad command-line input: reported as one line, exit 2."""

def cmd_inspect(args) -> int:
  from tg_ds4.gguf import GGUFFile
  from tg_ds4.registry import resolve
  from tg_ds4.summary import format_text, summarize
  gf = GGUFFile(resolve(args.model))
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
  from tinygrad import Tensor, dtypes

  from tg_ds4.model import Transformer
  from tg_ds4.registry import resolve
  try: tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
  except ValueError: raise UsageError(f"--tokens must be comma-separated integers, got {args.tokens!r}") from None
  if not tokens: raise UsageError("--tokens is empty")
  model = Transformer.from_gguf(resolve(args.model), max_ctx=args.max_context or len(tokens))
  if bad := [t for t in tokens if not 0 <= t < model.cfg.n_vocab]:
    raise UsageError(f"token ids {bad[:5]} are outside the vocabulary [0, {model.cfg.n_vocab})")
  if args.mode == "prefill": logits = model.prefill(tokens, chunk=len(tokens)).numpy()[0]
  else: logits = np.stack([model.decode(Tensor([[t]], dtype=dtypes.int32), i).numpy()[0, 0] for i, t in enumerate(tokens)])
  logits = logits.astype(np.float32)
  if args.out: np.save(args.out, logits)
  print(f"logits {list(logits.shape)} ({args.mode}) argmax {logits.argmax(-1).tolist()}" + (f" -> {args.out}" if args.out else ""))
  return 0

def cmd_models(args) -> int:
  from tg_ds4.registry import registry
  for name, e in registry().items(): print(f"{name:<20} {'cached' if e.path.exists() else 'not cached':<11} {e.description}")
  return 0

def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="tg_ds4", description="DeepSeek-family GGUF inference on tinygrad")
  sub = p.add_subparsers(dest="command", required=True)
  s = sub.add_parser("inspect", help="summarise a GGUF file or registry model")
  s.add_argument("model", help="path to a .gguf file or a short model name (see `models`)")
  s.add_argument("--json", action="store_true", help="machine-readable output, with every tensor")
  s.add_argument("--dump", metavar="TENSOR", help="write this tensor's dequantized values (float32, tinygrad order)")
  s.add_argument("--out", metavar="F.npy", help="output file for --dump")
  s.set_defaults(fn=cmd_inspect)
  s = sub.add_parser("logits", help="float32 logits [n_tokens, vocab] for a token-id sequence (the correctness probe)")
  s.add_argument("-m", "--model", required=True, help="path to a .gguf file or a short model name")
  s.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
  s.add_argument("--mode", choices=["prefill", "decode"], default="prefill", help="one forward over all tokens, or one token at a time")
  s.add_argument("--out", metavar="F.npy", help="write the logits here")
  s.add_argument("--max-context", type=int, default=0, help="KV cache length (default: the number of tokens)")
  s.set_defaults(fn=cmd_logits)
  s = sub.add_parser("models", help="list the short model names")
  s.set_defaults(fn=cmd_models)
  return p

def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  from tg_ds4.registry import ModelNotFound
  try: return args.fn(args)
  except (GGUFError, ModelNotFound, UsageError) as e:
    print(f"tg_ds4: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    return 130

if __name__ == "__main__": sys.exit(main())
