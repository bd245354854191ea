"""Training: the loop, the compiled steps, the multi-depth loss, evaluation, metrics,
FLOP counts, the failure policies, and ahead-of-time compiles for a slice (aot/).

- loop.py: `train_and_evaluate(config, workdir)`, resume or start, eval, checkpoints.
- start.py: a run's start before its state is built: its checks, the workdir's lock,
  --init_from's source (`InitSource`), and the undo of a start that fails.
- steps.py: the jitted train and eval steps and `setup`, which builds them on the mesh.
- loss.py: targets, masks and the weighted loss over the MTP depths; head_sums.py: the
  heads' cross-entropy sums, whole or in sequence chunks.
- evaluation.py: teacher-forced and decoding evaluation of a workdir.
- metrics.py, flops.py, resilience.py: log lines and writers, FLOPs per token, workdir
  locks, preemption and non-finite steps.
- watchdog.py, goodput.py: the step-time watchdog (stack dumps of a stalled run), and where
  a run's time went across restarts, with each host's step time.

Public names load lazily, so `from mtp_jax.train import metrics` (plots read it without
JAX) does not import the loop.
"""
from mtp_jax.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    'MetricWriter': 'metrics',
    'StepArgs': 'steps',
    'TrainSetup': 'steps',
    'eval_step': 'steps',
    'evaluate_workdir': 'evaluation',
    'flops_per_token': 'flops',
    'loss_and_metrics': 'loss',
    'setup': 'steps',
    'train_and_evaluate': 'loop',
    'train_step': 'steps',
})
