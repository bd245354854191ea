"""Research on top of training: ablation sweeps, their statistics and plots, held-out
evaluation sets, and self-distillation data.

- sweep.py: `Sweep`, seeded runs of config variants with their evaluations.
- ablation.py: mtp-ablation's sweep (its runs, designs and declarations).
- studies.py: the studies' config files and the decode benchmark, read when first asked.
- tables.py, families.py, markdown.py: the tables, the tests of their declared families
  (exact, equivalence, Holm per family and over all), and their markdown.
- design.py, stats.py: how many seeds and tokens a comparison needs, the declared families,
  margins and studies; Welch, paired, sign-flip and equivalence tests.
- heldout.py: held-out documents and prompts.
- results.py, plotting.py: stored results and the figures drawn from them.
- distill.py: `self_distill`, training data sampled from a model.

Public names load lazily: `stats` (numpy and scipy only) is read before JAX starts.
"""
from mtp_jax.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    'HeldoutRule': 'heldout',
    'Run': 'sweep',
    'Sweep': 'sweep',
    'load_results': 'results',
    'paired': 'stats',
    'plot_run': 'plotting',
    'plot_sweep': 'plotting',
    'save_result': 'results',
    'self_distill': 'distill',
    'welch': 'stats',
})
