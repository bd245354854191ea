"""The train state: the model and its optimizer, built, initialised on the mesh, restored.

- optimizer.py: AdamW with warmup + cosine and global-norm clipping (`build_optimizer`,
  `lr_schedule`), and `trainable`, the parameters it updates.
- state.py: `create_model_and_optimizer`, `abstract_train_state`, and `init_state`, which
  builds both straight onto the mesh (no full-size host copy).
- restore.py: `restore_model` / `restore_model_at`, the model of a workdir's checkpoint.
- init_from.py: `InitFrom`, the `--init_from` flag parsed once (`hf:DIR` or a checkpoint).

It sits above both `mtp_jax.model` and `mtp_jax.checkpoint`, which know nothing of each other.
"""
from mtp_jax.train_state.init_from import HF_PREFIX, InitFrom
from mtp_jax.train_state.optimizer import build_optimizer, lr_schedule, trainable
from mtp_jax.train_state.restore import restore_model, restore_model_at
from mtp_jax.train_state.state import abstract_train_state, create_model_and_optimizer, init_state

__all__ = [
    'HF_PREFIX', 'InitFrom', 'abstract_train_state', 'build_optimizer',
    'create_model_and_optimizer', 'init_state', 'lr_schedule', 'restore_model',
    'restore_model_at', 'trainable',
]
