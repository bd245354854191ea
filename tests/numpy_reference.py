"""An independent float64 numpy implementation of docs/design.md sections 1-3, for tests.

Written from the equations, loop-by-loop where that is clearer, sharing no code with
mtp_jax: a bug in the JAX model or loss shows up as a mismatch here.
"""
import numpy as np


def rmsnorm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope(x_TxNxH, pos_T, theta):
  h = x_TxNxH.shape[-1]
  half = h // 2
  out = np.empty_like(x_TxNxH)
  for t in range(x_TxNxH.shape[0]):
    for j in range(half):
      ang = pos_T[t] * theta ** (-(2 * j) / h)
      a, b = x_TxNxH[t, :, j], x_TxNxH[t, :, j + half]
      out[t, :, j] = a * np.cos(ang) - b * np.sin(ang)
      out[t, :, j + half] = b * np.cos(ang) + a * np.sin(ang)
  return out


def silu(g):
  return g / (1.0 + np.exp(-g))


def causal_attention(q_TxNxH, k_TxKxH, v_TxKxHv, seg_T, scale, do_TxNxHv=None):
  """softmax(q k^T * scale) v over the earlier positions of the same document, one sequence;
  query head n reads kv head n // (N / K). With do: also (dq, dk, dv), the gradients of
  sum(out * do), from the softmax Jacobian (dS = P (dP - rowsum(P dP)))."""
  t, n, _ = q_TxNxH.shape
  group = n // k_TxKxH.shape[1]
  allowed = (np.arange(t)[None, :] <= np.arange(t)[:, None]) & (seg_T[:, None] == seg_T[None, :])
  out = np.zeros((t, n, v_TxKxHv.shape[-1]))
  dq, dk, dv = np.zeros(q_TxNxH.shape), np.zeros(k_TxKxH.shape), np.zeros(v_TxKxHv.shape)
  for head in range(n):
    kv = head // group
    s = np.where(allowed, q_TxNxH[:, head] @ k_TxKxH[:, kv].T * scale, -np.inf)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    out[:, head] = p @ v_TxKxHv[:, kv]
    if do_TxNxHv is not None:
      dp = do_TxNxHv[:, head] @ v_TxKxHv[:, kv].T
      ds = p * (dp - np.sum(p * dp, axis=1, keepdims=True))
      dq[:, head] = ds @ k_TxKxH[:, kv] * scale
      dk[:, kv] += ds.T @ q_TxNxH[:, head] * scale
      dv[:, kv] += p.T @ do_TxNxHv[:, head]
  return out if do_TxNxHv is None else (out, dq, dk, dv)


def mla_attention(a, h_TxD, pos_T, seg_T, eps, theta):
  """Multi-head latent attention (DeepSeek-V3 eqs. 1-11), widths read off the kernels.

  Scores as the sum of a no-RoPE part (per-head keys from the kv latent) and a RoPE part
  (one rotary key per token, shared by the heads), rather than one concatenated dot.
  """
  kvr = a['kv_a_layernorm']['scale'].shape[0]
  dr = a['kv_a_proj_with_mqa']['kernel'].shape[1] - kvr
  dv = a['o_proj']['kernel'].shape[1]
  if 'q_a_proj' in a:
    c_q = rmsnorm(h_TxD @ a['q_a_proj']['kernel'], a['q_a_layernorm']['scale'], eps)
    q = np.einsum('tr,rnh->tnh', c_q, a['q_b_proj']['kernel'])
  else:
    q = np.einsum('td,dnh->tnh', h_TxD, a['q_proj']['kernel'])
  dn = q.shape[-1] - dr
  q_nope, q_rope = q[..., :dn], rope(q[..., dn:], pos_T, theta)
  kv_a = h_TxD @ a['kv_a_proj_with_mqa']['kernel']
  c_kv = rmsnorm(kv_a[:, :kvr], a['kv_a_layernorm']['scale'], eps)
  k_rope = rope(kv_a[:, None, kvr:], pos_T, theta)[:, 0]
  kv = np.einsum('tr,rnh->tnh', c_kv, a['kv_b_proj']['kernel'])
  k_nope, v = kv[..., :dn], kv[..., dn:]
  t, n = h_TxD.shape[0], q.shape[1]
  out = np.zeros((t, n, dv))
  for head in range(n):
    for i in range(t):
      allowed = [j for j in range(i + 1) if seg_T[j] == seg_T[i]]
      s = np.array([q_nope[i, head] @ k_nope[j, head] + q_rope[i, head] @ k_rope[j]
                    for j in allowed]) / np.sqrt(dn + dr)
      w = np.exp(s - s.max())
      w /= w.sum()
      out[i, head] = sum(wj * v[j, head] for wj, j in zip(w, allowed))
  return np.einsum('tnh,nhd->td', out, a['o_proj']['kernel'])


