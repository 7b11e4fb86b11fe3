"""How a model's graphs are built: the device's capabilities (backend.Capabilities), the numerics of its quantized
matmuls (quant/activations.py) and the float type of matmul inputs and KV caches (quant/precision.py), as one frozen
`Settings` resolved when the model is loaded (`Settings.for_model`). The model's forward makes its settings the active
ones (`active()`) while it builds a graph, and the blocks and packed matmuls read them (`current`).

Outside a model's forward nothing is emulated: `current` gives the plain settings of the tensor's device, exact
numerics and float32 (a matmul called on its own computes the exact product). A model loads with DEFAULT_NUMERICS
unless told otherwise: the command line, the server, `Runner.load` and `load_model` all take it from here."""
from __future__ import annotations

import contextlib, contextvars, dataclasses
from dataclasses import dataclass

from tinygrad import dtypes

from tg_ds4 import backend
from tg_ds4.backend.compat import DType
from tg_ds4.quant import precision

NUMERICS = ("auto", "exact", "llama.cpp")
DEFAULT_NUMERICS = "auto"

def check(numerics: str) -> str:
  if numerics not in NUMERICS: raise ValueError(f"numerics {numerics!r}: expected one of {', '.join(NUMERICS)}")
  return numerics

@dataclass(frozen=True)
class Settings:
  caps: backend.Capabilities
  numerics: str   # one of NUMERICS
  matmul: DType   # matmul inputs and dequantized weights; accumulation and outputs are float32
  cache: DType    # KV cache rows

  @staticmethod
  def for_model(device: str, numerics: str = DEFAULT_NUMERICS) -> Settings:
    caps = backend.capabilities(device)
    p = precision.for_caps(caps)
    return Settings(caps, check(numerics), p.matmul, p.cache)

  @staticmethod
  def plain(device: str | None) -> Settings:
    return Settings(backend.capabilities(device), "exact", dtypes.float32, dtypes.float32)

  @contextlib.contextmanager
  def active(self):
    """Build the graphs inside under these settings."""
    tok = _ACTIVE.set(self)
    try: yield self
    finally: _ACTIVE.reset(tok)

_ACTIVE: contextvars.ContextVar[Settings | None] = contextvars.ContextVar("tg_ds4_settings", default=None)

def current(device: str | None = None) -> Settings:
  """The active settings, or outside a model's forward the plain ones of `device`."""
  return s if (s := _ACTIVE.get()) is not None else Settings.plain(device)

@contextlib.contextmanager
def override(device: str | None = None, **changes):
  """The current settings (of `device` where none are active) with `changes`, active inside: a router's matmul in
  float32 at any precision (`matmul=dtypes.float32`), a test's numerics."""
  s = current(device)
  if "numerics" in changes: check(changes["numerics"])
  with dataclasses.replace(s, **changes).active() as new: yield new
