"""generate.token_sources: which tokens were the main model's own and which accepted drafts.

Uses conftest's `trained` word-language model, as test_decode does (it accepts long
blocks and rejects at word starts), so the compiled programs are shared when both files
run in one pytest process.
"""
import numpy as np
import pytest

from helpers import MAX_NEW, byte_ids, word_prompts
from mtp_jax.decode import Decoder, DecodeResult, generate


def blocks(src):
  """Split sources after the prefill's token into verify blocks: lists of draft depths."""
  out, cur = [], []
  for s in src[1:]:
    if s == 0:
      out.append((cur, True))  # drafts then the bonus
      cur = []
    else:
      assert s == len(cur) + 1, src  # depths run 1, 2, .. inside a block
      cur.append(s)
  if cur:
    out.append((cur, False))  # the row stopped before the bonus
  return out


def check_sources(r: DecodeResult, sources, eos=None):
  """Sources agree with the tokens, the recorded drafts and every loop counter."""
  d = r.num_drafts
  assert len(sources) == len(r.tokens)
  for row, (toks, src) in enumerate(zip(r.tokens, sources)):
    assert src.shape == toks.shape and src.dtype == np.int32
    assert src[0] == 0  # the prefill's token is the main model's
    assert np.all((src >= 0) & (src <= d))
    bl = blocks(src)
    assert len(bl) == r.verify_steps[row]
    hist = np.zeros(d + 1, np.int64)
    for i, (depths, bonus) in enumerate(bl):
      last = i == len(bl) - 1
      if bonus:
        hist[len(depths)] += 1
        if last:
          assert r.dropped[row] == 0  # the bonus was committed: nothing after it to drop
      else:  # cut inside an accepted block: only in the last step, the bonus dropped
        assert last and r.dropped[row] >= 1, (row, src)
        hist[len(depths) + r.dropped[row] - 1] += 1
    np.testing.assert_array_equal(hist, r.accepted[row], err_msg=f'row {row}')
    # Draft tokens == accepted drafts, less those dropped with the stop (one is the bonus).
    kept = int((np.arange(d + 1) * r.accepted[row]).sum()) - max(int(r.dropped[row]) - 1, 0)
    assert int((src > 0).sum()) == kept
    assert int((src == 0).sum()) == 1 + r.verify_steps[row] - (r.dropped[row] > 0)
    # A depth-k token is the step's k-th draft (the lengths locate each block).
    steps = np.flatnonzero(r.history_length[:, row] >= 0)
    start = r.history_length[steps[0], row] - 1 if len(steps) else 0
    for it in steps:
      n = r.history_length[it, row] - start
      for k in range(1, d + 1):
        if n + k - 1 < len(src) and src[n + k - 1] == k:
          assert toks[n + k - 1] == r.history_drafts[it, row, k - 1]
    if eos is not None and eos in toks:
      assert toks[-1] == eos and list(toks).index(eos) == len(toks) - 1


def test_sources_greedy_eos_and_max_new_inside_blocks(trained):
  """Greedy on the word model: long accepted blocks, rows cut by EOS and by max_new."""
  model, _ = trained
  dec = Decoder(model)
  prompts = word_prompts(8, seed=5)
  max_new = [1, 7, 9, 11, 13, 17, 19, MAX_NEW]  # row 0: the prefill's token only
  eos = byte_ids('j')[0]  # the last letter of 'hij': reached by accepted drafts
  r = dec.generate(prompts, max_new, eos_id=eos, pad_to=(1, MAX_NEW), record=True)
  src = generate.token_sources(r)
  check_sources(r, src, eos)
  np.testing.assert_array_equal(src[0], [0])
  cut = [s[-1] > 0 for s in src]  # rows whose last token is an accepted draft
  eos_end = [t[-1] == eos for t in r.tokens]
  assert any(c and e for c, e in zip(cut, eos_end)), src  # EOS inside a block
  assert any(c and not e for c, e in zip(cut, eos_end)), src  # max_new inside a block
  hist = r.accepted.sum(0)
  assert hist[0] > 0 and hist[-1] > 0, hist  # rejections and full blocks both seen
  # Greedy speculative text == AR text, and AR's tokens are all the main model's.
  ar = dec.generate(prompts, max_new, num_drafts=0, eos_id=eos, pad_to=(1, MAX_NEW),
                    record=True)
  for a, s in zip(ar.tokens, r.tokens):
    np.testing.assert_array_equal(a, s)
  ar_src = generate.token_sources(ar)
  check_sources(ar, ar_src, eos)
  assert all(np.all(s == 0) for s in ar_src)


def test_sources_sampling(trained):
  """Sampled drafts with the speculative rule: the same accounting holds."""
  dec = Decoder(trained[0])
  r = dec.generate(word_prompts(8, seed=6), MAX_NEW, temperature=1.0, eos_id=None, seed=3,
                   record=True)
  check_sources(r, generate.token_sources(r))
  assert r.accepted.sum(0)[1:].sum() > 0


def test_sources_need_record():
  r = DecodeResult(tokens=[np.array([5, 6])], num_drafts=1, steps=1,
                          verify_steps=np.array([1]), committed=np.array([1]),
                          accepted=np.array([[1, 0]]), dropped=np.array([0]))
  with pytest.raises(ValueError, match='record=True'):
    generate.token_sources(r)


def test_pieces_html_and_chart(tmp_path):
  """The notebook's views: one piece per token (a split character on its last byte)."""
  from mtp_jax.data import tokenizers
  from mtp_jax.research import plotting
  tok = tokenizers.ByteTokenizer()
  ids = tok.encode('é<b>\n')
  pieces = plotting.token_pieces(tok, tok.encode('x = '), ids)
  assert pieces == ['', 'é', '<', 'b', '>', '\n']
  page = plotting.sources_html('x = ', pieces, [0, 1, 2, 0, 1, 0], num_drafts=2)
  assert '&lt;' in page and '<b>' not in page and 'draft depth 2' in page
  assert page.count(plotting.source_color(1)) == 3  # legend + two depth-1 tokens
  stats = {'num_drafts': 2, 'verify_steps': 4, 'new_tokens': 9, 'mean_accepted_length': 2.0,
           'acceptance_per_depth': [0.75, 0.25], 'conditional_acceptance': [0.75, 1 / 3]}
  path = plotting.plot_decode_acceptance(stats, [1, 2, 1], str(tmp_path / 'a.png'))
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
