"""train/step_profile.py: a traced train step's time by op kind and region, read from the
jax.profiler trace and the compiled module's HLO."""
import jax
import pytest

import helpers
from mtp_jax.train import step_profile


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_a_traced_step_adds_up_by_kind_and_region(dtype, tmp_path):
  compiled, state, gbatch = helpers.compiled_tiny_step(dtype, depth=1)
  held = {'state': state}

  def step():  # the step donates its state: each call takes the last one's
    held['state'], metrics = compiled(held['state'], gbatch)
    jax.block_until_ready(metrics)
  step()
  path = step_profile.trace_run(step, str(tmp_path))
  b = step_profile.breakdown(path, compiled.as_text())
  assert b['step_s'] > 0 and b['threads'] >= 1
  # the kinds (host gap included) add up to the step's span, when ops did not oversubscribe
  assert sum(b['by_kind'].values()) == pytest.approx(b['step_s'], rel=1e-6) or (
      b['by_kind']['host gap'] == 0)
  form = 'matmul: bf16 kernels' if dtype == 'bfloat16' else 'matmul: f32 x f32 -> f32'
  assert b['by_kind'].get(form, 0) > 0, b['by_kind']
  assert 0 < b['matmul_share'] < 1
  # the named scopes reach the ops, forward and backward: every region ran matmuls or more
  regions = b['by_region']
  for region in ('attention core', 'loss head', 'optimizer', step_profile.OTHER_REGION):
    assert sum(regions.get(region, {}).values()) > 0, (region, regions)
  assert regions['attention core'].get('matmul', 0) > 0
  assert regions['optimizer'].get('matmul', 0) == 0
  text = step_profile.format_breakdown(b)
  assert form in text and 'host gap' in text


def test_classify_reads_dot_forms_and_scopes():
  hlo = '''HloModule m

%fused (p0: bf16[8,4], p1: bf16[4,2]) -> f32[8,2] {
  %p0 = bf16[8,4]{1,0} parameter(0)
  %p1 = bf16[4,2]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%conv (p0: f32[8,4]) -> bf16[8,4] {
  %p0 = f32[8,4]{1,0} parameter(0)
  ROOT %c = bf16[8,4]{1,0} convert(%p0)
}

ENTRY %main (a: f32[8,4], b: bf16[4,2]) -> f32[8,2] {
  %a = f32[8,4]{1,0} parameter(0)
  %b = bf16[4,2]{1,0} parameter(1)
  %cv = bf16[8,4]{1,0} fusion(%a), kind=kLoop, calls=%conv, metadata={op_name="jit(f)/loss_head/convert"}
  ROOT %ynn = f32[8,2]{1,0} fusion(%cv, %b), kind=kCustom, calls=%fused, metadata={op_name="jit(f)/transpose(jvp(attention_core))/dot_general"}
}
'''
  kinds = step_profile.classify(hlo)
  assert kinds['ynn'] == ('matmul: bf16 kernels', 'attention core')
  assert kinds['cv'] == ('convert', 'loss head')
  assert kinds['a'] == ('copy / transpose', step_profile.OTHER_REGION)
