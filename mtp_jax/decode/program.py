"""The compiled decode loop: its static shape (`Program`), its traced state (`DecodeState`), the
prefill and one draft-and-verify iteration, the `lax.while_loop` over them, and the single
passes the cost model times (decoder.py's docstring gives the algorithm; tree drafting's
windows, acceptance and cache moves are in tree.py)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

import mtp_jax.decode.sampling as sampling_lib
import mtp_jax.decode.tree as tree_lib
from mtp_jax.decode.sampling import PAD_ID, row_keys, take_rows

Array = jax.Array

# -- static program and traced state -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Program:
  """Everything that changes the compiled program (the compile-cache key)."""
  batch: int
  prompt_len: int  # prompt bucket Pb: prompts are right-padded to it
  max_new: int  # bucket of max_new_tokens Nb: sizes the buffers and bounds the loop
  num_drafts: int  # A used for drafting; 0 = plain autoregressive decoding
  greedy: bool  # argmax everywhere; else sampling with the speculative rule
  record: bool = False  # keep the drafts of every iteration (tests)
  top_k: bool = False  # top-k filtering compiled in (its k is a traced value)
  top_p: bool = False  # top-p filtering compiled in (its p is a traced value)
  layout: str = 'heads_major'  # KV cache layout (decode_ops.CACHE_LAYOUTS)
  weights: str = 'float32'  # dtype of the weight matrices the program reads
  adaptive: bool = False  # confidence-adaptive draft length (verify_widths buckets)
  tall_attention: bool = True  # Decoder(tall_attention=...): decode_ops.tall_attention
  bitwise_thresholds: bool = True  # Decoder(bitwise_thresholds=...): Sampling.bitwise
  tree: tree_lib.Tree | None = None  # tree drafting (tree.py); num_drafts = its depth

  @property
  def verify_widths(self) -> tuple:
    """Static verify-window widths: powers of two below A + 1, then A + 1; adaptive
    iterations verify the narrowest one that holds every active row's proposals."""
    if not self.adaptive:
      return (self.tree.size + 1 if self.tree else self.num_drafts + 1,)
    return tuple(w for w in (1, 2, 4, 8) if w < self.num_drafts + 1) + (self.num_drafts + 1,)

  @property
  def offset(self) -> int:  # cache slot of position 0
    return self.num_drafts

  @property
  def cache_len(self) -> int:
    room = self.num_drafts + 1 + self.tree.size if self.tree else self.num_drafts
    return self.offset + self.prompt_len + self.max_new + room

  @property
  def buffer_len(self) -> int:
    return self.prompt_len + self.max_new + self.num_drafts + 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
  """The while-loop carry; per-row fields lead with the batch axis."""
  tokens: Array  # [B, U] committed tokens by position; PAD after `length`
  length: Array  # [B] n: committed tokens (the last, x, is not in the main cache yet)
  prompt_len: Array  # [B]
  max_new: Array  # [B] tokens to generate at most
  done: Array  # [B] bool: hit EOS or max_new
  main_cache: tuple  # per trunk layer, its block's cache in prog.layout (Block.empty_cache:
                    # GQA (k, v); MLA (latent [c_kv ; RoPE(k_r)],))
  mtp_cache: tuple  # per drafting depth, the same
  hidden: tuple  # sequential: h^k at position n-1-k, k = 1..A-1, each [B, D]
  drafts: Array  # [B, A] proposals for positions n..n+A-1
  proposed: Array  # [B] how many leading drafts are proposed (adaptive; else A)
  draft_probs: Array  # [B, A, V] q each draft was sampled from ([B, A, 0] when greedy)
  keys: Array  # [B] per-row PRNG keys
  step: Array  # loop iterations so far
  verify_steps: Array  # [B] iterations in which the row was active
  committed: Array  # [B] tokens committed by verify steps (the prefill's first one excluded)
  accepted: Array  # [B, A+1] how many verify steps accepted exactly j drafts
  dropped: Array  # [B] accepted tokens discarded because the row stopped inside the block
  verify_rows: Array  # [B] positions verified (window widths summed over active iterations)
  history_drafts: Array  # [iterations or 0, B, A] drafts verified at each iteration (record)
  history_length: Array  # [iterations or 0, B] n at that iteration, -1 when the row was done


# -- windows over the caches -----------------------------------------------------------------
def _write_rows(buf_BxU, new_BxW, index_B):
  return jax.vmap(lambda b, n, i: jax.lax.dynamic_update_slice_in_dim(b, n, i, 0))(
      buf_BxU, new_BxW.astype(buf_BxU.dtype), index_B)


