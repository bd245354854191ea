"""The import graph: one way, no cycles, imports at the top; tests never import each other.

Read from the source with `ast` (nothing is imported), counting imports inside
functions too: a cycle hidden by a function-level import is still a cycle.
"""
import ast
import os
import pathlib

from helpers import REPO

PACKAGE = os.path.join(REPO, 'mtp_jax')
# The package's groups, lowest first. A module may import its own group and the groups
# below it, never one above; groups on one level (a tuple) do not import each other.
GROUPS = (
    ('mtp_jax', 'mtp_jax.errors', 'mtp_jax.exports', 'mtp_jax.config', 'mtp_jax.config_lib',
     'mtp_jax.config_files', 'mtp_jax.storage'),
    (('mtp_jax.runtime',), ('mtp_jax.data',)),
    (('mtp_jax.model',), ('mtp_jax.checkpoint',)),
    ('mtp_jax.train_state',),
    (('mtp_jax.interop',), ('mtp_jax.decode',)),
    ('mtp_jax.train',),
    ('mtp_jax.research',),
    ('mtp_jax.cli', 'mtp_jax.commands'),
)
# (group, lower group) that the levels would allow but that stay apart: the model reads no
# tokenizer (a config's model.vocab_size is resolved before the model is built).
APART = {('mtp_jax.model', 'mtp_jax.data')}
# (module, imported module): deliberately deferred heavy or optional imports, each with a
# `# Deferred: <why>` comment right above it.
DEFERRED = {
    ('mtp_jax.train.metrics', 'tensorboardX'),
    ('mtp_jax.train.metrics', 'wandb'),  # optional: train.wandb.project only
    ('mtp_jax.data.tokenizers', 'sentencepiece'),
    ('mtp_jax.data.tokenizers', 'tokenizers'),
    ('mtp_jax.data.tokenizers', 'mtp_jax.data.stdlib_dataset'),
    ('mtp_jax.data.checks', 'mtp_jax.data.pipeline'),
    ('mtp_jax.data.checks', 'mtp_jax.data.stdlib_dataset'),
    ('mtp_jax.train.resilience', 'jax._src'),  # its distributed module, private
    ('mtp_jax.train.evaluation', 'mtp_jax.data.stdlib_dataset'),
    ('mtp_jax.train.evaluation', 'mtp_jax.data.pipeline'),
    ('mtp_jax.data.user_data', 'pyarrow.parquet'),  # optional: parquet data only
    ('mtp_jax.data.user_data', 'datasets'),  # optional: data.source hf_disk only
    ('mtp_jax.model.moe', 'jax.experimental.pallas.ops.tpu.megablox'),  # the TPU gmm form
    ('mtp_jax.model.attention', 'jax.experimental.pallas.ops.tpu.splash_attention'),  # TPU
    ('mtp_jax.model.attention', 'jax.experimental.pallas.ops.gpu.attention'),  # GPU kernel
}


def _modules() -> dict:
  """{'mtp_jax.decode.decoder': path, 'mtp_jax.data': .../data/__init__.py, ...}."""
  out = {}
  for root, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith('.py'):
        rel = os.path.relpath(os.path.join(root, f), REPO)[:-3].split(os.sep)
        out['.'.join(rel[:-1] if rel[-1] == '__init__' else rel)] = os.path.join(root, f)
  return out


MODULES = _modules()


