"""The kernels of one schedule compiled by one clang process, not one each (`TG_DS4_BATCH_COMPILE=0` turns it off).

tinygrad compiles each CPU kernel with a clang process of its own. clang is linked against LLVM's shared libraries, and
starting it (loading and relocating them) costs more than compiling a typical kernel: a step's hundreds of kernels
spend most of their compile time starting clang. A cold start's capture, and every test that lowers a new step, pays it.

Here, while tinygrad lowers the kernels of one schedule in this process (`realize.lower_and_compile` without a compile
pool: `PARALLEL=0`, as the test suite runs), each CPU kernel's C source is set aside instead of compiled: its program
comes back with a placeholder binary, and nothing runs before the schedule is lowered. Then the sources go to clang as
one translation unit, each kernel renamed and in a section of its own (`-ffunction-sections -fdata-sections`), and
the object is cut into one object per kernel: its code, the constants it references, its relocations. tinygrad loads
that object as it loads its own: the function at offset 0, the relocations applied by its loader. The code is the same
(clang compiles each function on its own; no flag but the two section flags differs), so results are bitwise the same.

A source of another shape than tinygrad's renderer writes (typedefs and one function) or a batch clang rejects is
compiled alone, as tinygrad would. BEAM (which times what it compiles) and the compile pool's workers compile as
tinygrad does: batches compiled here after the pool's parallel lowering measured no faster on 2 cores, where the pool
already overlaps one worker's clang with the other's lowering. tinygrad's compile cache is read first and written
after, per source, as it would be."""
from __future__ import annotations

import copy, re, struct, threading

from tinygrad import Device

from tg_ds4.backend import compat

PLACEHOLDER = b"TG_DS4 batch compile pending\0"
SECTION_FLAGS = ["-ffunction-sections", "-fdata-sections"]
MAX_BATCH = 512  # sources per clang process: bounds its memory and what a rejected batch costs

_state = threading.local()  # .deferring: this thread's CPU compiles are set aside (while tinygrad lowers one kernel);
                            # .set_aside: how many have been (a running count)
_lock = threading.RLock()  # one schedule lowered at a time: no other thread may take a placeholder from tinygrad's cache
_lower_and_compile = _compile_kernel = _compile_cached = None  # tinygrad's own, while ours are installed

def install() -> None:
  """Idempotent. Installed before backend/programs.py's cache, which then saves real binaries, not placeholders."""
  global _lower_and_compile, _compile_kernel, _compile_cached
  if _lower_and_compile is not None or not compat.batch_compile_on(): return
  _compile_cached, compat.ClangCompiler.compile_cached = compat.ClangCompiler.compile_cached, _deferred_compile_cached
  _lower_and_compile, compat.realize.lower_and_compile = compat.realize.lower_and_compile, _batched_lower_and_compile
  _compile_kernel, compat.realize._compile_kernel = compat.realize._compile_kernel, deferred_compile_kernel

def deferred_compile_kernel(x):
  """tinygrad's `_compile_kernel` (lower and compile one kernel) with the CPU compile set aside, in this process. In a
  compile worker (which unpickles this function by name; install() never ran there) and under BEAM (which times
  what it compiles), tinygrad's."""
  if _compile_kernel is None: return compat.realize._compile_kernel(x)
  if compat.BEAM.value >= 1 or getattr(x[1][0].arg, "beam", 0): return _compile_kernel(x)
  _state.deferring = True
  try: return _compile_kernel(x)
  finally: _state.deferring = False

def _deferred_compile_cached(self, src: str) -> bytes:
  if not getattr(_state, "deferring", False) or not isinstance(getattr(self, "args", None), list): return _compile_cached(self, src)
  if self.cachekey is not None and (lib := compat.tinygrad_helpers.diskcache_get(self.cachekey, src)) is not None: return lib
  _state.set_aside = getattr(_state, "set_aside", 0) + 1
  return PLACEHOLDER

def _program(call):
  """The PROGRAM a CALL runs (as tinygrad's realize._get_call_to_compile finds it), if it holds a placeholder."""
  prg = a.src[0] if (a := call.src[0]).op is compat.Ops.CUSTOM_FUNCTION and a.arg == "hcq" and a.src else a
  return prg if _placeholder(prg) else None

def _placeholder(u) -> bool: return u.op is compat.Ops.PROGRAM and u.src[-1].op is compat.Ops.BINARY and u.src[-1].arg == PLACEHOLDER

