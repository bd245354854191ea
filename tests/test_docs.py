"""The documentation names only what exists, and the shipped files speak to users.

README.md and docs/*.md: every repository path in code spans, every flag of a command they
show (read from the parsers' source, no JAX), every `--config.` key (against
`config_lib.base_config()`), every relative link and image (and its #anchor) must resolve.
Over the docs and the shipped code: no words of the project's own bookkeeping and no
absolute paths of a build machine. Reads files only: well under a second.
"""
from __future__ import annotations

import ast
import functools
import io
import os
import re
import shlex
import subprocess
import tokenize
import tomllib

import pytest

from mtp_jax import config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS_DIR = os.path.join(REPO, 'docs')
# Top-level folders whose files a doc may name, and the top-level files.
ROOTS = ('mtp_jax', 'configs', 'scripts', 'tests', 'benchmarks', 'notebooks', 'docs', '.ci')
TOP_FILES = ('README.md', 'CHANGELOG.md', 'pyproject.toml', 'setup.py', 'pytest.ini')
# What a reader fills in: <name>, {k}, *.json, $VAR, NAME, DIR, ...
PLACEHOLDER = re.compile(r'[<>{}*$]|\.\.\.|\b(N|NAME|DIR|FILE|OUT|PATH|KEY|WORKDIR)\b')
_ROOTS_RE = '|'.join(re.escape(r) for r in ROOTS)
_TOP_RE = '|'.join(re.escape(f) for f in TOP_FILES)
PATH_RE = re.compile(rf'(?<![\w./~-])((?:{_ROOTS_RE})/[\w./-]*|(?:{_TOP_RE}))(?![\w/])')
CONFIG_KEY_RE = re.compile(r'--config\.([A-Za-z_][\w.]*)')
BARE_KEY_RE = re.compile(r'^(model|data|train|loss|mesh)((?:\.\w+)+)(=.*)?$')
PROGRAM_RE = re.compile(r'^(?:\S*/)?((?:scripts|benchmarks)/[\w/]+\.py|mtp-[a-z-]+)$')
# train.lock, model.safetensors: files, not keys
FILE_ENDINGS = ('.lock', '.json', '.jsonl', '.py', '.md', '.safetensors', '.model', '.txt')
LINK_RE = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')

# The project's bookkeeping words (they mean nothing to a user) and build-machine paths.
VOCABULARY = re.compile(
    r'\b[Ii]ssues? [0-9]+\b|\b[Ss]tops? [0-9]+\b'
    r'|\b(second|third|fourth|fifth|sixth|seventh) pass\b|\bthe lead\b|\bsession\b')
MACHINE_PATH = re.compile(r'(^|[^A-Za-z0-9_.])/(work|home|farm|root|tmp)/')
# pytest's own word for one test run, spelled as its API needs it.
ALLOWED = re.compile(
    r'''scope=['"]session['"]|pytest_sessionfinish\(session\b|session\.exitstatus''')
SHIPPED = ('mtp_jax', 'configs', 'tests', 'scripts', 'notebooks', 'docs', 'setup.py',
           'pyproject.toml', 'README.md', 'CHANGELOG.md')
TEXT_SUFFIXES = ('.py', '.md', '.ipynb', '.sh', '.toml', '.ini', '.txt', '.cfg', '.json')


def doc_files() -> list[str]:
  docs = sorted(os.path.join('docs', f) for f in os.listdir(DOCS_DIR) if f.endswith('.md'))
  return ['README.md'] + docs


def read(rel: str) -> str:
  with open(os.path.join(REPO, rel), encoding='utf-8') as f:
    return f.read()


def code_spans(text: str) -> list[str]:
  """Fenced blocks (continuation lines joined) and inline code spans of a markdown text."""
  out = []
  fence = re.compile(r'^```[^\n]*\n(.*?)^```', re.S | re.M)
  for m in fence.finditer(text):
    out.append(m.group(1).replace('\\\n', ' '))
  rest = fence.sub('', text)
  out += [a or b for a, b in re.findall(r'``(.+?)``|`([^`\n]+)`', rest)]
  return out


