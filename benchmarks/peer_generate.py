"""The project's AR decoding against a plain-JAX peer `generate` loop, in one process.

  python benchmarks/peer_generate.py --rounds 60 --filters
  python benchmarks/peer_generate.py --filters --ab bitwise_thresholds --rounds 20

The peer is written here from the math, independently of mtp_jax's decoder and layers:
one jitted `lax.while_loop`, a preallocated [B, S, K, H] KV cache per layer updated with
`lax.dynamic_update_slice`, the prompt prefilled in one pass, then one token per
iteration (greedy argmax, or `jax.random.categorical` of logits / T). It runs the very
weights of the project's model (a random `MTPModel` of the peer shape: 4
layers, d 256, 4 x 64 heads, SwiGLU MLP 3d, tied head, V 4096; batch 1, 16 + 128
tokens), read from the model's own parameters, and the script fails unless the peer's
greedy tokens equal `Decoder.generate`'s (num_drafts = 0) token for token: both compute
the same function. Then every variant is timed round robin over --rounds rounds, so
background load hits all alike; tokens/s of the best and the median round per variant,
and the project / peer ratios of both. --ab OPTION also times the project's T = 1
variants with a boolean Decoder option switched off (a second Decoder, its own compiled
programs), e.g. bitwise_thresholds or tall_attention.
"""
import functools
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from decode_speed import random_model  # noqa: E402

import common  # benchmarks/common.py
from mtp_jax.decode import Decoder  # noqa: E402

NAME = 'peer_generate'
AB_OPTIONS = ('bitwise_thresholds', 'tall_attention')  # Decoder's boolean options


def parse(argv):
  p = common.parser(NAME, __doc__)
  p.add_argument('--rounds', type=int, default=30, help='round-robin rounds over the variants')
  p.add_argument('--prompt_len', type=int, default=16)
  p.add_argument('--max_new_tokens', type=int, default=128)
  p.add_argument('--spec_drafts', type=int, default=3,
                 help='also time the project\'s speculative sampling at T = 1 with this many '
                      'drafts (0: not)')
  p.add_argument('--filters', action='store_true',
                 help='also time the project\'s T = 1 AR with top-k 50 and with top-p 0.9 '
                      '(and speculative sampling with top-p 0.9)')
  p.add_argument('--ab', default='', choices=('',) + AB_OPTIONS,
                 help='a Decoder option, e.g. bitwise_thresholds: also time the project\'s '
                      'T = 1 variants with that boolean switch off ("_off")')
  args = p.parse_args(argv)
  if args.rounds < 1 or args.prompt_len < 1 or args.max_new_tokens < 2:
    p.error('--rounds and --prompt_len must be >= 1, --max_new_tokens >= 2')
  if args.smoke:
    args.rounds, args.prompt_len, args.max_new_tokens = 1, 4, 4
    args.spec_drafts = min(args.spec_drafts, 1)
  return args


# -- the peer: plain JAX, from the math -----------------------------------------------------
def peer_params(model) -> dict:
  """The model's weights as plain arrays: [D, N*H]-style matrices, x @ W."""
  a = model.args
  layers = []
  for blk in model.layers:
    at, mlp = blk.self_attn, blk.mlp
    layers.append(dict(
        ln1=blk.input_layernorm.scale[...], ln2=blk.post_attention_layernorm.scale[...],
        wq=at.q_proj.kernel[...].reshape(a.d_model, -1),
        wk=at.k_proj.kernel[...].reshape(a.d_model, -1),
        wv=at.v_proj.kernel[...].reshape(a.d_model, -1),
        wo=at.o_proj.kernel[...].reshape(-1, a.d_model),
        wg=mlp.gate_proj.kernel[...], wu=mlp.up_proj.kernel[...],
        wd=mlp.down_proj.kernel[...]))
  head = model.embed.embedding[...].T if a.tie_embeddings else model.lm_head.kernel[...]
  return dict(embed=model.embed.embedding[...], layers=layers, norm=model.norm.scale[...],
              head=head)