def _batched_lower_and_compile(linear):
  cache = compat.codegen.to_program_cache
  with _lock:
    start = _state.set_aside = getattr(_state, "set_aside", 0)
    try:
      out = _lower_and_compile(linear)
      if _state.set_aside == start: return out  # every kernel was in a cache (the common case): nothing to look for
      calls = {c: prg for c in out.toposort(enter_calls=False) if c.op is compat.Ops.CALL and (prg := _program(c)) is not None}
      if not calls: return out
      pending = {prg.src[-2].arg: Device[c.device if isinstance(c.device, str) else c.device[0]].renderer.compiler for c, prg in calls.items()}
      libs = compile_all(pending)  # {source: object}
    except BaseException:
      if _state.set_aside != start:
        for k in [k for k, v in cache.items() if _placeholder(v)]: del cache[k]  # lowered again next time, never run
      raise
    real = lambda prg: prg.replace(src=prg.src[:-1] + (compat.UOp(compat.Ops.BINARY, arg=libs[prg.src[-2].arg]),))
    for k, v in list(cache.items()):
      if _placeholder(v):
        if v.src[-2].arg in libs: cache[k] = real(v)
        else: del cache[k]
    # swapped in per call, as tinygrad's lower_and_compile swaps its programs in (a rewrite of the linear enters no call)
    return out.substitute({c: c.replace(src=(c.src[0].substitute({prg: real(prg)}), *c.src[1:])) for c, prg in calls.items()},
                          name="batch compiled kernels")

def compile_all(pending: dict) -> dict[str, bytes]:
  """{source: object} for every source, compiled in batches per compiler, and put in tinygrad's compile cache as its
  own compile_cached would."""
  libs: dict[str, bytes] = {}
  by_compiler: dict[int, tuple[object, list[str]]] = {}
  for src, cc in pending.items(): by_compiler.setdefault(id(cc), (cc, []))[1].append(src)
  for cc, srcs in by_compiler.values():
    shaped = {s: _function(s) is not None for s in srcs}
    ok, alone = [s for s in srcs if shaped[s]], [s for s in srcs if not shaped[s]]
    for i in range(0, len(ok), MAX_BATCH):
      part = ok[i:i + MAX_BATCH]
      if (got := compile_batch(cc, part) if len(part) > 1 else None) is None: alone += part
      else: libs.update(got)
    for s in alone: libs[s] = cc.compile(s)
    if cc.cachekey is not None:
      for s in srcs: compat.tinygrad_helpers.diskcache_put(cc.cachekey, s, libs[s])
  return libs

_FUNC = re.compile(r"^void (\w+)\(", re.M)

def _function(src: str) -> str | None:
  """The kernel's function name, if the source is what tinygrad's C renderer writes: typedef lines, then one function
  at the top level (everything else indented, or its closing brace)."""
  lines = src.splitlines()
  if sum(ln.startswith("void ") for ln in lines) != 1: return None
  if not all(not ln or ln[0] in " \t}" or ln.startswith(("typedef ", "void ")) for ln in lines): return None
  return m.group(1) if (m := _FUNC.search(src)) else None

def compile_batch(cc, srcs: list[str]) -> dict[str, bytes] | None:
  """One clang process for `srcs`, or None if clang rejects the batch or the object cannot be cut (then each is
  compiled alone: a kernel clang rejects fails there, as it would have)."""
  typedefs, bodies = [], []
  for i, s in enumerate(srcs):
    typedefs += [ln for ln in s.splitlines() if ln.startswith("typedef ") and ln not in typedefs]
    bodies.append(_FUNC.sub(f"void tg_ds4_k{i}(", "\n".join(ln for ln in s.splitlines() if not ln.startswith("typedef ")), count=1))
  batch = copy.copy(cc)  # (the compiler itself keeps its flags)
  batch.args = [*cc.args, *SECTION_FLAGS]
  try: obj = batch.compile("\n".join(typedefs) + "\n" + "\n".join(bodies) + "\n")
  except Exception: return None  # noqa: BLE001
  try: parts = split(obj, [f"tg_ds4_k{i}" for i in range(len(srcs))])
  except (ValueError, struct.error, IndexError, StopIteration): return None
  return None if parts is None else dict(zip(srcs, parts))

# *** cutting a relocatable ELF64 (little-endian: x86-64, AArch64) into one object per function section

EHDR, SHDR, SYM, RELA = struct.Struct("<16sHHIQQQIHHHHHH"), struct.Struct("<IIQQQQIIQQ"), struct.Struct("<IBBHQQ"), struct.Struct("<QQq")
SHT_PROGBITS, SHT_SYMTAB, SHT_STRTAB, SHT_RELA, SHT_NOBITS, SHN_LORESERVE = 1, 2, 3, 4, 8, 0xff00