def _imported(node, modules) -> list[str]:
  """The modules an Import / ImportFrom node names: 'from mtp_jax import decode' ->
  mtp_jax.decode.decoder, 'from mtp_jax.model.mtp import MTPModel' -> mtp_jax.model.mtp,
  'from flax import nnx' -> flax."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names]
  assert node.level == 0, 'relative imports are not used in mtp_jax'
  if node.module.split('.')[0] != 'mtp_jax':
    return [node.module]
  names = [f'{node.module}.{a.name}' for a in node.names]
  return [n if n in modules else node.module for n in names]


def _imports(path):
  """[(imported module, line, inside a function)] of one file."""
  tree = ast.parse(pathlib.Path(path).read_text(encoding='utf-8'))
  inner = set()
  for fn in ast.walk(tree):
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      inner.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
  return [(m, n.lineno, id(n) in inner) for n in ast.walk(tree)
          if isinstance(n, (ast.Import, ast.ImportFrom)) for m in _imported(n, MODULES)]


def _graph() -> dict:
  """Module -> the package modules it imports (at any level)."""
  return {mod: sorted({m for m, _, _ in _imports(path) if m in MODULES and m != mod})
          for mod, path in MODULES.items()}


def _reachable(graph, start) -> set:
  seen, todo = set(), [start]
  while todo:
    for nxt in graph[todo.pop()]:
      if nxt not in seen:
        seen.add(nxt)
        todo.append(nxt)
  return seen


def _levels() -> list[list[tuple]]:
  """GROUPS as [[group, ...] per level], each group a tuple of module-name prefixes."""
  return [[g for g in level] if isinstance(level[0], tuple) else [level] for level in GROUPS]


def _group_of(module: str):
  """(level, group) of a package module: the longest prefix that names it."""
  best = None
  for i, level in enumerate(_levels()):
    for group in level:
      for prefix in group:
        if (module == prefix or module.startswith(prefix + '.')) and (
            best is None or len(prefix) > len(best[2])):
          best = (i, group, prefix)
  assert best is not None and (best[2] != 'mtp_jax' or module == 'mtp_jax'), (
      f'{module} belongs to no group of GROUPS')
  return best[0], best[1]


def test_every_module_is_in_a_group():
  assert 'mtp_jax.data.pipeline' in MODULES and 'mtp_jax.model.mtp' in MODULES
  for mod in MODULES:
    _group_of(mod)


def test_import_graph_is_acyclic():
  graph = _graph()
  cycles = [m for m in graph if m in _reachable(graph, m)]
  assert not cycles, f'modules on an import cycle: {cycles}'


def test_groups_import_only_their_own_and_lower_groups():
  bad = []
  for mod, imported in _graph().items():
    level, group = _group_of(mod)
    for other in imported:
      other_level, other_group = _group_of(other)
      if (other_level > level or (other_level == level and other_group != group)
          or (group[0], other_group[0]) in APART):
        bad.append(f'{mod} -> {other}')
  assert not bad, 'imports that point up or sideways: ' + ', '.join(bad)


def test_function_level_imports_are_the_deferred_ones():
  found = set()
  for mod, path in MODULES.items():
    if mod.startswith('mtp_jax.commands'):
      continue  # a command imports JAX and the library only after its flags parse
    lines = pathlib.Path(path).read_text(encoding='utf-8').splitlines()
    for imported, line, inside in _imports(path):
      if not inside:
        continue
      found.add((mod, imported))
      assert (mod, imported) in DEFERRED, f'{path}:{line}: import of {imported} inside a function'
      comment = [t.strip() for t in lines[max(0, line - 4):line - 1]]
      assert any(t.startswith('# Deferred') for t in comment), (
          f'{path}:{line}: a deferred import says why in a `# Deferred: ...` comment above it')
  assert found == DEFERRED, f'allowed but no longer deferred: {sorted(DEFERRED - found)}'


def _private_uses(path) -> list[str]:
  """'line: name' for each private name of another package module a file imports or reads:
  `from mtp_jax.x import _y`, and `_y` read off a name bound to a package module."""
  tree = ast.parse(pathlib.Path(path).read_text(encoding='utf-8'))
  bound, found = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or '').split('.')[0] == 'mtp_jax':
      for a in node.names:
        if a.name.startswith('_'):
          found.append(f'{node.lineno}: {node.module}.{a.name}')
        elif f'{node.module}.{a.name}' in MODULES:
          bound.add(a.asname or a.name)
    elif isinstance(node, ast.Import):
      bound.update(a.asname or a.name.split('.')[0] for a in node.names
                   if a.name.split('.')[0] == 'mtp_jax')
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and node.attr.startswith('_')
        and not node.attr.startswith('__')):
      base = node.value
      while isinstance(base, ast.Attribute) and not base.attr.startswith('_'):
        base = base.value
      if isinstance(base, ast.Name) and base.id in bound:
        found.append(f'{node.lineno}: {base.id}...{node.attr}')
  return found


def test_no_module_uses_another_modules_private_names():
  """What one module takes from another is public: a leading underscore means 'this file only'."""
  found = {path: _private_uses(path) for path in MODULES.values()}
  found = {p: f for p, f in found.items() if f}
  assert not found, f'private names used across modules: {found}'


def test_private_name_check_sees_both_forms(tmp_path):
  src = tmp_path / 'm.py'
  src.write_text('from mtp_jax.checkpoint.reader import _x\nfrom mtp_jax.model import mla\n'
                 'from mtp_jax import checkpoint as c\n'
                 'y = mla._pad_last\nz = c.reader._w\nok = mla.MLAttention\n')
  assert _private_uses(src) == ['1: mtp_jax.checkpoint.reader._x', '4: mla..._pad_last',
                                '5: c..._w']


def _own_package_imports(path, package) -> list[int]:
  """Lines of `path` that import from `package` (its own package) by the package's name,
  which goes through the package's __init__."""
  tree = ast.parse(pathlib.Path(path).read_text(encoding='utf-8'))
  return [n.lineno for n in ast.walk(tree)
          if isinstance(n, ast.ImportFrom) and n.module == package]


