"""The package's structure in numbers: modules and lines, the depth of its import graph, import cycles, and imports made
inside functions. Reads the sources only (nothing is imported or run).

  python dev/structure.py [PACKAGE_DIR] [--list]     # default: tg_ds4 next to this folder; --list names each local import

Every `import` of a tg_ds4 module counts as an edge, wherever it stands (a function-local import ties modules as much
as a top-level one). Floors: a module that imports no other tg_ds4 module is on floor 1, any other one floor above the
highest it imports (the modules of one cycle share a floor). Cycles: groups of modules that reach each other."""
from __future__ import annotations

import ast, pathlib, sys

def module_name(root: pathlib.Path, p: pathlib.Path) -> str:
  parts = list(p.relative_to(root.parent).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

def resolve(name: str, modules: set[str]) -> str | None:
  """The module a dotted name lands in: itself, or the package that holds the attribute it names."""
  while name and name not in modules: name = name.rpartition(".")[0]
  return name or None

def scan(root: pathlib.Path):
  files = {module_name(root, p): p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts}
  modules, pkg = set(files), root.name
  edges: dict[str, set[str]] = {m: set() for m in modules}
  local: list[tuple[str, int, str]] = []
  lines = 0
  for m, p in files.items():
    src = p.read_text(); lines += src.count("\n"); tree = ast.parse(src)
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)}
    for node in ast.walk(tree):
      if isinstance(node, ast.Import): targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        targets = [f"{node.module}.{a.name}" for a in node.names]
      else: continue
      ours = [t for t in targets if t.split(".")[0] == pkg]
      if id(node) in in_function: local.append((m, node.lineno, ", ".join(targets)))
      for t in ours:
        if (d := resolve(t, modules)) and d != m and not m.startswith(d + ".") and d != pkg: edges[m].add(d)
  return files, edges, local, lines

def components(edges: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components (Tarjan), each a list of modules."""
  index, low, stack, on, out, i = {}, {}, [], set(), [], 0
  def visit(v):
    nonlocal i
    index[v] = low[v] = i; i += 1; stack.append(v); on.add(v)
    for w in edges[v]:
      if w not in index: visit(w); low[v] = min(low[v], low[w])
      elif w in on: low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop(); on.discard(w); comp.append(w)
        if w == v: break
      out.append(sorted(comp))
  sys.setrecursionlimit(10000)
  for v in sorted(edges):
    if v not in index: visit(v)
  return out

def floors(edges: dict[str, set[str]], comps: list[list[str]]) -> dict[str, int]:
  comp_of = {m: k for k, c in enumerate(comps) for m in c}
  floor: dict[int, int] = {}
  for k, c in enumerate(comps):  # Tarjan yields components in reverse topological order: dependencies first
    deps = {comp_of[d] for m in c for d in edges[m]} - {k}
    floor[k] = 1 + max((floor[d] for d in deps), default=0)
  return {m: floor[comp_of[m]] for m in edges}

def main() -> int:
  args = [a for a in sys.argv[1:] if not a.startswith("--")]
  root = pathlib.Path(args[0]) if args else pathlib.Path(__file__).resolve().parents[1] / "tg_ds4"
  files, edges, local, lines = scan(root)
  comps = components(edges)
  fl = floors(edges, comps)
  cycles = [c for c in comps if len(c) > 1]
  own = [x for x in local if root.name in x[2].split(".")[0] or x[2].startswith(root.name)]
  print(f"modules            {len(files)} ({lines} lines)")
  print(f"import edges       {sum(map(len, edges.values()))}")
  print(f"floors             {max(fl.values())}")
  print(f"cycles             {len(cycles)}" + "".join(f"\n  {len(c)} modules: {', '.join(c)}" for c in cycles))
  print(f"function-local imports: {len(local)}, of {root.name} modules: {len(own)}")
  if "--list" in sys.argv:
    for m, ln, t in local: print(f"  {m}:{ln} {t}")
  return 0

if __name__ == "__main__": sys.exit(main())