def _window(prog: Program, start_B, width: int):
  """Positions [B, W] of a window and its mask [B, 1, W, S] over the cache slots."""
  pos_BxW = start_B[:, None] + jnp.arange(width, dtype=jnp.int32)
  slot_pos_S = jnp.arange(prog.cache_len, dtype=jnp.int32) - prog.offset
  mask = (slot_pos_S >= 0) & (slot_pos_S[None, None, :] <= pos_BxW[:, :, None])
  return pos_BxW, mask[:, None]


def _main_pass(prog, model, tokens_BxW, start_B, caches):
  """h^0 over a window of tokens at positions start.., through the main KV caches."""
  pos, mask = _window(prog, start_B, tokens_BxW.shape[1])
  return model.decode_trunk(tokens_BxW, pos, mask, caches, start_B + prog.offset, prog.layout)


def _mtp_pass(prog, model, h0_BxWxD, start_B, u_BxU, a_B, hidden, caches, sampling, keys_B):
  """Catch-up and drafting, one block call per depth.

  h0_BxWxD: verified h^0 at positions start..start+W-1, true for the first a+1 of them;
  u_BxU: t_{start+1}, t_{start+2}, ...: a+1 committed tokens, then room for drafts.
  Returns (drafts [B, A], q [B, A, V or 0], confidence [B, A], hidden, caches); the
  confidence at depth k is the largest probability of the distribution d_k is drawn
  from (greedy: the head's softmax), what an adaptive draft length stops on. It is a
  function of that distribution, not of the draw: a stop that looked at the drawn
  token's own probability would change the proposal law and bias speculative
  sampling (test_lossless_sampling[adaptive-length] rejects that at p ~ 1e-169).
  """
  chained = model.args.mtp_head().chained
  width = h0_BxWxD.shape[1]
  rows = jnp.arange(h0_BxWxD.shape[0])
  drafts, probs, confs, new_hidden, new_caches = [], [], [], [], []
  h_prev = h0_BxWxD
  for k in range(1, prog.num_drafts + 1):
    if chained:  # window: positions start-k+1 .. start+W-1, query at n'-2
      # h^{k-1} at start-k+1 is the stored one; the rest is depth k-1's output of this pass.
      h_in = h0_BxWxD if k == 1 else jnp.concatenate([hidden[k - 2][:, None], h_prev], 1)
      w, s, query = width + k - 1, start_B - (k - 1), a_B + k - 1
      tokens = u_BxU[:, :w]
    else:  # parallel heads read h^0 only: the verify window itself
      h_in, w, s, tokens, query = h0_BxWxD, width, start_B, None, a_B
    pos, mask = _window(prog, s, w)
    h_k, cache = model.decode_mtp_step(k, h_in, tokens, pos, mask, caches[k - 1],
                                       s + prog.offset, prog.layout)
    new_caches.append(cache)
    logits = model.decode_logits(take_rows(h_k, query), k)
    d, q = sampling_lib.draw(prog.greedy, logits, sampling, row_keys(keys_B, k))
    drafts.append(d)
    probs.append(q)
    if prog.adaptive:
      dist = (jax.nn.softmax(logits, -1) if prog.greedy
              else sampling_lib.adjusted_probs(logits, sampling))
      confs.append(jnp.max(dist, -1))
    if chained and k < prog.num_drafts:
      u_BxU = u_BxU.at[rows, a_B + k].set(d)
      new_hidden.append(take_rows(h_k, a_B))
    h_prev = h_k
  b = h0_BxWxD.shape[0]
  if not drafts:
    v = 0 if prog.greedy else model.args.vocab_size
    return jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0, v)), jnp.ones((b, 0)), (), ()
  conf = jnp.stack(confs, 1) if confs else jnp.ones((b, prog.num_drafts))
  return (jnp.stack(drafts, 1), jnp.stack(probs, 1), conf, tuple(new_hidden),
          tuple(new_caches))


def _proposed(conf_BxA, threshold):
  """The adaptive draft length: drafts up to the first one below the threshold."""
  return jnp.sum(jnp.cumprod((conf_BxA >= threshold).astype(jnp.int32), 1), 1)


def _verify(prog, model, st: DecodeState, start_B):
  """The main pass over [x, d_1..] and its logits, each padded to A + 1 positions.

  Adaptive programs verify the narrowest static width holding every active row's
  proposals (lax.switch over prog.verify_widths): the positions past it would be
  rejected anyway. Returns ((h^0, logits, main caches), the width). Padded h^0 positions
  only feed MTP-window entries past the accepted ones, which the next window rewrites before
  they are read.
  """
  x = take_rows(st.tokens, start_B)
  tokens = jnp.concatenate([x[:, None], st.drafts], 1)
  full = prog.num_drafts + 1

  def at_width(w, cache):
    h0, cache = _main_pass(prog, model, tokens[:, :w], start_B, cache)
    b, _, d = h0.shape
    logits = model.decode_logits(h0.reshape(b * w, d), 0).reshape(b, w, -1)
    pad = lambda a: jnp.pad(a, ((0, 0), (0, full - w), (0, 0)))  # noqa: E731
    return pad(h0), pad(logits), cache

  widths = prog.verify_widths
  if len(widths) == 1:
    return at_width(full, st.main_cache), full
  need = jnp.max(jnp.where(st.done, 0, st.proposed)) + 1
  idx = jnp.sum(jnp.asarray(widths) < need)
  return jax.lax.switch(idx, [functools.partial(at_width, w) for w in widths],
                        st.main_cache), jnp.asarray(widths)[idx]


