"""The train state: the model and its optimizer, built, initialised on the mesh, restored.

- optimizer.py: AdamW with warmup + cosine and global-norm clipping (`build_optimizer`,
  `lr_schedule`), and `trainable`, the parameters it updates.
- state.py: `create_model_and_optimizer`, `abstract_train_state`, and `init_state`, which
  builds both straight onto the mesh (no full-size host copy).
- restore.py: `restore_model` / `restore_model_at`, the model of a workdir's checkpoint.
- init_from.py: `InitFrom`, the `--init_from` flag parsed once (`hf:DIR` or a checkpoint).

It sits above both `mtp_jax.model` and `mtp_jax.checkpoint`, which know nothing of each other.

Public names load lazily (mtp_jax/exports.py), as in every sub-package.
"""
from mtp_jax.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    'HF_PREFIX': 'init_from',
    'InitFrom': 'init_from',
    'abstract_train_state': 'state',
    'build_optimizer': 'optimizer',
    'create_model_and_optimizer': 'state',
    'init_state': 'state',
    'lr_schedule': 'optimizer',
    'restore_model': 'restore',
    'restore_model_at': 'restore',
    'trainable': 'optimizer',
})