def allowed_experts(sel_E, n_group, topk_group):
  """Node-limited routing: the experts of the topk_group groups whose two best sel are
  highest (all experts when n_group == 1)."""
  e = len(sel_E)
  if n_group == 1:
    return np.arange(e)
  size = e // n_group
  group_score = [np.sort(sel_E[g * size:(g + 1) * size])[::-1][:2].sum() for g in range(n_group)]
  best = np.argsort(-np.asarray(group_score), kind='stable')[:topk_group]
  return np.concatenate([np.arange(g * size, (g + 1) * size) for g in sorted(best)])


def moe_route(m, h_TxD, top_k, scaling, n_group=1, topk_group=1):
  """Per token: (selected experts, their gates, all sigmoid affinities), token by token."""
  bias = m['gate']['e_score_correction_bias']
  out = []
  for x in h_TxD:
    s = 1.0 / (1.0 + np.exp(-(x @ m['gate']['kernel'])))
    sel = s + bias  # the bias picks ...
    ok = allowed_experts(sel, n_group, topk_group)
    chosen = list(ok[np.argsort(-sel[ok], kind='stable')[:top_k]])
    g = s[chosen] / s[chosen].sum() * scaling  # ... the affinities weigh
    out.append((chosen, g, s))
  return out


def moe_mlp(m, h_TxD, top_k, scaling, n_group=1, topk_group=1):
  """DeepSeekMoE: shared SwiGLU + gated sum of the selected routed SwiGLU experts."""
  e = m['experts']
  out = np.zeros_like(h_TxD)
  for t, (chosen, g, _) in enumerate(moe_route(m, h_TxD, top_k, scaling, n_group, topk_group)):
    x = h_TxD[t]
    for i, gi in zip(chosen, g):
      out[t] += gi * ((silu(x @ e['gate_proj'][i]) * (x @ e['up_proj'][i])) @ e['down_proj'][i])
  if 'shared_experts' in m:
    sh = m['shared_experts']
    out += (silu(h_TxD @ sh['gate_proj']['kernel']) * (h_TxD @ sh['up_proj']['kernel'])
            ) @ sh['down_proj']['kernel']
  return out


def moe_balance(m, h_TxD, top_k, scaling):
  """One sequence's sum_i f_i P_i (DeepSeek-V3 eqs. 17-20, without alpha), and its load."""
  routes = moe_route(m, h_TxD, top_k, scaling)
  n_exp, t = len(routes[0][2]), len(routes)
  load = np.zeros(n_exp)
  p = np.zeros(n_exp)
  for chosen, _, s in routes:
    load[chosen] += 1
    p += s / s.sum() / t
  return float(np.sum(load * n_exp / (top_k * t) * p)), load


