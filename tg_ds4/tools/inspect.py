"""What `tg_ds4 inspect` shows: a GGUF file summarised for people (text) and programs (JSON)."""
from __future__ import annotations

from collections import Counter
from typing import Any

from tg_ds4.io.gguf import GGUFFile


def _human(n: float, unit: str = "B") -> str:
  for prefix in ("", "K", "M", "G", "T"):
    if abs(n) < 1000 or prefix == "T": return f"{n:.0f} {unit}" if not prefix else f"{n:.2f} {prefix}{unit}"
    n /= 1000
  return f"{n} {unit}"

def _short(v: Any, limit: int = 8) -> str:
  if isinstance(v, float): return f"{v:.7g}"  # GGUF floats are f32: don't print f64 noise digits
  if isinstance(v, list) and len(v) > limit: return f"[{', '.join(_short(x) for x in v[:limit])}, ... ({len(v)} items)]"
  if isinstance(v, list): return f"[{', '.join(_short(x) for x in v)}]"
  return str(v)

def summarize(gf: GGUFFile) -> dict[str, Any]:
  arch = gf.arch
  hist = Counter(i.qtype.name for i in gf.infos.values())
  bytes_by_type = Counter()
  for i in gf.infos.values(): bytes_by_type[i.qtype.name] += i.nbytes
  tokens = gf.get("tokenizer.ggml.tokens")
  return {
    "path": str(gf.path), "splits": len(gf.paths), "file_size": gf.file_size, "gguf_version": gf.get("GGUF.version"),
    "architecture": arch, "name": gf.get("general.name"),
    "hyperparameters": {k[len(arch) + 1:]: v for k, v in gf.metadata.items() if arch and k.startswith(arch + ".")},
    "tensor_count": len(gf.infos), "parameter_count": gf.n_params,
    "tensor_types": {t: {"count": hist[t], "bytes": bytes_by_type[t]} for t in sorted(hist, key=lambda t: -bytes_by_type[t])},
    "tokenizer": {"model": gf.get("tokenizer.ggml.model"), "pre": gf.get("tokenizer.ggml.pre"),
                  "vocab_size": len(tokens) if isinstance(tokens, list) else None,
                  "chat_template": gf.get("tokenizer.chat_template") is not None},
  }

def format_text(s: dict[str, Any]) -> str:
  tok = s["tokenizer"]
  lines = [
    f"{s['path']}" + (f"  ({s['splits']} splits)" if s["splits"] > 1 else ""),
    f"  architecture   {s['architecture'] or '(none)'}" + (f"   name: {s['name']}" if s["name"] else ""),
    f"  parameters     {_human(s['parameter_count'], '')}  ({s['parameter_count']:,})",
    f"  file size      {_human(s['file_size'])}  ({s['file_size']:,} bytes, "
    + (f"GGUF v{s['gguf_version']})" if s['gguf_version'] else "safetensors)"),
    f"  tensors        {s['tensor_count']}",
  ]
  for t, h in s["tensor_types"].items(): lines.append(f"    {t:<8} {h['count']:>5} tensors  {_human(h['bytes']):>10}")
  lines.append(f"  tokenizer      model={tok['model']} pre={tok['pre']} vocab={tok['vocab_size']} "
               f"chat_template={'yes' if tok['chat_template'] else 'no'}")
  if s["hyperparameters"]:
    lines.append(f"  {s['architecture']}.*")
    width = max(map(len, s["hyperparameters"]))
    for k, v in sorted(s["hyperparameters"].items()): lines.append(f"    {k:<{width}}  {_short(v)}")
  return "\n".join(lines)