# -- prefill and one iteration ---------------------------------------------------------------
def _prefill(prog, model, prompts_BxP, prompt_len_B, max_new_B, eos, sampling, keys_B,
             threshold):
  b, p = prompts_BxP.shape
  zero_B = jnp.zeros((b,), jnp.int32)
  main_cache = model.trunk_caches(b, prog.cache_len, prog.layout)
  h0, main_cache = _main_pass(prog, model, prompts_BxP, zero_B, main_cache)
  logits = model.decode_logits(take_rows(h0, prompt_len_B - 1), 0)
  pkeys = row_keys(keys_B, 0)  # iteration i uses salt i + 1
  x, _ = sampling_lib.draw(prog.greedy, logits, sampling, row_keys(pkeys, 0), may_argmax=False)
  tokens = jnp.zeros((b, prog.buffer_len), jnp.int32).at[:, :p].set(prompts_BxP)
  tokens = tokens.at[jnp.arange(b), prompt_len_B].set(x)
  dn = prog.num_drafts
  mtp_cache = model.mtp_caches(dn, b, prog.cache_len, prog.layout)
  hidden = tuple(jnp.zeros((b, model.args.d_model), model.args.dtype) for _ in range(dn - 1)
                 if model.args.mtp_head().chained)
  # u = t_1..t_P (prompt[1:] then x), then room for drafts.
  u = jnp.concatenate([prompts_BxP[:, 1:], jnp.zeros((b, max(dn, 1)), jnp.int32)], 1)
  u = u.at[jnp.arange(b), prompt_len_B - 1].set(x)
  drafts, probs, conf, hidden, mtp_cache = (tree_lib.mtp_pass if prog.tree else _mtp_pass)(
      prog, model, h0, zero_B, u, prompt_len_B - 1, hidden, mtp_cache, sampling,
      row_keys(pkeys, 1))
  if prog.greedy:
    probs = jnp.zeros(drafts.shape + (0,))
  nb = prog.max_new if prog.record else 0
  return DecodeState(
      tokens=tokens, length=prompt_len_B + 1, prompt_len=prompt_len_B, max_new=max_new_B,
      done=(x == eos) | (max_new_B <= 1), main_cache=main_cache, mtp_cache=mtp_cache,
      hidden=hidden, drafts=drafts, proposed=_proposed(conf, threshold),
      draft_probs=probs.astype(jnp.float32), keys=keys_B,
      step=jnp.zeros((), jnp.int32), verify_steps=zero_B, committed=zero_B,
      accepted=jnp.zeros((b, dn + 1), jnp.int32), dropped=zero_B, verify_rows=zero_B,
      history_drafts=jnp.zeros((nb,) + drafts.shape, jnp.int32),
      history_length=jnp.zeros((nb, b), jnp.int32))