def block(p, x_TxD, pos_T, seg_T, eps, theta, moe=(2, 1.0)):
  """One pre-norm block on a single sequence; attention within a document, causal.

  MLA and MoE blocks are recognised by their parameter names; moe = (top_k, scaling).
  """
  t = x_TxD.shape[0]
  a = p['self_attn']
  h = rmsnorm(x_TxD, p['input_layernorm']['scale'], eps)
  if 'kv_a_proj_with_mqa' in a:
    return _mlp_half(p, x_TxD + mla_attention(a, h, pos_T, seg_T, eps, theta), eps, moe)
  q = rope(np.einsum('td,dnh->tnh', h, a['q_proj']['kernel']), pos_T, theta)
  k = rope(np.einsum('td,dkh->tkh', h, a['k_proj']['kernel']), pos_T, theta)
  v = np.einsum('td,dkh->tkh', h, a['v_proj']['kernel'])
  n_heads, n_kv = q.shape[1], k.shape[1]
  group = n_heads // n_kv
  out = np.zeros_like(q)
  for head in range(n_heads):
    kv = head // group  # query heads share key/value heads in contiguous groups
    for i in range(t):
      allowed = [j for j in range(i + 1) if seg_T[j] == seg_T[i]]
      s = np.array([q[i, head] @ k[j, kv] for j in allowed]) / np.sqrt(q.shape[-1])
      w = np.exp(s - s.max())
      w /= w.sum()
      out[i, head] = sum(wj * v[j, kv] for wj, j in zip(w, allowed))
  return _mlp_half(p, x_TxD + np.einsum('tnh,nhd->td', out, a['o_proj']['kernel']), eps, moe)


def _mlp_half(p, x, eps, moe):
  m = p['mlp']
  h = rmsnorm(x, p['post_attention_layernorm']['scale'], eps)
  if 'experts' in m:
    return x + moe_mlp(m, h, *moe)
  g = h @ m['gate_proj']['kernel']
  u = h @ m['up_proj']['kernel']
  return x + (silu(g) * u) @ m['down_proj']['kernel']


def forward(params, tokens_T, pos_T, seg_T, depth, kind='sequential', eps=1e-6, theta=1e4,
            moe=(2, 1.0), offsets=None):
  """[h^0, ..., h^D] for one sequence; sequential depth k reads t_{i+o_k-1} (0 past the
  end), o_k = offsets[k - 1] or k + 1."""
  offsets = list(offsets or range(2, depth + 2))
  emb = params['embed']['embedding']
  t = len(tokens_T)
  x = emb[tokens_T]
  for i in sorted(params['layers']):
    x = block(params['layers'][i], x, pos_T, seg_T, eps, theta, moe)
  hs = [x]
  for k in range(1, depth + 1):
    p = params['mtp'][k - 1]
    if kind == 'sequential':
      s = offsets[k - 1] - 1
      shifted = np.array([tokens_T[i + s] if i + s < t else 0 for i in range(t)])
      e = rmsnorm(emb[shifted], p['enorm']['scale'], eps)
      hprev = rmsnorm(hs[-1], p['hnorm']['scale'], eps)
      inp = np.concatenate([e, hprev], axis=-1) @ p['eh_proj']['kernel']
    else:
      inp = hs[0]
    hs.append(block(p['block'], inp, pos_T, seg_T, eps, theta, moe))
  return hs


def head_logits(params, h, depth, eps=1e-6):
  scale = (params['norm']['scale'] if depth == 0
           else params['mtp'][depth - 1]['shared_head']['norm']['scale'])
  w = params['lm_head']['kernel'] if 'lm_head' in params else params['embed']['embedding'].T
  return rmsnorm(h, scale, eps) @ w


def loss(params, tokens_BxT, pos_BxT, seg_BxT, depth, weights, kind='sequential', offsets=None):
  """L = L_main + sum_k w_k L^k with §3's valid positions; also per-depth (sum, count).
  offsets: o_1..o_M, depth k's target t_{i+o_k} (default k + 1)."""
  heads = [1] + list(offsets or range(2, depth + 2))
  b, t = tokens_BxT.shape
  sums = np.zeros(depth + 1)
  counts = np.zeros(depth + 1)
  for r in range(b):
    hs = forward(params, tokens_BxT[r], pos_BxT[r], seg_BxT[r], depth, kind, offsets=offsets)
    for k in range(depth + 1):
      logits = head_logits(params, hs[k], k)
      for i in range(t):
        j = i + heads[k]
        if seg_BxT[r, i] == 0 or j >= t or seg_BxT[r, j] != seg_BxT[r, i]:
          continue
        z = logits[i] - logits[i].max()
        logp = z - np.log(np.exp(z).sum())
        sums[k] -= logp[tokens_BxT[r, j]]
        counts[k] += 1
  means = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
  total = means[0] + sum(weights[k - 1] * means[k] for k in range(1, depth + 1))
  return total, sums, counts