def slug(heading: str) -> str:
  """GitHub's anchor of a heading."""
  text = re.sub(r'[`*_]|\[([^\]]*)\]\([^)]*\)', r'\1', heading.strip().lower())
  return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def anchors(rel: str) -> set[str]:
  text = re.sub(r'^```.*?^```', '', read(rel), flags=re.S | re.M)
  return {slug(m) for m in re.findall(r'^#+\s+(.+?)\s*#*$', text, re.M)}


# -- flags, read from each command's parser source -----------------------------------------
def _entry_points() -> dict[str, str]:
  with open(os.path.join(REPO, 'pyproject.toml'), 'rb') as f:
    scripts = tomllib.load(f)['project']['scripts']
  return {name: target.split(':')[0] for name, target in scripts.items()}


def _module_file(module: str) -> str:
  return os.path.join(*module.split('.')) + '.py'


def _sources_of(program: str) -> list[str]:
  """The repository files whose add_argument calls make up `program`'s parser: its module
  and the command modules it imports (shared flags)."""
  if program.startswith('mtp-'):
    module = _entry_points().get(program)
    if not module:
      return []
    program = _module_file(module)
  files, todo = [], [program]
  while todo:
    rel = todo.pop()
    if rel in files or not os.path.isfile(os.path.join(REPO, rel)):
      continue
    files.append(rel)
    for node in ast.walk(ast.parse(read(rel))):
      if isinstance(node, ast.ImportFrom) and node.module:
        if node.module.startswith('mtp_jax.commands'):
          todo.append(_module_file(node.module))
      elif isinstance(node, ast.Import):  # shared command modules, a benchmark's own helpers
        for alias in node.names:
          if alias.name.startswith('mtp_jax.commands.'):
            todo.append(_module_file(alias.name))
          else:
            todo += [os.path.join(os.path.dirname(rel), alias.name + '.py'),
                     os.path.join('benchmarks', alias.name + '.py')]
  return files


@functools.cache
def flags_of(program: str) -> frozenset[str] | None:
  """Every option string `program` defines, or None when it has no Python parser here."""
  files = _sources_of(program)
  if not files:
    return None
  found = {'-h', '--help'}
  for rel in files:
    for node in ast.walk(ast.parse(read(rel))):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr == 'add_argument'):
        found.update(a.value for a in node.args
                     if isinstance(a, ast.Constant) and isinstance(a.value, str))
  return frozenset(found)


def commands(span: str):
  """(program, [flags]) for every invocation of a script or console command in a span."""
  for segment in re.split(r'&&|\|\||[;|\n]|\$\(|\bdo\b|\bthen\b', span):
    try:
      words = shlex.split(segment, comments=True)
    except ValueError:
      words = segment.split()
    for i, w in enumerate(words):
      m = PROGRAM_RE.match(w)
      if m:
        rest = words[i + 1:]
        if '--' in rest:  # a launcher's own flags end at `--`
          rest = rest[:rest.index('--')]
        yield m.group(1), [a.split('=', 1)[0] for a in rest
                           if a.startswith('--') and not a.startswith('--config.')]
        break


def config_key_exists(key: str) -> bool:
  node = config_lib.base_config()
  for part in key.split('.'):
    if not hasattr(node, 'keys') or part not in node:
      return False
    node = node[part]
  return True


# -- the tests -------------------------------------------------------------------------------
DOCS = doc_files()


def test_the_pages_exist():
  for page in ('design', 'training', 'decoding', 'bring-your-model', 'deepseek-v3', 'research',
               'development'):
    assert os.path.join('docs', f'{page}.md') in DOCS, page
  assert len(read('README.md').splitlines()) <= 200


@pytest.mark.parametrize('doc', DOCS)
def test_named_paths_exist(doc):
  missing = []
  for span in code_spans(read(doc)):
    for m in PATH_RE.finditer(span):
      path = m.group(1).split('::')[0].rstrip('.,:;')
      path = re.sub(r'\.py:\w[\w,]*$', '.py', path)  # configs/ablation.py:d3
      if PLACEHOLDER.search(path) or not path:
        continue
      if not os.path.exists(os.path.join(REPO, path)):
        missing.append(path)
  assert not missing, f'{doc} names files that do not exist: {sorted(set(missing))}'