def _rms(x, scale, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def _rope(x_BxTxNxH, pos_T, theta):
  h = x_BxTxNxH.shape[-1]
  inv = 1.0 / theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)
  ang = pos_T[:, None].astype(jnp.float32) * inv  # [T, H/2]
  cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
  x1, x2 = x_BxTxNxH[..., :h // 2], x_BxTxNxH[..., h // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def peer_forward(cfg, p, tokens_BxT, start, caches):
  """Logits of the last position and the updated caches; tokens sit at start.."""
  b, t = tokens_BxT.shape
  n, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  pos_T = start + jnp.arange(t)
  slots = caches[0][0].shape[1]
  visible_TxS = jnp.arange(slots)[None, :] <= pos_T[:, None]
  x = p['embed'][tokens_BxT]
  new = []
  for lp, (ck, cv) in zip(p['layers'], caches):
    h = _rms(x, lp['ln1'], cfg.norm_eps)
    q = _rope((h @ lp['wq']).reshape(b, t, n, hd), pos_T, cfg.rope_theta)
    k = _rope((h @ lp['wk']).reshape(b, t, kv, hd), pos_T, cfg.rope_theta)
    v = (h @ lp['wv']).reshape(b, t, kv, hd)
    ck = jax.lax.dynamic_update_slice(ck, k, (0, start, 0, 0))
    cv = jax.lax.dynamic_update_slice(cv, v, (0, start, 0, 0))
    new.append((ck, cv))
    kk, vv = (jnp.repeat(c, n // kv, axis=2) for c in (ck, cv))  # GQA: a no-op at n == kv
    s = jnp.einsum('btnh,bsnh->bnts', q, kk) / math.sqrt(hd)
    s = jnp.where(visible_TxS, s, -1e30)
    o = jnp.einsum('bnts,bsnh->btnh', jax.nn.softmax(s, -1), vv)
    x = x + o.reshape(b, t, n * hd) @ lp['wo']
    h = _rms(x, lp['ln2'], cfg.norm_eps)
    x = x + (jax.nn.silu(h @ lp['wg']) * (h @ lp['wu'])) @ lp['wd']
  logits = _rms(x[:, -1], p['norm'], cfg.norm_eps) @ p['head']
  return logits, tuple(new)


def peer_generate(cfg, max_new, greedy, p, prompt_BxP, key, temperature):
  """Prefill, then a while loop of one token per iteration: tokens [B, max_new]."""
  b, plen = prompt_BxP.shape
  slots = plen + max_new
  caches = tuple((jnp.zeros((b, slots, cfg.n_kv_heads, cfg.head_dim)),) * 2
                 for _ in p['layers'])

  def pick(logits, i):
    if greedy:
      return jnp.argmax(logits, -1).astype(jnp.int32)
    return jax.random.categorical(jax.random.fold_in(key, i), logits / temperature
                                  ).astype(jnp.int32)

  logits, caches = peer_forward(cfg, p, prompt_BxP, 0, caches)
  tok = pick(logits, 0)
  out = jnp.zeros((b, max_new), jnp.int32).at[:, 0].set(tok)

  def body(carry):
    i, tok, out, caches = carry
    logits, caches = peer_forward(cfg, p, tok[:, None], plen + i - 1, caches)
    tok = pick(logits, i)
    return i + 1, tok, out.at[:, i].set(tok), caches

  _, _, out, _ = jax.lax.while_loop(lambda c: c[0] < max_new, body,
                                    (jnp.int32(1), tok, out, caches))
  return out


# -- the comparison --------------------------------------------------------------------------
def peer_shape_model(smoke: bool = False):
  """The random model of the peer shape (stdlib_mtp's M 3 sequential MTP); --smoke: tiny."""
  config = common_config()
  if smoke:
    return random_model(config, 32, 1, vocab=64, heads=(2, 16))
  return random_model(config, 256, 4, vocab=4096, heads=(4, 64))


def common_config():
  import train_throughput  # pylint: disable=import-outside-toplevel
  return train_throughput.load_config('stdlib_mtp')


def main(argv=None) -> int:
  args = parse(argv)
  run_info = common.start(args, NAME, argv)
  model = peer_shape_model(args.smoke)
  cfg = model.args
  dec = Decoder(model)
  params = peer_params(model)
  rng = np.random.default_rng(0)
  prompt = rng.integers(2, cfg.vocab_size, (1, args.prompt_len)).astype(np.int32)
  n = args.max_new_tokens
  peers = {}
  for greedy in (True, False):
    fn = jax.jit(functools.partial(peer_generate, cfg, n, greedy))
    peers[greedy] = fn.lower(params, prompt, jax.random.key(0), np.float32(1.0)).compile()

  # Same function: the peer's greedy tokens equal the project's, token for token.
  mine = dec.generate(prompt.tolist(), n, num_drafts=0, eos_id=None).tokens[0]
  theirs = np.asarray(peers[True](params, prompt, jax.random.key(0), np.float32(1.0)))[0]
  if not np.array_equal(mine, theirs):
    bad = int(np.argmax(mine != theirs))
    print(f'error: greedy outputs differ from token {bad} on (project '
          f'{mine[bad:bad + 8].tolist()}, peer {theirs[bad:bad + 8].tolist()})', file=sys.stderr)
    return 1
  print(f'greedy outputs identical ({n} tokens)', file=sys.stderr)

  off_dec = [None]  # the Decoder with the --ab option off, made on first use

  def project(temperature, num_drafts=0, off=False, **kw):
    def run(i):
      d = dec
      if off:
        if off_dec[0] is None:
          off_dec[0] = Decoder(model, **{args.ab: False})
        d = off_dec[0]
      return d.generate(prompt.tolist(), n, num_drafts=num_drafts, temperature=temperature,
                        eos_id=None, seed=i, **kw).seconds
    return run

  def peer(greedy):
    def run(i):
      key = jax.random.key(i)
      t0 = time.perf_counter()
      jax.block_until_ready(peers[greedy](params, prompt, key, np.float32(1.0)))
      return time.perf_counter() - t0
    return run

  t1 = {'project_t1': {}}  # the project's T = 1 variants: generate() keywords
  if args.spec_drafts:
    t1[f'project_spec_t1_d{args.spec_drafts}'] = dict(num_drafts=args.spec_drafts)
  if args.filters:
    t1['project_t1_topk50'] = dict(top_k=50)
    t1['project_t1_topp0.9'] = dict(top_p=0.9)
    if args.spec_drafts:
      t1[f'project_spec_t1_d{args.spec_drafts}_topp0.9'] = dict(num_drafts=args.spec_drafts,
                                                               top_p=0.9)
  variants = {'project_greedy': project(0.0), 'peer_greedy': peer(True),
              'peer_t1': peer(False)}
  variants.update({k: project(1.0, **kw) for k, kw in t1.items()})
  ab = list(t1)
  if args.ab:
    variants.update({f'{k}_off': project(1.0, off=True, **kw) for k, kw in t1.items()})
  # Compile and warm up, untimed: every form, the _off ones on their own Decoder.
  for run in variants.values():
    run(0)
    run(0)
  times = {k: [] for k in variants}
  for i in range(args.rounds):
    for k, run in variants.items():
      times[k].append(run(i + 1))

  def tps(k, how):
    return n / float(how(times[k]))
  report = {
      'shape': {'n_layers': cfg.n_layers, 'd_model': cfg.d_model, 'n_heads': cfg.n_heads,
                'head_dim': cfg.head_dim, 'mlp_dim': cfg.mlp_dim, 'vocab_size': cfg.vocab_size,
                'batch': 1, 'prompt_len': args.prompt_len, 'max_new_tokens': n},
      'rounds': args.rounds, 'greedy_identical': True,
      'ab': args.ab or None,  # *_off: the T = 1 variants compiled with that switch off
      'tokens_per_sec': {k: {'best': tps(k, np.min), 'median': tps(k, np.median)}
                         for k in variants},
      'ms_per_token_median': {k: 1e3 * float(np.median(v)) / n for k, v in times.items()},
  }
  def paired(a, b):  # median over rounds of b's time / a's time in the same round
    return float(np.median(np.asarray(times[b]) / np.asarray(times[a])))
  report['project_over_peer_paired_median'] = {
      mode: paired(f'project_{mode}', f'peer_{mode}') for mode in ('greedy', 't1')}
  report['project_over_peer'] = {
      mode: {how: report['tokens_per_sec'][f'project_{mode}'][how]
             / report['tokens_per_sec'][f'peer_{mode}'][how] for how in ('best', 'median')}
      for mode in ('greedy', 't1')}
  if args.ab:  # tokens/s with the switch on over off
    report['on_over_off'] = {
        k: {how: report['tokens_per_sec'][k][how] / report['tokens_per_sec'][f'{k}_off'][how]
            for how in ('best', 'median')} for k in ab}
    report['on_over_off_paired_median'] = {k: paired(k, f'{k}_off') for k in ab}
  report['t1_over_greedy'] = {
      who: {how: report['tokens_per_sec'][f'{who}_t1'][how]
            / report['tokens_per_sec'][f'{who}_greedy'][how] for how in ('best', 'median')}
      for who in ('project', 'peer')}
  print(json.dumps(report, indent=1))
  common.write(run_info, report)
  return 0


if __name__ == '__main__':
  sys.exit(main())
