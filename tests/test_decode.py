"""Self-speculative decoding (docs/design.md §5): every property of the decoder is a test here.

Models are tiny and share compiled programs (the compile cache is keyed by model
structure, so the random-init and the trained model run the same executables).
"""
import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats as sps

from helpers import (
  MAX_NEW,
  REPO,
  byte_config,
  byte_ids,
  dsv3_model_config,
  tiny_model_config,
  train_word_model,
  word_prompts,
  word_text,
)
from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import cli, train_state
from mtp_jax.commands import decode as decode_command
from mtp_jax.data import tokenizers
from mtp_jax.decode import acceptance as acceptance_lib
from mtp_jax.decode import cost as cost_lib
from mtp_jax.decode import decoder as decode
from mtp_jax.decode import generate
from mtp_jax.decode import picker as picker_lib
from mtp_jax.decode import program as program_lib
from mtp_jax.decode import sampling as sampling_lib
from mtp_jax.decode import tree as tree_lib
from mtp_jax.model import decode_ops
from mtp_jax.model.mtp import ModelArgs, MTPModel, shift_left
from mtp_jax.runtime import peak as peak_lib


def build(config, seed=0):
  return MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(config)), rngs=nnx.Rngs(seed))


def random_prompts(n, seed):
  rng = np.random.default_rng(seed)
  return [list(rng.integers(2, 258, size=1 + (i * 7) % 16)) for i in range(n)]


def spec_equals_ar(dec, prompts, max_new=MAX_NEW, eos_id=None, ar_decoder=None, **spec):
  """(AR result, speculative result) of `dec`, the speculative tokens asserted equal to the
  AR ones (ar_decoder's, default dec's) row by row, its counters checked."""
  ar = (ar_decoder or dec).generate(prompts, max_new, num_drafts=0, eos_id=eos_id)
  sp = dec.generate(prompts, max_new, eos_id=eos_id, **spec)
  for i, (a, s) in enumerate(zip(ar.tokens, sp.tokens)):
    np.testing.assert_array_equal(s, a, err_msg=f'row {i}')
  check_stats(sp, max_new)
  return ar, sp


def check_stats(r: decode.DecodeResult, max_new):
  """tau = committed / verify steps, in [1, A+1]; the counters agree with the tokens."""
  s = r.stats()
  d = r.num_drafts
  assert 1.0 <= s['mean_accepted_length'] <= d + 1
  assert s['committed'] / s['verify_steps'] == pytest.approx(s['mean_accepted_length'])
  np.testing.assert_array_equal(r.accepted.sum(1), r.verify_steps)
  for i, t in enumerate(r.tokens):
    assert 1 <= len(t) <= np.broadcast_to(max_new, len(r.tokens))[i]
    assert r.committed[i] == len(t) - 1  # the first token comes from the prefill
    if r.verify_steps[i]:
      assert 1 <= r.committed[i] / r.verify_steps[i] <= d + 1
  at_least = [r.accepted[:, k:].sum() / max(r.verify_steps.sum(), 1) for k in range(1, d + 1)]
  np.testing.assert_allclose(s['acceptance_per_depth'], at_least)
  assert all(a >= b for a, b in zip(at_least, at_least[1:]))


# -- models ----------------------------------------------------------------------------------
@pytest.fixture(scope='session')
def random_model():
  return build(byte_config(3))


@pytest.fixture(scope='session')
def models(random_model, trained):
  return {'random': random_model, 'trained': trained[0]}


def _model_forward(model, tokens_BxT, query_B):
  """Uncached teacher-forced forward: argmax of every depth at position query_B."""
  hs = model(tokens_BxT)
  rows = jnp.arange(tokens_BxT.shape[0])
  return jnp.stack([jnp.argmax(model.logits(h[rows, query_B][:, None], k)[:, 0], -1)
                    for k, h in enumerate(hs)], 1)


_uncached = nnx.jit(_model_forward)


