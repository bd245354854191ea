"""Every notebook runs top to bottom on a fresh install (tiny settings via environment)."""
import os

import nbformat
import pytest
from nbclient import NotebookClient

from helpers import REPO

NOTEBOOKS = sorted(f for f in os.listdir(os.path.join(REPO, 'notebooks')) if f.endswith('.ipynb'))


@pytest.mark.parametrize('name', NOTEBOOKS)
def test_notebook_runs(name, tiny_run, stdlib_data_dir, monkeypatch, tmp_path):
  workdir, _ = tiny_run
  monkeypatch.setenv('MTP_WORKDIR', str(workdir))
  monkeypatch.setenv('MTP_DATA_DIR', stdlib_data_dir)
  monkeypatch.setenv('XLA_FLAGS', '')
  nb = nbformat.read(os.path.join(REPO, 'notebooks', name), as_version=4)
  NotebookClient(nb, timeout=600, kernel_name='python3',
                 resources={'metadata': {'path': os.path.join(REPO, 'notebooks')}}).execute()
  errors = [o for c in nb.cells if c.cell_type == 'code' for o in c.get('outputs', [])
            if o.get('output_type') == 'error']
  assert not errors
  assert any(o.get('output_type') in ('display_data', 'execute_result') or o.get('text')
             for c in nb.cells if c.cell_type == 'code' for o in c.get('outputs', []))