def split(obj: bytes, names: list[str]) -> list[bytes] | None:
  """For each function name, a relocatable object holding `.text.<name>` (as `.text`, first), the sections its
  relocations reference, those relocations and the symbols they name. None where that is not possible: another ELF
  kind, a referenced section with relocations of its own or of another type, a special section index."""
  if obj[:4] != b"\x7fELF" or obj[4] != 2 or obj[5] != 1: return None
  ident, etype, machine, version, _, _, shoff, flags, _, _, _, shentsize, shnum, shstrndx = EHDR.unpack_from(obj)
  shdrs = [SHDR.unpack_from(obj, shoff + i * shentsize) for i in range(shnum)]
  cstr = lambda sec, off: obj[shdrs[sec][4] + off:obj.index(b"\0", shdrs[sec][4] + off)].decode()
  secname = [cstr(shstrndx, sh[0]) for sh in shdrs]
  data = lambda i: obj[shdrs[i][4]:shdrs[i][4] + shdrs[i][5]]
  symtab = next(i for i, sh in enumerate(shdrs) if sh[1] == SHT_SYMTAB)
  syms = [SYM.unpack_from(data(symtab), j * SYM.size) for j in range(shdrs[symtab][5] // SYM.size)]
  relas = {sh[7]: i for i, sh in enumerate(shdrs) if sh[1] == SHT_RELA}  # target section -> its relocation section
  index = {n: i for i, n in enumerate(secname)}
  out = []
  for name in names:
    if (text := index.get(f".text.{name}")) is None: return None
    rel = data(relas[text]) if text in relas else b""
    entries = [RELA.unpack_from(rel, j * RELA.size) for j in range(len(rel) // RELA.size)]
    used = sorted({syms[r[1] >> 32][3] for r in entries} - {0, text})
    if any(s >= SHN_LORESERVE or s in relas or shdrs[s][1] != SHT_PROGBITS for s in used): return None
    sections = [(".text", shdrs[text], data(text))] + [(secname[s], shdrs[s], data(s)) for s in used]
    out.append(_object((ident, etype, machine, version, flags), sections, {text: 1, **{s: 2 + k for k, s in enumerate(used)}},
                       entries, syms, lambda off: cstr(shdrs[symtab][6], off)))
  return out

def _object(header: tuple, sections: list, new_index: dict[int, int], entries: list, syms: list, symname) -> bytes:
  """A relocatable ELF64: the null section, `sections` (the text first), `.rela.text`, `.symtab` (the relocations'
  symbols, locals first), and one string table for section and symbol names (as LLVM writes it, and as tinygrad's
  loader reads symbol names)."""
  ident, etype, machine, version, flags = header
  names = bytearray(b"\0")
  def name(s: str) -> int:
    names.extend(s.encode() + b"\0")
    return len(names) - len(s) - 1
  order = sorted(dict.fromkeys(r[1] >> 32 for r in entries), key=lambda j: syms[j][1] >> 4 != 0)  # STB_LOCAL first
  sym_of = {j: k + 1 for k, j in enumerate(order)}
  new_syms = [SYM.pack(0, 0, 0, 0, 0, 0)]
  for j in order:
    st_name, info, other, shndx, value, size = syms[j]
    new_syms.append(SYM.pack(name(symname(st_name)) if shndx == 0 else 0, info, other, new_index.get(shndx, 0), value, size))
  rela = b"".join(RELA.pack(off, (sym_of[info >> 32] << 32) | (info & 0xffffffff), addend) for off, info, addend in entries)
  n, n_local = len(sections), 1 + sum(1 for j in order if syms[j][1] >> 4 == 0)
  tables = [(".rela.text", SHT_RELA, 0, rela, 8, n + 2, 1, RELA.size), (".symtab", SHT_SYMTAB, 0, b"".join(new_syms), 8, n + 3, n_local, SYM.size)]
  sh_names = [name(nm) for nm, _, _ in sections] + [name(t[0]) for t in tables] + [name(".strtab")]
  tables.append((".strtab", SHT_STRTAB, 0, bytes(names), 1, 0, 0, 0))
  body, headers = bytearray(), [SHDR.pack(*[0] * 10)]
  rows = [(sh[1], sh[2], content, sh[8], 0, 0, sh[9]) for _, sh, content in sections] + [t[1:] for t in tables]
  for sh_name, (sh_type, sh_flags, content, align, link, info, entsize) in zip(sh_names, rows):
    body.extend(b"\0" * (-(EHDR.size + len(body)) % max(align, 1)))
    headers.append(SHDR.pack(sh_name, sh_type, sh_flags, 0, EHDR.size + len(body), len(content), link, info, align, entsize))
    body.extend(content)
  body.extend(b"\0" * (-(EHDR.size + len(body)) % 8))
  return EHDR.pack(ident, etype, machine, version, 0, 0, EHDR.size + len(body), flags, EHDR.size, 0, 0, SHDR.size, len(headers), len(headers) - 1) + \
    bytes(body) + b"".join(headers)