def test_modules_import_their_siblings_by_module_path():
  """Inside a sub-package, `import mtp_jax.pkg.mod as mod`, never `from mtp_jax.pkg import
  mod`: the second form runs through the package's __init__, which re-exports from its
  modules, so a module would import itself in a circle."""
  found = {}
  for mod, path in MODULES.items():
    package = mod.rsplit('.', 1)[0]
    if not path.endswith('__init__.py') and package != 'mtp_jax' and package in MODULES:
      lines = _own_package_imports(path, package)
      if lines:
        found[mod] = lines
  assert not found, f'modules importing their own package by name: {found}'


def test_own_package_check_sees_the_form(tmp_path):
  src = tmp_path / 'm.py'
  src.write_text('import mtp_jax.research.stats as stats\nfrom mtp_jax.research import tables\n'
                 'from mtp_jax.research.results import load_results\n')
  assert _own_package_imports(src, 'mtp_jax.research') == [2]


# The sub-packages' __init__.py, and config_lib: the face of mtp_jax/config/ for config files.
FACES = ({m for m, path in MODULES.items() if path.endswith('__init__.py') and m != 'mtp_jax'}
         | {'mtp_jax.config_lib'})


def _face_imports(path) -> list[str]:
  """'line: import' for each import in `path` that goes through a sub-package's face (its
  __init__) rather than a module: a name the face re-exports (`from mtp_jax.model import
  MTPModel`) or the package itself as a name (`from mtp_jax import checkpoint`,
  `import mtp_jax.decode`)."""
  tree = ast.parse(pathlib.Path(path).read_text(encoding='utf-8'))
  found = []
  for n in ast.walk(tree):
    if isinstance(n, ast.ImportFrom) and (n.module or '').split('.')[0] == 'mtp_jax':
      for a in n.names:
        full = f'{n.module}.{a.name}'
        if full in FACES or (n.module in FACES and full not in MODULES):
          found.append(f'{n.lineno}: from {n.module} import {a.name}')
    elif isinstance(n, ast.Import):
      found += [f'{n.lineno}: import {a.name}' for a in n.names if a.name in FACES]
  return found


def test_package_code_imports_modules_not_faces():
  """The faces are for users; package code names the module it imports
  (`from mtp_jax.model.mtp import MTPModel`, `from mtp_jax.checkpoint import store`), so
  what a module depends on is one module, and no face needs to import its modules."""
  found = {mod: _face_imports(path) for mod, path in MODULES.items()}
  found = {m: f for m, f in found.items() if f}
  assert not found, f'imports through a sub-package face: {found}'


def test_face_check_sees_every_form(tmp_path):
  src = tmp_path / 'm.py'
  src.write_text('from mtp_jax.model import MTPModel, mtp\n'
                 'from mtp_jax import checkpoint, config_lib\n'
                 'import mtp_jax.decode\nimport mtp_jax.decode.decoder as decoder\n'
                 'from mtp_jax.train import aot\nfrom mtp_jax.train.aot import hlo\n'
                 'from mtp_jax.checkpoint.store import short\n')
  assert _face_imports(src) == ['1: from mtp_jax.model import MTPModel',
                                '2: from mtp_jax import checkpoint',
                                '2: from mtp_jax import config_lib', '3: import mtp_jax.decode',
                                '5: from mtp_jax.train import aot']


def test_no_test_file_imports_another():
  """Shared code lives in helpers.py (or conftest.py's fixtures), never in a test module."""
  tests = os.path.join(REPO, 'tests')
  for name in sorted(os.listdir(tests)):
    if not name.endswith('.py'):
      continue
    path = os.path.join(tests, name)
    for imported, line, _ in _imports(path):
      root = imported.split('.')[0]
      assert not (root.startswith('test_') or root == 'conftest'), (
          f'{path}:{line} imports {imported}: move what it needs to tests/helpers.py')