def uncached_argmax(model, seqs, queries, width=64):
  """_model_forward over token lists, padded to [multiple of 128, width] (few compiles)."""
  n = len(seqs)
  rows = -(-n // 128) * 128
  assert max(map(len, seqs)) <= width
  tokens = np.zeros((rows, width), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  q = np.zeros((rows,), np.int32)
  q[:n] = queries
  return np.asarray(_uncached(model, jnp.asarray(tokens), jnp.asarray(q)))[:n]


def uncached_greedy(model, prompts, max_new):
  """Greedy decoding by full forward passes, no cache at all."""
  seqs = [list(p) for p in prompts]
  for _ in range(max_new):
    nxt = uncached_argmax(model, seqs, [len(s) - 1 for s in seqs])[:, 0]
    for s, t in zip(seqs, nxt):
      s.append(int(t))
  return [np.array(s[len(p):]) for p, s in zip(prompts, seqs)]


# -- the decoder's forward -----------------------------------------------------------------------
@functools.partial(nnx.jit, static_argnums=2)
def _chunked_forward(model, tokens_BxT, layout='heads_major'):
  """The decoder's cached forward over chunks of 3 then 9 tokens, every depth."""
  b, t = tokens_BxT.shape
  prog = decode.Program(b, 16, 16, model.args.mtp_depth, True, layout=layout)
  cache = lambda: decode_ops.empty_cache(model.args, b, prog.cache_len, layout)  # noqa: E731
  main = tuple(cache() for _ in model.layers)
  mtp = [cache() for _ in model.mtp]
  outs = [[] for _ in range(model.args.mtp_depth + 1)]
  for start, width in [(0, 3), (3, 9)]:  # 3b and 9b rows: tall-skinny (the prefill: GEMM)
    s = jnp.full((b,), start, jnp.int32)
    h, main = program_lib._main_pass(prog, model, tokens_BxT[:, start:start + width], s, main)
    outs[0].append(h)
    pos, mask = program_lib._window(prog, s, width)
    for k in range(1, model.args.mtp_depth + 1):
      shifted = shift_left(tokens_BxT, k)[:, start:start + width]
      h, mtp[k - 1] = model.decode_mtp_step(k, h, shifted, pos, mask, mtp[k - 1],
                                            s + prog.offset, layout)
      outs[k].append(h)
  return [jnp.concatenate(o, 1) for o in outs]


@pytest.mark.parametrize('batch,layout', [(1, 'heads_major'), (2, 'heads_major'), (2, 'bskh')])
def test_decode_forward_matches_the_model(models, batch, layout):
  """The layers' decode path (both cache layouts, the decode weight layout, tall-skinny
  products of 3-18 rows) == the model's forward."""
  model = models['trained']
  rng = np.random.default_rng(21)
  tokens = jnp.asarray([byte_ids(word_text(rng, 12)[:12]) for _ in range(batch)], jnp.int32)
  want = model(tokens)
  got = _chunked_forward(model.for_decoding(layout), tokens, layout)
  for k, (w, g) in enumerate(zip(want, got)):
    n = 12 - k  # depth k reads t_{i+k}: the last k positions see padding
    np.testing.assert_allclose(np.asarray(g)[:, :n], np.asarray(w)[:, :n], atol=2e-5, rtol=1e-4,
                               err_msg=f'depth {k}')


# -- lossless greedy -------------------------------------------------------------------------
@pytest.mark.parametrize('name', ['random', 'trained'])
@pytest.mark.parametrize('num_drafts', [1, 2, 3])
def test_lossless_greedy(models, name, num_drafts):
  """Speculative greedy == autoregressive greedy, token for token, on 16 prompts."""
  dec = decode.Decoder(models[name])
  make = word_prompts if name == 'trained' else random_prompts
  for batch in range(2):
    prompts = make(8, seed=batch)
    ar = dec.generate(prompts, MAX_NEW, num_drafts=0, eos_id=None)
    sp = dec.generate(prompts, MAX_NEW, num_drafts=num_drafts, eos_id=None)
    for i, (a, s) in enumerate(zip(ar.tokens, sp.tokens)):
      np.testing.assert_array_equal(s, a, err_msg=f'row {i}')
      assert len(a) == MAX_NEW
    check_stats(sp, MAX_NEW)
  tau = sp.stats()['mean_accepted_length']
  if name == 'trained':  # the premise of the "high acceptance" half
    assert tau > 1 + 0.5 * num_drafts, sp.stats()
  else:
    assert tau < 1.5, sp.stats()


@pytest.mark.parametrize('weights,num_drafts', [('bfloat16', 3), ('float32', 5),
                                                 ('bfloat16', 5)])
def test_lossless_greedy_bf16_and_recursive(models, weights, num_drafts):
  """bf16 weights: speculative greedy == AR greedy with the same bf16 weights. Drafts past
  the depth (the last MTP module run again) are lossless too, and accepted."""
  dec = decode.Decoder(models['trained'], weight_dtype=weights)
  prompts = word_prompts(8, seed=1)
  ar, sp = spec_equals_ar(dec, prompts, num_drafts=num_drafts, record=True)
  assert sp.stats()['mean_accepted_length'] > 2.0, sp.stats()
  if num_drafts > models['trained'].args.mtp_depth:  # a recursive draft was accepted
    assert sp.accepted[:, models['trained'].args.mtp_depth + 1:].sum() > 0, sp.accepted.sum(0)
  if weights == 'bfloat16':  # the bf16 program really reads bf16 weights, and still decodes
    assert dec.params['embed']['embedding'][...].dtype == jnp.bfloat16
    f32 = decode.Decoder(models['trained']).generate(prompts, MAX_NEW, num_drafts=0, eos_id=None)
    same = np.mean([np.mean(a == b) for a, b in zip(ar.tokens, f32.tokens)])
    assert same > 0.5, same


@pytest.mark.parametrize('threshold', [0.6, 0.95])
def test_adaptive_draft_length_is_lossless(models, threshold):
  """Confidence-adaptive draft length: greedy == AR, drafts == the uncached chain's, and
  the verify window really narrows (rows per iteration below A + 1) on some iterations."""
  model = models['trained']
  dec = decode.Decoder(model)
  prompts = word_prompts(8, seed=2)
  _, sp = spec_equals_ar(dec, prompts, draft_threshold=threshold, record=True)
  st = sp.stats()
  d = model.args.mtp_depth
  assert 1 <= st['verify_rows_per_iteration'] < d + 1, st
  assert st['mean_accepted_length'] > 1.5, st  # confident drafts are still proposed
  check_drafts(model, prompts, sp)
  full = dec.generate(prompts, MAX_NEW, eos_id=None).stats()
  assert full['verify_rows_per_iteration'] == d + 1


def test_eos_and_max_new_inside_accepted_blocks(models):
  """Rows stop at EOS or their own max_new_tokens in the middle of an accepted block."""
  dec = decode.Decoder(models['trained'])
  prompts = word_prompts(8, seed=5)
  max_new = [5, 7, 9, 11, 13, 17, 19, 23]
  eos = byte_ids('j')[0]  # the last letter of 'hij': reached by accepted drafts
  ar, sp = spec_equals_ar(dec, prompts, max_new, eos_id=eos, pad_to=(1, MAX_NEW))
  ended_eos = np.array([len(t) > 0 and t[-1] == eos for t in sp.tokens])
  ended_len = np.array([len(t) == m for t, m in zip(sp.tokens, max_new)]) & ~ended_eos
  # dropped > 0: the stop came before the end of the block the verifier accepted.
  assert np.any(ended_eos & (sp.dropped > 0)), (ended_eos, sp.dropped)
  assert np.any(ended_len & (sp.dropped > 0)), (ended_len, sp.dropped)
  assert ar.dropped.sum() == 0  # one token per step: nothing to drop


def test_prompt_lengths_share_one_program(models):
  """Prompt lengths inside one bucket (and max_new_tokens inside one) reuse the program."""
  dec = decode.Decoder(models['random'])
  dec.generate(random_prompts(8, seed=0), MAX_NEW, eos_id=None)
  before = len(decode._COMPILED)
  for n in (1, 5, 16):
    dec.generate([[7] * n] * 8, MAX_NEW - 3, eos_id=None)
  assert len(decode._COMPILED) == before
  assert decode.bucket(16) == 16 and decode.bucket(17) == 32


# -- drafts, batches, other model kinds --------------------------------------------------------
def check_drafts(model, prompts, result):
  """Every recorded draft == argmax of an uncached forward of the MTP chain.

  The reference runs the teacher-forced model over [committed prefix ; d_1..d_{A-1}]:
  depth k at position n-2 reads t_{n-2+k}, i.e. x for k = 1 and the drafts after it.
  """
  d = result.num_drafts
  seqs, queries, want = [], [], []
  for it in range(result.steps):
    for row, n in enumerate(result.history_length[it]):
      if n < 0:
        continue
      full = list(prompts[row]) + list(result.tokens[row])
      seqs.append(full[:n] + list(result.history_drafts[it, row, :d - 1]))
      queries.append(n - 2)  # n >= 2: a prompt token and x
      want.append(result.history_drafts[it, row])
  got = uncached_argmax(model, seqs, queries)[:, 1:d + 1]
  np.testing.assert_array_equal(got, np.array(want))
  return len(seqs)


@pytest.mark.parametrize('name', ['random', 'trained'])
def test_draft_consistency(models, name):
  """In-loop drafts equal the uncached chain's, across rejections (no stale MTP caches)."""
  dec = decode.Decoder(models[name])
  prompts = (word_prompts if name == 'trained' else random_prompts)(8, seed=3)
  r = dec.generate(prompts, MAX_NEW, eos_id=None, record=True)
  hist = r.accepted.sum(0)
  assert hist[0] > 0, hist  # rejections happened
  if name == 'trained':
    assert hist[1:].sum() > 0 and hist[-1] > 0, hist  # partial and full acceptances too
  assert check_drafts(models[name], prompts, r) > 50


def test_batch_independence(models):
  """Each row of a batched call equals decoding that row alone (tokens and counts)."""
  dec = decode.Decoder(models['trained'])
  prompts = word_prompts(8, seed=7)
  batched = dec.generate(prompts, MAX_NEW, eos_id=byte_ids('z')[0])
  for i, p in enumerate(prompts):
    alone = dec.generate([p], MAX_NEW, eos_id=byte_ids('z')[0])
    np.testing.assert_array_equal(alone.tokens[0], batched.tokens[i])
    assert alone.verify_steps[0] == batched.verify_steps[i]
    np.testing.assert_array_equal(alone.accepted[0], batched.accepted[i])
  assert len({int(v) for v in batched.verify_steps}) > 1  # rows really differ


def test_parallel_heads_decode():
  """Parallel heads draft from h^0 without the chain: lossless and consistent too.

  Lossless is checked against uncached greedy decoding (== AR, see the next test).
  """
  model = build(byte_config(2, 'parallel'))
  prompts = random_prompts(8, seed=11)
  sp = decode.Decoder(model).generate(prompts, MAX_NEW, eos_id=None, record=True)
  for a, s in zip(uncached_greedy(model, prompts, MAX_NEW), sp.tokens):
    np.testing.assert_array_equal(s, a)
  check_stats(sp, MAX_NEW)
  check_drafts(model, prompts, sp)


def test_autoregressive_matches_uncached_greedy_and_depth_zero():
  """The cache code itself: AR decoding of a M = 0 model == argmax of full forwards."""
  model = build(byte_config(0))
  dec = decode.Decoder(model)
  prompts = random_prompts(8, seed=13)
  r = dec.generate(prompts, MAX_NEW, eos_id=None)
  assert r.num_drafts == 0 and r.stats()['mean_accepted_length'] == 1.0
  for want, got in zip(uncached_greedy(model, prompts, MAX_NEW), r.tokens):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(cli.RequestError, match='num_drafts'):
    dec.program(1, 4, 4, num_drafts=1)


# -- MLA + MoE blocks (DeepSeek-V3's layout) ---------------------------------------------------
@pytest.fixture(scope='session')
def mla_moe_model(devices, tmp_path_factory):
  """MLA everywhere, layer 0 dense, MoE in layer 1 and the M = 2 MTP blocks, trained
  briefly on the word language (so that drafts are accepted, partly and fully)."""
  config = dsv3_model_config(2)
  config.model.vocab_size = 0  # the byte tokenizer's, as byte_config
  return train_word_model(devices, tmp_path_factory, config)[0]


@pytest.mark.slow  # ~25 s each on a loaded 2-core box (+ 15-60 s training, once)
@pytest.mark.parametrize('layout', ['heads_major', 'bskh'])
def test_mla_moe_lossless_greedy(mla_moe_model, layout):
  """MLA + MoE trunk and MTP blocks, both cache layouts: speculative greedy == AR greedy
  on prompts of 1-16 tokens, AR == uncached greedy (the latent cache itself), the drafts
  == the uncached chain's, and every cache holds kv_lora_rank + qk_rope_head_dim numbers
  per position."""
  model = mla_moe_model
  dec = decode.Decoder(model, cache_layout=layout)
  prompts = word_prompts(8, seed=0)
  ar, sp = spec_equals_ar(dec, prompts, record=True)
  hist = sp.accepted.sum(0)
  assert hist[0] > 0 and hist[-1] > 0, hist  # rejections and full acceptances
  assert sp.stats()['mean_accepted_length'] > 1.5, sp.stats()
  check_drafts(model, prompts, sp)
  if layout == 'heads_major':
    for want, got in zip(uncached_greedy(model, prompts, MAX_NEW), ar.tokens):
      np.testing.assert_array_equal(got, want)
  copy = model.for_decoding(layout)
  caches = copy.trunk_caches(2, 40, layout) + copy.mtp_caches(3, 2, 40, layout)
  assert {c.shape for c in jax.tree.leaves(caches)} == {(2, 40, 8 + 4)}  # kvr + dr
  assert len(jax.tree.leaves(caches)) == model.args.n_layers + 3


@pytest.mark.slow  # ~25 s on a loaded 2-core box
def test_mla_moe_bf16_weights_lossless(mla_moe_model):
  """bf16 weights with MLA + MoE blocks: speculative greedy == AR greedy, same weights."""
  dec = decode.Decoder(mla_moe_model, weight_dtype='bfloat16')
  assert dec.params['layers'][0]['self_attn']['in_t'][...].dtype == jnp.bfloat16
  prompts = word_prompts(8, seed=1)
  _, sp = spec_equals_ar(dec, prompts)


# -- lossless sampling -----------------------------------------------------------------------
VOCAB = 8
SAMPLE_PROMPT = [3, 5, 2, 7]
N_SAMPLES = 8192


@pytest.fixture(scope='session')
def small_vocab_models():
  """M = 3 models over 8 tokens with random weights of a given scale (q far from p)."""
  cache = {}

  def get(scale, blocks='gqa'):
    if (scale, blocks) not in cache:
      if blocks == 'mla_moe':  # DeepSeek-V3's blocks (dsv3_model_config), same vocabulary
        config = dsv3_model_config(3)
        config.model.vocab_size = VOCAB
      else:
        config = tiny_model_config(3, vocab=VOCAB)
      model = build(config)
      state = nnx.state(model, nnx.Param)
      rng = np.random.default_rng(1)
      params = jax.tree.map(lambda x: (rng.normal(size=x.shape) * (scale if x.ndim > 1 else 0.5)
                                       + (1.0 if x.ndim == 1 else 0.0)).astype(np.float32),
                            nnx.to_pure_dict(state))
      nnx.replace_by_pure_dict(state, params)
      nnx.update(model, state)
      cache[scale, blocks] = model
    return cache[scale, blocks]
  return get


@nnx.jit
def _continuation_logprobs(model, tokens, sampling):
  """Main model's adjusted log-probs of t_1..t_4, and heads 1..3's at the prompt's end."""
  p, m = len(SAMPLE_PROMPT), 4
  hs = model(tokens)
  main = sampling_lib.adjusted_logprobs(model.logits(hs[0][:, p - 1:p - 1 + m], 0), sampling)
  heads = [sampling_lib.adjusted_logprobs(model.logits(hs[k][:, p - 1:p], k)[:, 0], sampling)
           for k in range(1, m)]
  return main, jnp.stack(heads, 1)


def exact_joint(model, sampling, m=4):
  """P(t_1..t_m) under plain sampling, and under the drafts' chain without verification."""
  conts = np.stack(np.meshgrid(*[np.arange(VOCAB)] * m, indexing='ij'), -1).reshape(-1, m)
  tokens = np.concatenate([np.tile(SAMPLE_PROMPT, (len(conts), 1)), conts], 1).astype(np.int32)
  main, heads = (np.asarray(x, np.float64)
                 for x in _continuation_logprobs(model, jnp.asarray(tokens), sampling))
  rows = np.arange(len(conts))
  lp = sum(main[rows, j, conts[:, j]] for j in range(m))
  lq = main[rows, 0, conts[:, 0]] + sum(heads[rows, j - 1, conts[:, j]] for j in range(1, m))
  norm = lambda l: np.exp(l) / np.exp(l).sum()  # noqa: E731
  return norm(lp), norm(lq)


def chi2_pvalue(samples_BxT, probs):
  """Pearson chi-square goodness of fit; cells expecting < 5 counts are pooled."""
  idx = np.ravel_multi_index(samples_BxT.T, (VOCAB,) * samples_BxT.shape[1])
  counts = np.bincount(idx, minlength=len(probs))
  expected = probs * len(idx)
  big = expected >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  return sps.chisquare(obs, exp).pvalue


@pytest.mark.parametrize('setting', [
    dict(scale=0.15, temperature=1.0),
    dict(scale=0.15, temperature=0.8, top_k=5, top_p=0.9),
    dict(scale=0.1, temperature=1.0, draft_argmax=True),
    dict(scale=0.15, temperature=1.0, draft_threshold=0.25),
    pytest.param(dict(scale=0.15, temperature=1.0, blocks='mla_moe'),
                 marks=pytest.mark.slow),  # 8192 rows through MLA + MoE: ~40 s loaded
], ids=['sampled-drafts', 'sampled-drafts-topk-topp', 'argmax-drafts', 'adaptive-length',
        'mla-moe-sampled-drafts'])
def test_lossless_sampling(small_vocab_models, setting):
  """Chi-square: the first 4 sampled tokens (one full M = 3 block) follow plain sampling.

  Compared with the exact joint law (enumerated over all 8^4 continuations), for
  speculative decoding and, as a check of the harness, for plain AR sampling.
  """
  setting = dict(setting)
  model = small_vocab_models(setting.pop('scale'), setting.pop('blocks', 'gqa'))
  draft_argmax = setting.pop('draft_argmax', False)
  dec = decode.Decoder(model)
  sampling = sampling_lib.Sampling(jnp.float32(setting['temperature']),
                             jnp.int32(setting.get('top_k', 0)),
                             jnp.float32(setting.get('top_p', 1.0)))
  exact, unverified = exact_joint(model, sampling)
  prompts = [SAMPLE_PROMPT] * N_SAMPLES
  spec = dec.generate(prompts, 4, eos_id=None, seed=1, draft_argmax=draft_argmax, **setting)
  ar = dec.generate(prompts, 4, num_drafts=0, eos_id=None, seed=2, **setting)
  spec_x, ar_x = np.stack(spec.tokens), np.stack(ar.tokens)
  assert spec_x.shape == ar_x.shape == (N_SAMPLES, 4)
  acc = spec.stats()['acceptance_per_depth']
  assert 0.05 < acc[0] < 0.95 and acc[1] > 0.002, acc  # accept and reject paths both taken
  if setting.get('draft_threshold'):  # the stop was active: fewer drafts were proposed
    full = dec.generate(prompts, 4, eos_id=None, seed=1, temperature=setting['temperature'])
    assert acc[2] < 0.9 * full.stats()['acceptance_per_depth'][2], (acc, full.stats())
  assert chi2_pvalue(ar_x, exact) > 1e-3  # the harness: plain sampling fits its own law
  assert chi2_pvalue(spec_x, exact) > 1e-3
  # Power: the same test rejects the drafts' own (unverified) law by a wide margin.
  assert chi2_pvalue(spec_x, unverified) < 1e-9


def test_adjusted_logprobs_top_k_top_p():
  logits = jnp.log(jnp.array([0.4, 0.3, 0.2, 0.1]))
  s = lambda t, k, p: sampling_lib.Sampling(jnp.float32(t), jnp.int32(k), jnp.float32(p))  # noqa: E731
  probs = lambda *a: np.asarray(jnp.exp(sampling_lib.adjusted_logprobs(logits, s(*a))))  # noqa: E731
  np.testing.assert_allclose(probs(1, 0, 1.0), [0.4, 0.3, 0.2, 0.1], rtol=1e-6)
  np.testing.assert_allclose(probs(1, 2, 1.0), [4 / 7, 3 / 7, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(probs(1, 0, 0.65), [4 / 7, 3 / 7, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(probs(1, 0, 0.75), [4 / 9, 3 / 9, 2 / 9, 0], rtol=1e-6)
  np.testing.assert_allclose(probs(1, 0, 0.1), [1, 0, 0, 0], rtol=1e-6)
  hot = probs(0.5, 0, 1.0)
  np.testing.assert_allclose(hot, np.array([16, 9, 4, 1]) / 30, rtol=1e-5)


def test_top_k_top_p_thresholds_equal_a_sort():
  """The sort-free bitwise thresholds keep exactly what a float64 sort keeps.

  Rows with ties, -inf entries, negative and zero logits; k from 1 to past V. A top-p
  row whose cumulative mass lands within 1e-6 of p could round either way in float32,
  so those rows are left out of the comparison (and counted: almost none are).
  The -0.0 row checks the key folds -0.0 into +0.0 as float comparison does.
  """
  rng = np.random.default_rng(3)
  b, v = 64, 300
  x = rng.normal(size=(b, v)).astype(np.float32) * rng.uniform(0.3, 4, size=(b, 1))
  x[:16] = np.round(x[:16])  # many ties
  x[16:24, ::7] = -np.inf
  x[24, :] = 0.0  # all tied, with -0.0 among them
  x[24, ::2] = -0.0
  kept_k = np.asarray(jax.jit(sampling_lib._top_k_mask)(jnp.asarray(x), jnp.int32(1)))
  np.testing.assert_array_equal(kept_k, x >= x.max(-1, keepdims=True))
  for k in (2, 17, v - 1, v, v + 5):
    kept = np.asarray(jax.jit(sampling_lib._top_k_mask)(jnp.asarray(x), jnp.int32(min(k, v))))
    kth = -np.sort(-x.astype(np.float64), -1)[:, min(k, v) - 1:min(k, v)]
    np.testing.assert_array_equal(kept, x >= kth, err_msg=f'k={k}')
  probs = np.asarray(jax.nn.softmax(jnp.asarray(x), -1))
  checked = 0
  for top_p in (0.05, 0.5, 0.9, 0.999):
    kept = np.asarray(jax.jit(sampling_lib._top_p_mask)(jnp.asarray(probs), jnp.float32(top_p)))
    p64 = probs.astype(np.float64)
    desc = -np.sort(-p64, -1)
    before = np.cumsum(desc, -1) - desc
    n_kept = np.sum(before < top_p, -1)
    want = p64 >= desc[np.arange(b), n_kept - 1][:, None]
    last = np.arange(b), n_kept - 1  # the last kept sorted entry: before < top_p <= cumsum
    clear = np.minimum(abs(before[last] - top_p), abs(before[last] + desc[last] - top_p)) > 1e-6
    np.testing.assert_array_equal(kept[clear], want[clear], err_msg=f'top_p={top_p}')
    assert np.all(kept.sum(-1) >= 1)
    checked += clear.sum()
    sorted_kept = np.asarray(sampling_lib._sorted_top_p_mask(jnp.asarray(probs), top_p))
    np.testing.assert_array_equal(sorted_kept[clear], kept[clear])  # the A/B's baseline
  assert checked >= 0.9 * 4 * b, checked
  np.testing.assert_array_equal(sampling_lib._sorted_top_k_mask(jnp.asarray(x), 17),
                                sampling_lib._top_k_mask(jnp.asarray(x), jnp.int32(17)))


def test_categorical_inverse_cdf():
  """One uniform per row: draws follow the weights (unnormalized, with zeros), never a 0."""
  w = np.array([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5, 0.0], np.float32)
  keys = jax.random.split(jax.random.key(0), 40000)
  tok = np.asarray(jax.jit(sampling_lib.categorical)(keys, jnp.tile(w, (len(keys), 1))))
  counts = np.bincount(tok, minlength=len(w))
  assert counts[w == 0].sum() == 0
  w64 = w.astype(np.float64)
  assert sps.chisquare(counts[w > 0], w64[w > 0] / w64.sum() * len(tok)).pvalue > 1e-3
  # Static switches off == traced switches at their off values.
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 50)), jnp.float32)
  on = sampling_lib.Sampling(jnp.float32(0.7), jnp.int32(0), jnp.float32(1.0))
  off = sampling_lib.Sampling(jnp.float32(0.7), jnp.int32(0), jnp.float32(1.0),
                              use_top_k=False, use_top_p=False)
  np.testing.assert_allclose(sampling_lib.adjusted_probs(logits, off),
                             jnp.exp(sampling_lib.adjusted_logprobs(logits, on)), rtol=1e-5)


# -- the command line ----------------------------------------------------------------------------
SCRIPT = os.path.join(REPO, 'scripts', 'decode.py')


def _script():
  return decode_command


@pytest.fixture(scope='session')
def depth0_workdir(tmp_path_factory):
  """A workdir with a genuine checkpoint of a M = 0 model."""
  config = byte_config(0)
  model, optimizer = train_state.create_model_and_optimizer(tokenizers.resolve_vocab_size(config))
  workdir = str(tmp_path_factory.mktemp('depth0'))
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, 'checkpoints'), async_save=False)
  ckpt.save(1, nnx.state((model, optimizer)),
            meta={'step': 1, 'config': json.loads(config.to_json_best_effort())}, force=True)
  ckpt.close()
  return workdir


def test_cli_bad_input_exits_2(trained, depth0_workdir, tmp_path, capsys):
  """Each bad input: one line naming the problem, exit code 2, nothing compiled."""
  workdir = trained[1]
  empty = tmp_path / 'empty_run'
  (empty / 'checkpoints').mkdir(parents=True)
  blank = tmp_path / 'prompts.txt'
  blank.write_text('abc\n\ndef\n')
  base = ['--workdir', workdir, '--mode', 'spec']
  cases = [
      (base + ['--prompt', ''], 'empty'),
      (base + ['--prompts_file', str(blank)], 'line 2: empty prompt'),
      (base + ['--prompt', 'x' * 100], 'longer than the cache'),
      (base + ['--prompt', 'abc', '--max_new_tokens', '0'], 'max_new_tokens must be > 0'),
      (base + ['--prompt', 'abc', '--max_new_tokens', '-3'], 'max_new_tokens must be > 0'),
      (base + ['--prompt', 'abc', '--temperature', '-0.5'], 'temperature must be >= 0'),
      (base + ['--prompt', 'abc', '--top_p', '0'], 'top_p must be in'),
      (base + ['--prompt', 'abc', '--top_p', '1.5'], 'top_p must be in'),
      (['--workdir', depth0_workdir, '--mode', 'spec', '--prompt', 'abc'], 'depth = 0'),
      (['--workdir', str(empty), '--mode', 'ar', '--prompt', 'abc'], 'no checkpoint'),
      (['--workdir', str(tmp_path / 'nope'), '--mode', 'ar', '--prompt', 'abc'],
       'does not exist'),
      (base + ['--prompt', 'abc', '--prompts_file', str(blank)], 'exactly one of'),
      (['--workdir', workdir, '--prompt', 'abc', '--mode', 'fast'], '--mode'),
      (base + ['--prompt', 'abc', '--tree', '3,0'], 'candidates per depth must be'),
      (base + ['--prompt', 'abc', '--max_new_tokens', '8', '--tree', '1,1,1,1,1,1,1,1,1'],
       'exceeds the 8 drafts'),
  ]
  script = _script()
  compiled = len(decode._COMPILED)
  for argv, message in cases:
    try:
      code = script.main(argv)
    except SystemExit as e:  # argparse's own errors
      code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (argv, err)
    assert len(err) == 1 and err[0].startswith('error: ') and message in err[0], (argv, err)
  assert len(decode._COMPILED) == compiled


@pytest.mark.parametrize('training_auto', ['float32', 'bfloat16'])
def test_cli_compare_json(trained, capsys, monkeypatch, training_auto):
  """scripts/decode.py --mode compare --json on the trained checkpoint (in-process), with
  model.dtype left at 'auto' on a host where 'auto' trains in float32 and on one where it
  trains in bfloat16 (an AMX host): decoding resolves 'auto' to float32 on both, and the
  speculative output is plain decoding's."""
  monkeypatch.setenv(peak_lib.AUTO_ENV, training_auto)
  assert peak_lib.compute_dtype('auto', 'cpu', 'train').name == training_auto
  code = _script().main(['--workdir', trained[1], '--prompt', 'abc hij pq', '--max_new_tokens',
                         str(MAX_NEW), '--mode', 'compare', '--json'])
  assert code == 0
  out = json.loads(capsys.readouterr().out)
  for key in ('identical', 'ar_tokens_per_sec', 'spec_tokens_per_sec', 'speedup',
              'mean_accepted_length', 'acceptance_per_depth', 'verify_steps', 'new_tokens'):
    assert key in out, key
  assert out['identical'] is True and out['compute_dtype'] == 'float32'
  assert out['new_tokens'] == MAX_NEW and len(out['acceptance_per_depth']) == 3
  assert out['mean_accepted_length'] > 1.5
  assert out['spec_outputs'] == out['ar_outputs']
  assert out['spec_outputs'][0].startswith('r ')  # 'pq' -> 'pqr ' in the word language


def test_cli_tree_compare_json(trained, capsys):
  """--tree with --mode compare: AR, the chain and the tree on one prompt, the tree's
  tau, speed-ups and extra FLOPs per verify step in the summary."""
  code = _script().main(['--workdir', trained[1], '--prompt', 'abc hij pq', '--max_new_tokens',
                         str(MAX_NEW), '--mode', 'compare', '--tree', '2,2,1', '--json'])
  assert code == 0
  out = json.loads(capsys.readouterr().out)
  assert out['tree'] == '2,2,1' and out['tree_nodes'] == 10
  assert out['identical'] is True and out['tree_outputs_identical'] is True
  assert out['tree_mean_accepted_length'] >= out['mean_accepted_length'] - 0.5, out
  assert out['tree_speedup'] > 0 and out['tree_vs_chain_speedup'] > 0
  assert out['tree_extra_flops_per_step'] > 0 and out['tree_flops_vs_chain'] > 1


def test_cli_exit_code_in_a_fresh_process(depth0_workdir):
  """The real entry point: exit status 2 and exactly one stderr line (no logging noise)."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  proc = subprocess.run(
      [sys.executable, SCRIPT, '--workdir', depth0_workdir, '--prompt', 'abc', '--mode', 'spec'],
      capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stdout == ''
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: ') and 'depth = 0' in lines[0], lines


def test_read_prompts(tmp_path):
  plain = tmp_path / 'p.txt'
  plain.write_text('def f(\nclass A:\n')
  assert generate.read_prompts(None, str(plain)) == ['def f(', 'class A:']
  lines = tmp_path / 'p.jsonl'
  lines.write_text('"def f(x):\\n    return"\n\n{"prompt": "import os\\n"}\n')
  assert generate.read_prompts(None, str(lines)) == ['def f(x):\n    return', 'import os\n']
  assert generate.read_prompts('x = 1', None) == ['x = 1']
  for text, message in [('[1, 2]\n', 'expected a string'), ('{"a": 1}\n', 'expected a string'),
                        ('nope\n', 'not JSON'), ('\n', 'holds no prompts')]:
    lines.write_text(text)
    with pytest.raises(cli.RequestError, match=message):
      generate.read_prompts(None, str(lines))
  with pytest.raises(cli.RequestError, match='cannot be read'):
    generate.read_prompts(None, str(tmp_path / 'missing.txt'))


def test_decode_output_marks_where_the_prompt_ends():
  from mtp_jax.commands import decode
  plain = decode.show('import os', 'e = self._create()', styled=False).splitlines()
  assert plain == ['[prompt]', 'import os', '[continuation]', 'e = self._create()', decode.RULE]
  styled = decode.show('import os', 'e = 1', styled=True)
  assert styled.startswith('\x1b[2mimport os\x1b[0me = 1\n')  # dimmed prompt, then the text


def test_leap_depths_do_not_draft():
  """Target offsets (2, 4): depth 2 predicts t_(i+4), not the position after depth 1's
  draft, so the decoder drafts with depth 1 only (and refuses a second draft); lossless.
  Offsets (3,): no depth can draft, decoding is autoregressive."""
  config = byte_config(2)
  config.model.mtp.target_offsets = (2, 4)
  model = build(config)
  assert model.args.drafting_depths() == 1
  dec = decode.Decoder(model)
  prompts = random_prompts(4, seed=17)
  sp = dec.generate(prompts, MAX_NEW, eos_id=None, record=True)
  assert sp.num_drafts == 1
  for a, s in zip(uncached_greedy(model, prompts, MAX_NEW), sp.tokens):
    np.testing.assert_array_equal(s, a)
  with pytest.raises(cli.RequestError, match='target_offsets.*first 1 depth'):
    dec.program(1, 4, 4, num_drafts=2)
  config = byte_config(1)
  config.model.mtp.target_offsets = (3,)
  leap = decode.Decoder(build(config))
  assert leap.args.drafting_depths() == 0
  assert leap.generate(prompts[:1], 4, eos_id=None).num_drafts == 0


def test_decoder_options_change_the_traced_program_not_the_tokens():
  """tall_attention / bitwise_thresholds: the earlier forms are Decoder options compiled into
  their own programs (no module state), and decode the same tokens."""
  model = build(tiny_model_config(2))
  prompts = [[3, 4, 5, 6, 7], [9, 10, 11]]
  on = decode.Decoder(model)
  off = decode.Decoder(model, tall_attention=False, bitwise_thresholds=False)
  for kw in (dict(), dict(temperature=1.0, top_k=5, top_p=0.9)):
    a = on.generate(prompts, 8, num_drafts=2, seed=3, **kw).tokens
    b = off.generate(prompts, 8, num_drafts=2, seed=3, **kw).tokens
    assert all(np.array_equal(x, y) for x, y in zip(a, b)), kw
  prog_on, prog_off = on.program(2, 8, 8, num_drafts=2), off.program(2, 8, 8, num_drafts=2)
  assert prog_on != prog_off and not prog_off.tall_attention
  if jax.default_backend() == 'cpu':  # the tall form is the CPU one, read while tracing
    a_BKxGTxI, b_BKxOxI = jnp.ones((2, 3, 8)), jnp.ones((2, 32, 8))
    form = lambda: str(jax.make_jaxpr(  # noqa: E731
        lambda a, b: decode_ops.few_query_dot(a, b, jnp.float32))(a_BKxGTxI, b_BKxOxI))
    assert 'optimization_barrier' in form()
    with decode_ops.tall_attention(False):
      assert 'optimization_barrier' not in form()
    assert 'optimization_barrier' in form()  # the option is scoped to what it traces
    tall_off = decode.Decoder(model, tall_attention=False)
    prog = tall_off.program(2, 8, 8, num_drafts=2)
    text_on = _instructions(on.compile(prog_on).as_text())
    decode.clear_compiled()  # the same program compiled again reads the same: a fair compare
    assert _instructions(decode.Decoder(model).compile(prog_on).as_text()) == text_on
    assert _instructions(tall_off.compile(prog).as_text()) != text_on


def _instructions(hlo: str) -> str:
  """A compiled module's computations without source locations, which a recompile may list
  in another order (file and frame tables, per-instruction metadata)."""
  first = re.search(r'^(%|ENTRY )', hlo, re.M)
  body = hlo[first.start():] if first else hlo
  return re.sub(r',? metadata=\{[^{}]*\}', '', body)


# -- tree drafting (decode/tree.py) --------------------------------------------------------------
def test_tree_specs():
  """Shapes and node lists parse to the same BFS trees; bad trees are refused, one line."""
  t = tree_lib.parse_tree('3,2,1')
  assert (t.size, t.depth, str(t)) == (15, 3, '3,2,1')
  assert t == tree_lib.parse_tree((3, 2, 1)) == tree_lib.parse_tree(str(t))
  e = tree_lib.parse_tree('0.0;0;1;0.0.0;0.1')  # any order: sorted breadth-first
  assert e.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0)) and str(e) == '0;1;0.0;0.1;0.0.0'
  np.testing.assert_array_equal(e.parents, [-1, 0, 0, 1, 1, 3])
  np.testing.assert_array_equal(e.children[1], [3, 4])
  assert e.ancestors[5].tolist() == [True, True, False, True, False, True]
  assert [e.below(k) for k in (1, 2, 3)] == [0, 2, 4]
  for bad, message in [('3,0', 'must be in [1'), ('0;0.0.1', 'no parent'), ('a,b', 'rank paths'),
                       ('8,8', 'at most 63'), ('', 'empty'), ('0;0', 'twice')]:
    with pytest.raises(cli.RequestError, match=re.escape(message)):
      tree_lib.parse_tree(bad)
  with pytest.raises(cli.RequestError, match='sequential MTP'):
    decode.Decoder(build(byte_config(2, 'parallel')), tree='2,1')


def check_tree_drafts(model, prompts, result):
  """Every recorded rank-0 node == the argmax of an uncached forward of the MTP chain
  over [committed prefix ; the node's ancestors], across rejections."""
  tree = result.tree
  seqs, queries, want, depths = [], [], [], []
  for it in range(result.steps):
    for row, n in enumerate(result.history_length[it]):
      if n < 0:
        continue
      full = list(prompts[row]) + list(result.tokens[row])
      nodes = result.history_drafts[it, row]
      for i in range(1, tree.size + 1):
        if tree.paths[i - 1][-1]:
          continue
        anc, p = [], tree.parents[i]
        while p > 0:
          anc.insert(0, int(nodes[p - 1]))
          p = tree.parents[p]
        seqs.append(full[:n] + anc)
        queries.append(n - 2)
        want.append(nodes[i - 1])
        depths.append(tree.depths[i])
  got = uncached_argmax(model, seqs, queries)
  np.testing.assert_array_equal(got[np.arange(len(seqs)), depths], np.array(want))
  return len(seqs)


@pytest.mark.parametrize('spec,layout', [('1,1,1', 'heads_major'), ('3,2,1', 'heads_major'),
                                         ('0;1;2;0.0;0.1;1.0;0.0.0', 'bskh')])
def test_tree_lossless_greedy(models, spec, layout):
  """Tree drafting, greedy: == AR token for token on ragged batches; the nodes == the
  uncached chain's; a one-candidate tree is the chain itself (same drafts, same counts);
  wider trees accept more per verify step."""
  model = models['trained']
  dec = decode.Decoder(model, tree=spec, cache_layout=layout)
  chain = decode.Decoder(model, cache_layout=layout)
  prompts = word_prompts(8, seed=3)
  _, sp = spec_equals_ar(dec, prompts, ar_decoder=chain, record=True)
  ch = chain.generate(prompts, MAX_NEW, eos_id=None)
  assert check_tree_drafts(model, prompts, sp) > 50
  st = sp.stats()
  assert st['verify_rows_per_iteration'] == sp.tree.size + 1 and st['tree'] == str(sp.tree)
  if spec == '1,1,1':
    np.testing.assert_array_equal(sp.accepted, ch.accepted)
    assert st['flops_per_iteration'] == ch.stats()['flops_per_iteration']
  else:
    assert st['mean_accepted_length'] > ch.stats()['mean_accepted_length'], (st, ch.stats())
    assert st['flops_per_iteration']['flops'] > ch.stats()['flops_per_iteration']['flops']


def test_tree_eos_and_max_new(models):
  """Rows of a tree decoder stop at EOS or their own max_new_tokens inside a block."""
  dec = decode.Decoder(models['trained'], tree='3,2,1')
  prompts = word_prompts(8, seed=5)
  max_new = [5, 7, 9, 11, 13, 17, 19, 23]
  eos = byte_ids('j')[0]
  _, sp = spec_equals_ar(dec, prompts, max_new, eos_id=eos, pad_to=(1, MAX_NEW))
  assert sp.dropped.sum() > 0
  with pytest.raises(cli.RequestError, match='num_drafts must be 0'):
    dec.generate(prompts, 4, num_drafts=2)


@pytest.mark.slow  # ~40 s on a loaded 2-core box (+ the MLA + MoE model's training, shared)
def test_tree_mla_moe_lossless_greedy(mla_moe_model):
  """MLA + MoE trunk and MTP blocks: tree greedy == AR greedy, nodes == uncached chain's."""
  dec = decode.Decoder(mla_moe_model, tree='2,2')
  prompts = word_prompts(8, seed=0)
  _, sp = spec_equals_ar(dec, prompts, record=True)
  assert sp.accepted.sum(0)[-1] > 0
  assert check_tree_drafts(mla_moe_model, prompts, sp) > 50


@pytest.mark.parametrize('draft_argmax', [False, True], ids=['sampled-nodes', 'ranked-nodes'])
def test_tree_lossless_sampling(small_vocab_models, draft_argmax):
  """Chi-square: the first 4 tokens sampled with a 2,2,1 tree (recursive rejection over
  each node's candidates) follow plain sampling's exact joint law."""
  model = small_vocab_models(0.15)
  dec = decode.Decoder(model, tree='2,2,1')
  sampling = sampling_lib.Sampling(jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0))
  exact, _ = exact_joint(model, sampling)
  spec = dec.generate([SAMPLE_PROMPT] * N_SAMPLES, 4, eos_id=None, seed=1, temperature=1.0,
                      draft_argmax=draft_argmax)
  spec_x = np.stack(spec.tokens)
  assert spec_x.shape == (N_SAMPLES, 4)
  acc = spec.stats()['acceptance_per_depth']
  assert 0.05 < acc[0] < 0.95 and acc[1] > 0.002, acc
  assert chi2_pvalue(spec_x, exact) > 1e-3


# -- the automatic draft shape (decode/picker.py) -------------------------------------------------
def rows_cost(verify_per_row, block_per_row, base=1.0):
  """A synthetic cost model: each verify / MTP-block row costs this much (in AR steps)."""
  rows = range(1, 80)
  return cost_lib.IterationCost(
      verify={str(r): 1.0 + verify_per_row * r for r in rows},
      block={str(r): 0.1 + block_per_row * r for r in rows},
      logits={str(r): 0.01 * r for r in rows}, base=base, per_depth=0.1)


# The cost regimes the lossless tests decode the picker's choice under: on the trained model
# they pick a wide tree, a shape that drafts, and at most one draft.
REGIMES = {'rows-free': rows_cost(0.0, 0.0), 'rows-cheap': rows_cost(0.08, 0.02),
           'rows-dear': rows_cost(1.0, 0.3)}


@pytest.fixture(scope='session')
def trained_acceptance(models):
  model = models['trained']
  return acceptance_lib.measure(decode.Decoder(model), word_prompts(4, seed=11), 24,
                                depths=cost_lib.max_depth(model.args))


def test_acceptance_rates_of_the_trained_model(models, trained_acceptance):
  """The probe tree's rates: per depth at most 1 in all, trials shrinking with depth, and the
  positional model's tau of the probe tree near the probe's measured tau."""
  acc = trained_acceptance
  assert acc.depths == 4 and all(len(r) == acceptance_lib.PROBE_RANKS for r in acc.rates)
  assert all(0 <= sum(r) <= 1 for r in acc.rates) and acc.rates[0][0] > 0.5
  assert acc.trials[0] > 10 and all(a >= b for a, b in zip(acc.trials, acc.trials[1:]))
  probe = acceptance_lib.probe_tree(4)  # the rows' last, cut iterations lower the measured
  assert acc.measured_tau - 0.05 <= acc.expected_tau(probe) <= acc.measured_tau + 0.6


@pytest.mark.parametrize('regime', list(REGIMES))
def test_picker_shapes_lossless_greedy(models, trained_acceptance, regime):
  """Decoder(tree='auto') decodes the picker's choice, == AR token for token."""
  model = models['trained']
  dec = decode.Decoder(model, tree='auto', acceptance=trained_acceptance,
                       cost=REGIMES[regime], max_rows=8)
  prompts = word_prompts(8, seed=4)
  _, sp = spec_equals_ar(dec, prompts)
  choice = next(iter(dec.choices.values()))
  assert sp.tree == choice.tree and sp.num_drafts == choice.num_drafts
  want = {'rows-free': lambda c: c.tree is not None and c.tree.size >= 5,
          'rows-cheap': lambda c: c.best.rows >= 2,  # drafts at least one token
          'rows-dear': lambda c: c.best.rows <= 2}[regime]  # plain decoding or one draft
  assert want(choice), choice.line()
  chains = decode.Decoder(model, acceptance=trained_acceptance, cost=REGIMES[regime])
  r = chains.generate(prompts, MAX_NEW, num_drafts='auto', eos_id=None)
  assert r.tree is None and r.num_drafts == next(iter(chains.choices.values())).num_drafts


@pytest.mark.slow  # every shape of the family: ~25 programs
def test_every_picker_shape_lossless_greedy(models, trained_acceptance):
  """Every chain and tree the picker weighs (row budget 6) decodes == AR."""
  model = models['trained']
  ranked = picker_lib.candidates(trained_acceptance, REGIMES['rows-free'], max_depth=4,
                                 max_rows=6)
  assert sum(c.tree is not None for c in ranked) >= 10
  ar = decode.Decoder(model)
  prompts = word_prompts(4, seed=6)
  for c in ranked:
    dec = decode.Decoder(model, tree=c.tree)
    spec_equals_ar(dec, prompts, ar_decoder=ar, num_drafts=None if c.tree else c.num_drafts)


def test_picker_tree_lossless_sampling(small_vocab_models):
  """Chi-square: the picker's tree for rates measured at T = 1 samples plain sampling's law."""
  model = small_vocab_models(0.15)
  acc = acceptance_lib.measure(decode.Decoder(model), [SAMPLE_PROMPT] * 8, 12, depths=3,
                               temperature=1.0, ranks=3, batch_size=8)
  dec = decode.Decoder(model, tree='auto', acceptance=acc, cost=REGIMES['rows-free'],
                       max_rows=8)
  sampling = sampling_lib.Sampling(jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0))
  exact, _ = exact_joint(model, sampling)
  spec = dec.generate([SAMPLE_PROMPT] * N_SAMPLES, 4, eos_id=None, seed=2, temperature=1.0)
  assert spec.tree is not None and spec.tree.size >= 4, str(spec.tree)
  assert chi2_pvalue(np.stack(spec.tokens), exact) > 1e-3
  with pytest.raises(cli.RequestError, match='measured for T=1'):
    dec.generate([SAMPLE_PROMPT], 4, eos_id=None)  # greedy: other rates