@pytest.mark.parametrize('doc', DOCS)
def test_named_flags_exist(doc):
  wrong = []
  for span in code_spans(read(doc)):
    for program, flags in commands(span):
      known = flags_of(program)
      if known is None:
        if program.startswith('mtp-') or program.endswith('.py'):
          assert os.path.isfile(os.path.join(REPO, program)) or program in _entry_points(), (
              f'{doc}: no such command {program}')
        continue
      wrong += [f'{program} {f}' for f in flags if f not in known]
  assert not wrong, f'{doc} shows flags the commands do not take: {sorted(set(wrong))}'


@pytest.mark.parametrize('doc', DOCS)
def test_named_config_keys_exist(doc):
  unknown = []
  for span in code_spans(read(doc)):
    keys = CONFIG_KEY_RE.findall(span)
    bare = BARE_KEY_RE.match(span.strip())
    if bare:
      keys.append(bare.group(1) + bare.group(2))
    keys = [k.rstrip('.') for k in keys if k.islower()]  # KEY, FIELD: placeholders
    unknown += [k for k in keys if not k.endswith(FILE_ENDINGS) and not config_key_exists(k)]
  assert not unknown, f'{doc} names config keys base_config() lacks: {sorted(set(unknown))}'


@pytest.mark.parametrize('doc', DOCS + ['CHANGELOG.md'])
def test_links_and_images_resolve(doc):
  if not os.path.exists(os.path.join(REPO, doc)):
    pytest.skip(f'no {doc}')
  text = re.sub(r'^```.*?^```|`[^`\n]+`', '', read(doc), flags=re.S | re.M)
  broken = []
  for target in LINK_RE.findall(text):
    if re.match(r'^[a-z]+:', target):  # https:, mailto:
      continue
    path, _, anchor = target.partition('#')
    rel = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
    if not os.path.exists(os.path.join(REPO, rel)):
      broken.append(target)
    elif anchor and rel.endswith('.md') and anchor not in anchors(rel):
      broken.append(target)
  assert not broken, f'{doc} has links that do not resolve: {broken}'