def _iteration(prog, model, st: DecodeState, eos, sampling, threshold) -> DecodeState:
  dn = prog.num_drafts
  keys = row_keys(st.keys, st.step + 1)
  start = st.length - 1
  if prog.tree:  # h0 along the accepted path; its main-cache entries moved into place
    h0, main_cache, a, cand, width = tree_lib.verify(
        prog, model, take_rows(st.tokens, start), st.drafts, st.draft_probs, start,
        st.main_cache, sampling, row_keys(keys, 0))
  else:
    (h0, logits, main_cache), width = _verify(prog, model, st, start)
    a, cand = sampling_lib.accept(prog.greedy, logits, st.drafts, st.draft_probs, sampling,
                                  row_keys(keys, 0), st.proposed if prog.adaptive else None)

  # Stop inside the block at EOS or max_new_tokens.
  j = jnp.arange(dn + 1)
  active = ~st.done
  room = st.max_new - (st.length - st.prompt_len)
  is_eos = (cand == eos) & (j <= a[:, None])
  eos_at = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1), dn + 1)
  m = jnp.where(active, jnp.minimum(jnp.minimum(a + 1, room), eos_at + 1), 0)
  done = st.done | (active & ((eos_at < m) | (m >= room)))
  tokens = _write_rows(st.tokens, jnp.where(j < m[:, None], cand, PAD_ID), st.length)

  u = jnp.concatenate([cand, jnp.zeros((cand.shape[0], max(dn - 1, 0)), jnp.int32)], 1)
  drafts, probs, conf, hidden, mtp_cache = (tree_lib.mtp_pass if prog.tree else _mtp_pass)(
      prog, model, h0, start, u, a, st.hidden, st.mtp_cache, sampling, row_keys(keys, 1))
  if prog.greedy:
    probs = st.draft_probs
  act = active.astype(jnp.int32)
  hd, hl = st.history_drafts, st.history_length
  if prog.record:
    hd = hd.at[st.step].set(st.drafts)
    hl = hl.at[st.step].set(jnp.where(active, st.length, -1))
  return DecodeState(
      tokens=tokens, length=st.length + m, prompt_len=st.prompt_len, max_new=st.max_new,
      done=done, main_cache=main_cache, mtp_cache=mtp_cache, hidden=hidden, drafts=drafts,
      proposed=_proposed(conf, threshold) if prog.adaptive else st.proposed,
      draft_probs=probs.astype(jnp.float32), keys=st.keys, step=st.step + 1,
      verify_steps=st.verify_steps + act, committed=st.committed + m,
      accepted=st.accepted + act[:, None] * (j == a[:, None]),
      dropped=st.dropped + jnp.where(active, a + 1 - m, 0),
      verify_rows=st.verify_rows + act * width, history_drafts=hd,
      history_length=hl)


def decode_program(prog: Program, graphdef, treedef, leaves, prompts_BxP, prompt_len_B,
                   max_new_B, eos, sampling, seed, threshold):
  """Prefill, then the while loop until every row is done. Returns the final DecodeState.

  The parameters come as a flat list of arrays (flattening an nnx.State on every call
  costs milliseconds of host time).
  """
  params = jax.tree.unflatten(treedef, leaves)
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(
      jnp.arange(prog.batch))
  st = _prefill(prog, nnx.merge(graphdef, params), prompts_BxP, prompt_len_B, max_new_B, eos,
                sampling, keys, threshold)

  def cond(st):
    return (st.step < prog.max_new) & jnp.any(~st.done)

  def body(st):
    return _iteration(prog, nnx.merge(graphdef, params), st, eos, sampling, threshold)

  return jax.lax.while_loop(cond, body, st)


# -- the passes of one iteration, alone (cost.py) --------------------------------------------
def pass_functions(graphdef, treedef, prog: Program):
  """The passes of one iteration, each as a function (leaves, caches, reps) that runs it
  `reps` times in a loop, for cost.py: verify(rows) (the main pass and its logits over
  `rows` positions per batch row), block(rows) (one MTP block over a window of `rows`)
  and logits(rows) (one head over `rows` rows per batch row)."""
  b = prog.batch
  start = jnp.full((b,), prog.prompt_len, jnp.int32)

  def model_of(leaves):
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

  def loop(body, init, reps):
    return jax.lax.fori_loop(0, reps, lambda _, c: body(c), init)

  def verify(rows):
    def fn(leaves, caches, reps):
      m = model_of(leaves)

      def body(c):
        tok, trunk = c
        h, trunk = _main_pass(prog, m, tok, start, trunk)
        logits = m.decode_logits(h.reshape(b * rows, -1), 0)
        return jnp.argmax(logits, -1).reshape(b, rows).astype(jnp.int32), trunk
      return loop(body, (jnp.zeros((b, rows), jnp.int32), caches[0]), reps)[0]
    return fn

  def block(rows):
    def fn(leaves, caches, reps):
      m = model_of(leaves)
      pos, mask = _window(prog, start, rows)
      tok = jnp.zeros((b, rows), jnp.int32)

      def body(c):
        h, cache = c
        return m.decode_mtp_step(1, h, tok, pos, mask, cache, start + prog.offset, prog.layout)
      h0 = jnp.zeros((b, rows, m.args.d_model), m.args.dtype)
      return loop(body, (h0, caches[1]), reps)[0]
    return fn

  def logits(rows):
    def fn(leaves, caches, reps):
      del caches
      m = model_of(leaves)

      def body(h):
        return h + 1e-3 * m.decode_logits(h, 1)[:, :1].astype(h.dtype)
      return loop(body, jnp.ones((b * rows, m.args.d_model), m.args.dtype), reps)
    return fn

  return verify, block, logits


def pass_caches(graphdef, treedef, prog: Program, leaves):
  """(trunk caches, depth 1's cache): what pass_functions' passes read."""
  model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
  return (model.trunk_caches(prog.batch, prog.cache_len, prog.layout),
          model.mtp_caches(1, prog.batch, prog.cache_len, prog.layout)[0])