def test_cli_tree_auto(trained, capsys, monkeypatch, tmp_path):
  """mtp-decode --tree auto: measures and stores the acceptance rates, calibrates this
  machine (cached), says what it chose, and decodes it == AR; the second run reads both."""
  monkeypatch.setenv('MTP_JAX_CACHE_DIR', str(tmp_path))
  argv = ['--workdir', trained[1], '--prompt', 'abc hij pq', '--max_new_tokens', str(MAX_NEW),
          '--mode', 'compare', '--tree', 'auto', '--max_rows', '4', '--json']
  assert _script().main(argv) == 0
  cap = capsys.readouterr()
  out = json.loads(cap.out)
  assert out['auto'].startswith('auto: ') and 'measuring acceptance rates' in cap.err
  assert out['identical'] is True and out.get('tree_outputs_identical') in (None, True)
  assert out['auto_expected_speedup'] > 0 and out['auto_measured_speedup'] > 0
  assert os.path.exists(os.path.join(trained[1], acceptance_lib.FILE))
  assert os.path.exists(os.path.join(tmp_path, cost_lib.CACHE_FILE))
  assert _script().main(argv) == 0
  cap = capsys.readouterr()
  assert 'measuring' not in cap.err and 'calibrated' not in cap.err
  assert json.loads(cap.out)['auto_shape'] == out['auto_shape']