def shipped_files() -> list[str]:
  try:
    out = subprocess.run(['git', 'ls-files', '--', *SHIPPED], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split('\n')
    files = [f for f in out if f]
  except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the folders
    files = []
    for top in SHIPPED:
      if os.path.isfile(os.path.join(REPO, top)):
        files.append(top)
      for root, dirs, names in os.walk(os.path.join(REPO, top)):
        dirs[:] = [d for d in dirs if not d.startswith(('.', '__'))]
        files += [os.path.relpath(os.path.join(root, n), REPO) for n in names]
  files += [d for d in DOCS if d not in files]
  here = os.path.relpath(os.path.abspath(__file__), REPO)
  return sorted(f for f in files if f.endswith(TEXT_SUFFIXES) and f != here
                and os.path.isfile(os.path.join(REPO, f)))


def test_no_bookkeeping_words_or_machine_paths():
  found = []
  for rel in shipped_files():
    for n, line in enumerate(read(rel).splitlines(), 1):
      line = ALLOWED.sub('', line)
      if VOCABULARY.search(line) or MACHINE_PATH.search(line):
        found.append(f'{rel}:{n}: {line.strip()[:100]}')
  assert not found, 'say the reason, not the story:\n' + '\n'.join(found)


def test_the_checks_can_fail():
  """The helpers above find what they are meant to find."""
  spans = code_spans('run `python scripts/train.py --config configs/tiny.py --nope` and\n'
                     '```bash\nmtp-decode --workdir runs/x \\\n  --bogus 1\n```\n')
  found = [c for s in spans for c in commands(s)]
  assert ('scripts/train.py', ['--config', '--nope']) in found
  assert ('mtp-decode', ['--workdir', '--bogus']) in found
  assert '--workdir' in flags_of('scripts/train.py') and '--nope' not in flags_of('mtp-train')
  from mtp_jax.commands import train  # argparse only, no JAX
  real = {s for action in train.parser()._actions for s in action.option_strings}
  assert real == flags_of('mtp-train') == flags_of('scripts/train.py')
  assert config_key_exists('model.mtp.depth') and not config_key_exists('model.mtp.deepth')
  assert VOCABULARY.search('fixed in ' + 'issue 7') and MACHINE_PATH.search(' /' + 'tmp/x')
  assert not VOCABULARY.search("@pytest.fixture(scope='session')".replace(
      "scope='session'", ''))
  assert slug('What the `main` job does (M = 3)') == 'what-the-main-job-does-m--3'


# -- shape suffixes: the keys of docs/design.md's table -----------------------------------------
SUFFIX = re.compile(r'^[a-z][a-z0-9_]*?_([A-Z0-9][A-Za-z0-9]*(?:x[A-Za-z0-9]*)*)$')
KEY = re.compile(r'[A-Z][a-z]*\d*')


def shape_keys() -> set:
  """Every key the dimension-key table of docs/design.md defines."""
  with open(os.path.join(DOCS_DIR, 'design.md'), encoding='utf-8') as f:
    rows = [line for line in f if line.startswith('| `')]
  return {k for row in rows for k in re.findall(r'`([A-Z][A-Za-z0-9]*)`', row)}


def suffix_problem(suffix: str, keys: set) -> str:
  """'' when every axis of a suffix is a key, a product of keys, a number or a number times
  a key (a trailing x: the axes past it unnamed); else what is wrong."""
  parts = suffix.split('x')
  for i, part in enumerate(parts):
    if part == '' and i == len(parts) - 1 and i > 0:
      continue
    m = re.fullmatch(r'(\d*)((?:[A-Z][a-z]*\d*)*)', part)
    if not m or not part:
      return f'{part!r} is not a key'
    unknown = [k for k in KEY.findall(m.group(2)) if k not in keys]
    if unknown:
      return f'{unknown} not in the table'
  return ''


def test_shape_suffixes_use_the_design_table_keys():
  """x_BxTxD, idx_BTxEk, ...: each axis of a name's shape suffix in the package, the tests
  and the benchmarks is a key of docs/design.md's table (or a product, a number, a multiple
  of them)."""
  keys = shape_keys()
  assert {'B', 'T', 'D', 'V', 'M', 'M1', 'Hv', 'Ek', 'BTEk'} <= keys and 'Q' not in keys
  bad = []
  for root, _, files in (w for top in SHAPE_TREES[:3] for w in os.walk(os.path.join(REPO, top))):
    for name in files:
      if not name.endswith('.py'):
        continue
      path = os.path.join(root, name)
      with open(path, encoding='utf-8') as f:
        tree = ast.parse(f.read())
      for node in ast.walk(tree):
        ident = (node.id if isinstance(node, ast.Name) else node.arg if isinstance(node, ast.arg)
                 else node.attr if isinstance(node, ast.Attribute) else None)
        m = SUFFIX.match(ident or '')
        if m and not m.group(1).islower() and suffix_problem(m.group(1), keys):
          bad.append(f'{os.path.relpath(path, REPO)}:{node.lineno} {ident}: '
                     f'{suffix_problem(m.group(1), keys)}')
  assert not sorted(set(bad)), '\n'.join(sorted(set(bad)))


# -- bracketed shapes in comments, docstrings and docs: [B, T, D], [M1, D, V], [B, A+1] --------
BRACKET = re.compile(r'\[([^\[\]\n]{1,80})\](?![(\[])')
AXIS_TERM = re.compile(r'\d+|\.{1,3}|[A-Z][A-Za-z0-9]*|[a-z][a-z0-9_]*|[()+*/ -]')
SHAPE_TREES = ('mtp_jax', 'tests', 'benchmarks', 'docs')


def shape_problem(text: str, keys: set) -> str:
  """'' when `text` (inside brackets) is no shape, or a shape whose capital axis names are
  all keys of the table (or products of keys); else what is wrong. A shape is axes split by
  commas, each numbers, lowercase names, keys and + - * / ( ); a lone axis counts when it is
  capitals or sums one (`[B]`, `[M1]`, `[M+1]`). Regex classes (`[A-Z]`) are no shape."""
  axes = [a.strip() for a in text.split(',')]
  if not all(axes) or '--' in text or re.search(r'\w-\w', text):
    return ''
  terms = [AXIS_TERM.findall(a) for a in axes]
  if any(''.join(t) != a for t, a in zip(terms, axes)):
    return ''
  names = [t for ts in terms for t in ts if t[0].isupper()]
  if not names or (len(axes) == 1 and not re.fullmatch(r'[A-Z0-9]+|.*[+-].*', axes[0])):
    return ''
  for name in names:
    if not re.fullmatch(r'(?:[A-Z][a-z]*\d*)+', name):
      return f'{name!r} is not a key'
    unknown = [k for k in KEY.findall(name) if k not in keys]
    if unknown:
      return f'{unknown} not in the table'
  if 'd' in (t for ts in terms for t in ts):
    return "'d': the residual width is D"
  if re.search(r'\bD ?[+-] ?\d', text):
    return 'D counts no depths: M depths, A drafts'
  return ''


def prose_lines(rel: str):
  """(line number, text) of a file's comments and strings (.py) or of all its lines (.md)."""
  src = read(rel)
  if rel.endswith('.md'):
    yield from enumerate(src.splitlines(), 1)
    return
  for tok in tokenize.generate_tokens(io.StringIO(src).readline):
    if tok.type in (tokenize.COMMENT, tokenize.STRING):
      for i, line in enumerate(tok.string.splitlines()):
        yield tok.start[0] + i, line


def test_bracketed_shapes_use_the_design_table_keys():
  """[B, T, D], [M1, D, V], [B, A+1]: each axis a comment, docstring or doc page writes in
  brackets, over the package, the tests, the benchmarks and the docs, is named with the keys
  of docs/design.md's table."""
  keys = shape_keys()
  bad = []
  for top in SHAPE_TREES:
    for root, dirs, files in os.walk(os.path.join(REPO, top)):
      dirs[:] = [d for d in dirs if not d.startswith(('.', '__'))]
      for name in sorted(files):
        if not name.endswith(('.py', '.md')):
          continue
        rel = os.path.relpath(os.path.join(root, name), REPO)
        for n, line in prose_lines(rel):
          for m in BRACKET.finditer(line):
            problem = shape_problem(m.group(1), keys)
            if problem:
              bad.append(f'{rel}:{n} [{m.group(1)}]: {problem}')
  assert not bad, '\n'.join(bad)


def test_the_bracket_check_can_fail():
  keys = {'B', 'T', 'D', 'V', 'M', 'M1', 'A', 'Ek', 'N', 'H'}
  for shape in ('B, T, D', 'M1, B, T, V', 'B, A+1', 'M+1', 'BT, Ek, D', 'B, T, N, H', 'B',
                '(M+1) B T, V', 'n, B, chunk, ...', 'A-Z', 'A-Za-z0-9_', '--top_k K',
                'free-running acceptance per depth, greedy and T = 1', 'TAU_KEY', 'Training'):
    assert not shape_problem(shape, keys), shape
  assert 'not in the table' in shape_problem('B, T, H, Q', keys)
  assert 'not in the table' in shape_problem('Q, N, K', keys)
  assert 'not in the table' in shape_problem('X', keys)
  assert 'the residual width is D' in shape_problem('B, T, d', keys)
  assert 'not in the table' in shape_problem('1, Z+1', keys)
  assert 'M depths' in shape_problem('D+1', keys) and 'M depths' in shape_problem('B, D - 1', keys)


def test_the_suffix_check_can_fail():
  keys = {'B', 'T', 'D', 'Ek', 'M1'}
  assert not suffix_problem('BxTxD', keys) and not suffix_problem('BTxEk', keys)
  assert not suffix_problem('Bx1xT', keys) and not suffix_problem('M1xBx', keys)
  assert 'not in the table' in suffix_problem('BxQxD', keys)
  assert 'not in the table' in suffix_problem('NKxD', keys)
  assert 'is not a key' in suffix_problem('Bxx', keys)
