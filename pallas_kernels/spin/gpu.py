"""SPIN's GPU kernels (Pallas, Triton backend): A1's max-pooled block scores, block
selection + compaction, and the EMA updates in place.

Block scores (`block_scores_max_gpu`): per block, V's block maximum (state VM), the two
aligned D rows holding its offsets, and V itself only in the newest block.

Selection (`select_compact_gpu`, one program per request): the request's budget, then the
forced, exploited and explored blocks as `jaxsparse.spin.select_blocks` picks them (random
exploration keys made in registers from the PRNG key's words), their ids compacted in
ascending order, and optionally their cache pages, the length rows of the Mosaic scoring
kernel and the step counter advanced in place, in one launch (XLA needs two ranking kernels,
mask algebra, a scatter, a gather and several small kernels for the same).

EMA update (`update_states_gpu`): block states (and, for reductions A0/A1, the slot states V,
D and VM) updated in place.

Per request, only the selected blocks were scored, so only their slots change:
  V[i]       <- a * V[i] + (1 - a) * z[i]         for observed slots i (i < length)
  D[pos - i] <- a * D[pos - i] + (1 - a) * z[i]   (D is indexed by offset from the query)
The kernel reads the block-sparse scoring output as it is laid out (selected blocks in order,
`page` scores each) and touches only the selected blocks' rows of V (and VM) and their
observed offsets of D; the arrays are aliased to the outputs, so nothing else is read or
written (the XLA version rewrites all N slots of both arrays and first scatters the scores
back onto N slots).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import counter_hash, words_seed
from pallas_kernels.topk.gpu import take_best, take_best_keys

__all__ = [
    "NEG_INF", "LENGTH_ROW", "update_states_gpu", "select_compact_gpu", "block_scores_max_gpu"
]


NEG_INF = float("-inf")
# int32 lengths per row of the Mosaic scoring kernel's length input (its ROW, 128 bytes: the
# kernel checks the rows it is given)
LENGTH_ROW = 32


def _ema(old, new, decay):
  """EMA in float32, rounded once to the state's dtype (float32 or bfloat16)."""
  return (decay * old.astype(jnp.float32) + (1 - decay) * new).astype(old.dtype)


def _group_maxima(z, gm_refs, *, group: int):
  """The top-K's first pass, fused into the update's read of z: the maxima of consecutive
  groups of the program's scores z (NaN as -inf, as the top-K's own group-max pass)."""
  if gm_refs:
    zc = jnp.where(z == z, z, NEG_INF)
    gm_refs[0][...] = zc.reshape(z.size // group, group).max(axis=1)


def _split_refs(refs, slots: bool, stepped: bool):
  """The kernel's refs after the inputs (aliased inputs, then outputs: [V, D, VM,] VB, DB,
  age, [step,] warm [, group maxima]) -> (V, D, VM (None without slots), VB, DB, age, (step
  (None when stepped), warm), gm list)."""
  outs = refs[6 if slots else 3:]  # skip the aliased inputs
  v_ref, d_ref, vm_ref = outs[:3] if slots else (None, None, None)
  vb_ref, db_ref, age_ref, *rest = outs[3:] if slots else outs
  stepo_ref = None if stepped else rest.pop(0)
  warm_ref, *gm_refs = rest
  return v_ref, d_ref, vm_ref, vb_ref, db_ref, age_ref, (stepo_ref, warm_ref), gm_refs


def _next_step(step, out_refs):
  """step + 1 (step: the request's int32 counter) and warm = True, from the request's first
  program only (saves XLA two small kernels; every program writing the same word cost the
  H200 ~2 us)."""
  stepo_ref, warm_ref = out_refs

  @pl.when(pl.program_id(1) == 0)
  def _():
    if stepo_ref is not None:
      stepo_ref[...] = jnp.full((1,), step + 1, jnp.int32)
    warm_ref[...] = jnp.full((1,), True, jnp.bool_)


def _tile(sel_ref, pos_ref, len_ref, step_ref, z_ref, *refs, page: int, blocks: int,
          decay: float, group: int, slots: bool, pos_shift: int, stepped: bool):
  """Compiled GPU: all `blocks` selected blocks of the program as one [blocks, page] tile.
  Every load is issued before the first store: the compiled code keeps loads and stores in
  program order (the refs may alias as far as it knows), so a store between two loads costs
  a second memory round trip per program.
    VB[j] <- a VB[j] + (1 - a) m_j,  DB[pos // page - j] <- same,  age[j] <- step
  (m_j: block j's max observed score), and with slots the V, VM and D updates."""
  v_ref, d_ref, vm_ref, vb_ref, db_ref, age_ref, out_refs, gm_refs = _split_refs(refs, slots,
                                                                                stepped)
  pos = pos_ref[0] - pos_shift
  length = len_ref[0]
  step = step_ref[0] - (1 if stepped else 0)  # the step being taken
  j = sel_ref[...]  # [blocks]
  zf = z_ref[...]
  z = zf.reshape(blocks, page)
  i = j[:, None] * page + lax.broadcasted_iota(jnp.int32, (blocks, page), 1)
  row = jnp.broadcast_to(j[:, None] >= 0, (blocks, page))  # constant along each block
  obs = row & (i < length)
  seen = (j >= 0) & (j * page < length)
  ob = pos // page - j  # DB is indexed by block offset from the query's block
  # ---- loads
  vb = plgpu.load(vb_ref.at[j], mask=seen, other=0.0)
  db = plgpu.load(db_ref.at[ob], mask=seen, other=0.0)
  if slots:
    # whole rows of V under a row-constant mask, i unclamped (padding rows point before the
    # array, masked): Triton keeps both as vector accesses (a per-lane mask or a select on i
    # would make them scalar). Unobserved lanes are written back unchanged.
    v = plgpu.load(v_ref.at[i], mask=row, other=0.0)
    o = jnp.where(obs, pos - i, 0)
    d = plgpu.load(d_ref.at[o], mask=obs, other=0.0)
  # ---- compute and stores
  _group_maxima(zf, gm_refs, group=group)
  blk = jnp.max(jnp.where(obs, z, NEG_INF), axis=1)
  plgpu.store(vb_ref.at[j], _ema(vb, blk, decay), mask=seen)
  plgpu.store(db_ref.at[ob], _ema(db, blk, decay), mask=seen)
  plgpu.store(age_ref.at[j], jnp.full((blocks,), step, age_ref.dtype), mask=seen)
  if slots:
    zo = jnp.where(obs, z, 0.0)
    v = jnp.where(obs, _ema(v, zo, decay), v)
    plgpu.store(v_ref.at[i], v, mask=row)
    plgpu.store(vm_ref.at[j], jnp.max(v, axis=1), mask=j >= 0)  # the blocks' new maxima
    plgpu.store(d_ref.at[o], _ema(d, zo, decay), mask=obs)
  _next_step(step, out_refs)


def _loop(sel_ref, pos_ref, len_ref, step_ref, z_ref, *refs, page: int, blocks: int,
          decay: float, group: int, slots: bool, pos_shift: int, stepped: bool):
  """Interpret mode: one block at a time (a masked scatter there is a read-modify-write of
  every lane, so masked lanes get distinct wrapped slots, per block)."""
  v_ref, d_ref, vm_ref, vb_ref, db_ref, age_ref, out_refs, gm_refs = _split_refs(refs, slots,
                                                                                stepped)
  step = step_ref[0] - (1 if stepped else 0)  # the step being taken
  _next_step(step, out_refs)
  _group_maxima(z_ref[...], gm_refs, group=group)
  pos = pos_ref[0] - pos_shift
  length = len_ref[0]
  cap = v_ref.shape[0] if slots else 0
  lane = lax.broadcasted_iota(jnp.int32, (page,), 0)

  def body(s, carry):
    j = sel_ref[s]

    @pl.when((j >= 0) & (j * page < length))
    def _():
      i = j * page + lane
      obs = i < length
      z = z_ref[pl.ds(s * page, page)]
      m = jnp.max(jnp.where(obs, z, NEG_INF)).reshape(1)
      vb_ref[pl.ds(j, 1)] = _ema(vb_ref[pl.ds(j, 1)], m, decay)
      ob = pos // page - j
      db_ref[pl.ds(ob, 1)] = _ema(db_ref[pl.ds(ob, 1)], m, decay)
      age_ref[pl.ds(j, 1)] = jnp.full((1,), step, age_ref.dtype)
      if slots:
        z = jnp.where(obs, z, 0.0)
        v = v_ref[pl.ds(j * page, page)]
        v = jnp.where(obs, _ema(v, z, decay), v)
        v_ref[pl.ds(j * page, page)] = v
        vm_ref[pl.ds(j, 1)] = jnp.max(v).reshape(1)
        o = pos - i  # unobserved lanes (past the query) wrap to distinct slots and are masked
        o = jnp.where(o >= 0, o, o + cap)
        d = plgpu.load(d_ref.at[o], mask=obs, other=0.0)
        plgpu.store(d_ref.at[o], _ema(d, z, decay), mask=obs)

    return carry

  lax.fori_loop(0, blocks, body, 0)


def update_states_gpu(state, z, sel, pos, lengths, *, decay: float, page: int,
                      slots: bool = True, group: int = 0, blocks_per_program: int = 8,
                      stepped: bool = False, num_warps: int = 4, interpret: bool = False):
  """SPIN's EMA update in place, from the scores of the selected blocks only.

  state: dict with VB, DB [B, nb] float32 or bfloat16, age [B, nb] uint32 (or int32), step
  [B] int32, and with slots=True V, D [B, cap] (cap = nb * page) and VM [B, nb] (V's block
  maxima); z [B, W * page] float32 scores of the selected blocks in order; sel [B, W] int32
  block ids (-1: padding, last); pos (None: lengths - 1, computed in the kernel), lengths [B]
  int32; num_warps per program. For every selected block j its request has seen
  (j * page < length), with m_j its max observed score:
    VB[j] <- a VB[j] + (1 - a) m_j,  DB[pos // page - j] <- same,  age[j] <- step,
  and with slots=True, for each observed slot i of it (i < length):
    V[i] <- a V[i] + (1 - a) z_i,  D[pos - i] <- a D[pos - i] + (1 - a) z_i,
  and VM[j] <- the max of V over block j's slots after the update; step <- step + 1 and
  warm <- True.
  V is read and rewritten in whole rows of the selected blocks (unobserved slots unchanged, so
  the accesses stay vector ones); nothing else is read or written (the arrays are aliased to
  the outputs). group > 0 also returns the [B, W * page / group] maxima of consecutive groups
  of z (NaN as -inf): the top-K's first pass, fused into this read of z.
  stepped=True: state["step"] was already advanced (by the selection kernel), so ages get
  step - 1 and no step is returned.
  -> (dict of the updated arrays, [step,] warm, group maxima or None)."""
  bsz, width = sel.shape
  pos_shift = 1 if pos is None else 0
  pos = lengths if pos is None else pos
  bpp = blocks_per_program
  if group and (page % group or group & (group - 1)):
    raise ValueError(f"group={group} must be a power of two dividing page={page}")
  padded = -(-width // bpp) * bpp
  if padded != width:
    sel = jnp.pad(sel, ((0, 0), (0, padded - width)), constant_values=-1)
    z = jnp.pad(z, ((0, 0), (0, (padded - width) * page)), constant_values=NEG_INF)
  names = (("V", "D", "VM") if slots else ()) + ("VB", "DB", "age")
  arrays = [state[n] for n in names]
  rows = [pl.BlockSpec((None, a.shape[1]), lambda b, c: (b, 0)) for a in arrays]
  one = pl.BlockSpec((1,), lambda b, c: (b,))
  out_specs, out_shape = list(rows), [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
  if not stepped:  # step + 1
    out_specs.append(one)
    out_shape.append(jax.ShapeDtypeStruct((bsz,), jnp.int32))
  out_specs.append(one)  # warm
  out_shape.append(jax.ShapeDtypeStruct((bsz,), bool))
  if group:
    out_specs.append(pl.BlockSpec((None, bpp * page // group), lambda b, c: (b, c)))
    out_shape.append(jax.ShapeDtypeStruct((bsz, padded * page // group), jnp.float32))
  body = _loop if interpret else _tile
  out = pl.pallas_call(
      functools.partial(body, page=page, blocks=bpp, decay=float(decay), group=group,
                        slots=slots, pos_shift=pos_shift, stepped=stepped),
      grid=(bsz, padded // bpp),
      in_specs=[pl.BlockSpec((None, bpp), lambda b, c: (b, c)), one, one, one,
                pl.BlockSpec((None, bpp * page), lambda b, c: (b, c)), *rows],
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases={5 + n: n for n in range(len(arrays))},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_spin_update",
  )(sel.astype(jnp.int32), pos.astype(jnp.int32), lengths.astype(jnp.int32),
    state["step"].astype(jnp.int32), z.astype(jnp.float32), *arrays)
  n = len(arrays)
  new = dict(zip(names, out[:n]))
  if not stepped:
    new["step"] = out[n]
  new["warm"] = out[n + (0 if stepped else 1)]
  return new, out[-1][:, :width * page // group] if group else None


# ------------------------------------------------------------------ selection and compaction


def _rank_value(x):
  """NaN as -inf: with the ranking's ordered keys (-0.0 and subnormals as 0), the values as
  `jaxsparse.spin.algorithm.rank_key` ranks them. NaN and -inf then rank after every other
  value, in block order, and still fill the budget."""
  return jnp.where(x == x, x, NEG_INF)


def _select_kernel(s_ref, p_ref, len_ref, warm_ref, *refs, width: int, score_bits: int,
                   random: bool, budget, block: int, num_pages: int, advance: bool):
  """One request of `length` slots (n_blocks = ceil(length / block)): its budget
  (n_exploit, n_explore) = budget(n_blocks); forced blocks (first and newest), the n_exploit
  best other blocks by score, the n_explore best of the rest by priority (ties to the lower
  block; NaN and -inf last, `_rank_value`), or every valid block when cold; then their ids in ascending order at the front of
  the sel row (cumulative-sum positions), -1 after, and the number selected in t. random: p_ref
  holds the PRNG key's uint32 words, the request's seed is `jaxsparse.spin.request_seeds` of
  them and the priorities its 16-bit counter hashes (`random_keys16`), all made here in
  registers. With a block-table row, also the selected blocks' pages (clipped to
  [0, num_pages), 0 for padding) in the same order: the block-sparse scoring kernel's table.
  advance: the request's step counter + 1, written in place (its only reader, this program)."""
  refs = list(refs)
  t_row = refs.pop(0) if num_pages else None
  step_in = refs.pop(0) if advance else None
  step_out = refs.pop() if advance else None
  m_ref, sel_ref, t_ref, *pg_ref = refs
  # every load first: the ranking loops are long, and a load issued after them (the block
  # table, warm) would add a memory round trip at the end
  s = _rank_value(s_ref[...])
  lane = lax.broadcasted_iota(jnp.int32, s.shape, 0)
  length = len_ref[0]
  warm = warm_ref[0]
  if num_pages:
    nt = t_row.shape[0]
    page = (t_row[...] if nt == s.shape[0] else
            plgpu.load(t_row.at[jnp.where(lane < nt, lane, 0)], mask=lane < nt, other=0))
  if random:
    seed = counter_hash(words_seed(lambda i: p_ref[i], p_ref.shape[0]),
                        pl.program_id(0).astype(jnp.uint32))
  else:
    prio = _rank_value(p_ref[...])
  if advance:
    step_out[...] = step_in[...] + 1
  n_blocks = (length + block - 1) // block
  n_exploit, n_explore = budget(n_blocks)
  valid = lane < n_blocks
  forced = valid & ((lane == 0) | (lane == n_blocks - 1))
  exploit = take_best(s, valid & ~forced, n_exploit, bits=score_bits)
  rest = valid & ~forced & ~exploit
  if random:
    keys = counter_hash(seed, lane.astype(jnp.uint32)) >> 16
    explore = take_best_keys(jnp.where(rest, keys, jnp.uint32(0)), rest, n_explore, 16)
  else:
    explore = take_best(prio, rest, n_explore)
  mask = jnp.where(warm, forced | exploit | explore, valid)
  m_ref[...] = mask.astype(jnp.int32)
  pos = jnp.cumsum(mask.astype(jnp.int32)) - 1
  total = jnp.sum(mask.astype(jnp.int32))
  t_ref[...] = total.reshape(1)
  keep = mask & (pos < width)
  count = jnp.minimum(total, width)
  trash = sel_ref.shape[0] - 1 - lane  # masked lanes: distinct slots (see _scatter_width)
  at = jnp.where(keep, pos, trash)
  plgpu.store(sel_ref.at[at], lane, mask=keep)
  tail = (lane >= count) & (lane < width)  # slots [count, width): disjoint from the above
  tat = jnp.where(tail, lane, trash)
  plgpu.store(sel_ref.at[tat], jnp.full(s.shape, -1, jnp.int32), mask=tail)
  if num_pages:
    plgpu.store(pg_ref[0].at[at], jnp.clip(page, 0, num_pages - 1), mask=keep)
    plgpu.store(pg_ref[0].at[tat], jnp.zeros(s.shape, jnp.int32), mask=tail)
    pg_ref[1][...] = jnp.full((LENGTH_ROW,), length, jnp.int32)


def select_compact_gpu(score, prio, lengths, warm, width: int, *, budget, block: int,
                       score_bits: int = 32, block_table=None, num_pages: int = 0, step=None,
                       num_warps: int = 8, interpret: bool = False):
  """score [B, L] float32 (L a power of two >= the number of blocks); prio [B, L] float32
  exploration priorities, or a [n] uint32 PRNG key's words for random exploration (16-bit keys
  made in the kernel); lengths [B] int32 slots per request, warm [B] bool; budget: a function
  n_blocks -> (n_exploit, n_explore) of jnp ops (`jaxsparse.spin.algorithm._budget`, evaluated in the
  kernel; n_exploit and n_explore must not exceed the blocks eligible for them); block: slots
  per block -> (mask [B, L] bool, sel [B, width] int32: the selected block ids ascending, -1
  padded (more than `width` selected are cut), total [B] int32: the number selected, uncut
  [, pages [B, width] int32, length rows [B, LENGTH_ROW] int32]). block_table [B, nt] int32
  with num_pages > 0 also returns the selected blocks' pages, clipped to [0, num_pages), 0 for
  padding, and each request's length repeated over a row (the Mosaic scoring kernel copies
  its length from such a row). step [B] int32 (SPIN's step counters): also returns step + 1,
  written in place of step (donate it, or XLA copies it first).
  score_bits=16 when every score is a bfloat16 value (half the ranking steps)."""
  bsz, length = score.shape
  if length & (length - 1) or width > length:
    raise ValueError(f"score width {length} must be a power of two >= width={width}")
  if (block_table is None) != (num_pages == 0):
    raise ValueError("block_table and num_pages > 0 go together")
  random = prio.ndim == 1
  sw = 2 * length if interpret else width  # see _scatter_width
  row = pl.BlockSpec((None, length), lambda i: (i, 0))
  one = pl.BlockSpec((1,), lambda i: (i,))
  out_row = pl.BlockSpec((None, sw), lambda i: (i, 0))
  in_specs = [row, pl.BlockSpec(prio.shape, lambda i: (0,)) if random else row, one, one]
  args = [score.astype(jnp.float32), prio.astype(jnp.uint32 if random else jnp.float32),
          lengths.astype(jnp.int32), warm.astype(bool)]
  out_specs = [row, out_row, one]
  out_shape = [jax.ShapeDtypeStruct((bsz, length), jnp.int32),
               jax.ShapeDtypeStruct((bsz, sw), jnp.int32),
               jax.ShapeDtypeStruct((bsz,), jnp.int32)]
  if num_pages:
    in_specs.append(pl.BlockSpec((None, block_table.shape[1]), lambda i: (i, 0)))
    args.append(block_table.astype(jnp.int32))
    out_specs += [out_row, pl.BlockSpec((None, LENGTH_ROW), lambda i: (i, 0))]
    out_shape += [jax.ShapeDtypeStruct((bsz, sw), jnp.int32),
                  jax.ShapeDtypeStruct((bsz, LENGTH_ROW), jnp.int32)]
  aliases = {}
  if step is not None:
    aliases = {len(args): len(out_shape)}
    in_specs.append(one)
    args.append(step.astype(jnp.int32))
    out_specs.append(one)
    out_shape.append(jax.ShapeDtypeStruct((bsz,), jnp.int32))
  out = pl.pallas_call(
      functools.partial(_select_kernel, width=width, score_bits=score_bits, random=random,
                        budget=budget, block=block, num_pages=num_pages,
                        advance=step is not None),
      grid=(bsz,), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_spin_select",
  )(*args)
  m, sel, total = out[:3]
  res = (m != 0, sel[:, :width], total)
  if num_pages:
    res += (out[3][:, :width], out[4])
  return res + (out[-1],) if step is not None else res


# ------------------------------------------------------------- A1 block scores (max pooling)


def _block_score_kernel(pos_ref, len_ref, vm_ref, v_ref, d_ref, o_ref, *, page: int,
                        blocks: int, nb: int, interpret: bool, pos_shift: int):
  """`blocks` consecutive blocks j of one request: max(max of V over j's slots below the
  length, max of D over j's offsets pos - j * page - page + 1 ... pos - j * page), -inf past
  the context. V's part is VM[j] for whole blocks and is taken from V's row only for the
  newest (partial) block. With c, r = divmod(pos + 1, page), block j's offsets are lanes >= r
  of D row c - 1 - j (its suffix) and lanes < r of D row c - j (its prefix), which is the
  previous block's suffix row: each D row is loaded once (whole aligned rows under
  row-constant masks, so the loads stay vectorised), split into its two lane ranges, and the
  prefix maxima shifted one block along; only the first block's prefix row is loaded apart."""
  t = pl.program_id(1)
  pos = pos_ref[0] - pos_shift
  length = len_ref[0]
  jv = t * blocks + lax.broadcasted_iota(jnp.int32, (blocks,), 0)
  j = jv[:, None]  # [T, 1]
  lane = lax.broadcasted_iota(jnp.int32, (blocks, page), 1)
  c = (pos + 1) // page
  r = (pos + 1) % page
  newest = (length + page - 1) // page - 1  # -1 for an empty context

  def rows(row, ok):  # indices of whole rows `row` of a [cap] ref, where ok
    idx = row * page + lax.broadcasted_iota(jnp.int32, ok.shape, ok.ndim - 1)
    if interpret:  # the interpreter gathers every lane: keep masked ones in bounds
      idx = jnp.where(ok, idx, 0)
    return idx, ok

  vm = plgpu.load(vm_ref.at[jnp.where(jv < nb, jv, 0) if interpret else jv], mask=jv < nb,
                  other=0.0).astype(jnp.float32)
  vi, vok = rows(j, jnp.broadcast_to(j == newest, (blocks, page)))
  v = plgpu.load(v_ref.at[vi], mask=vok, other=0.0).astype(jnp.float32)
  # D rows c - 1 - j (the blocks' suffix rows), and row c - t * blocks (the first block's
  # prefix row); a row is read only where it exists
  si, sok = rows(c - 1 - j, jnp.broadcast_to((c - 1 - j >= 0) & (j < nb), (blocks, page)))
  drow = plgpu.load(d_ref.at[si], mask=sok, other=0.0).astype(jnp.float32)
  first = c - t * blocks
  lane1 = lax.broadcasted_iota(jnp.int32, (page,), 0)
  fi, fok = rows(first, jnp.broadcast_to((first >= 0) & (first < nb), (page,)))
  dfirst = plgpu.load(d_ref.at[fi], mask=fok, other=0.0).astype(jnp.float32)
  # ---- compute
  vnew = jnp.max(jnp.where(vok & (vi < length), v, NEG_INF), axis=1)
  v = jnp.where(jv == newest, vnew, jnp.where(jv < newest, vm, NEG_INF))
  suf = jnp.max(jnp.where(sok & (lane >= r), drow, NEG_INF), axis=1)
  pre_next = jnp.max(jnp.where(sok & (lane < r), drow, NEG_INF), axis=1)  # block j + 1's prefix
  pre0 = jnp.max(jnp.where(fok & (lane1 < r), dfirst, NEG_INF))
  k = lax.broadcasted_iota(jnp.int32, (blocks, blocks), 0)
  m = lax.broadcasted_iota(jnp.int32, (blocks, blocks), 1)
  pre = jnp.max(jnp.where(m == k - 1, pre_next[None, :], NEG_INF), axis=1)  # shift by one
  pre = jnp.where(jv == t * blocks, pre0, pre)
  o_ref[...] = jnp.maximum(v, jnp.maximum(suf, pre))


def block_scores_max_gpu(vm, v, d, pos, lengths, *, page: int, blocks_per_program: int = 64,
                         num_warps: int = 4, interpret: bool = False):
  """SPIN's max-pooled predicted block scores (reduction A1, pooling max) for B requests:
  vm [B, nb], v, d [B, cap] float32 or bfloat16 (the VM, V and D states, cap = nb * page;
  vm must be V's block maxima), pos (None: lengths - 1, computed in the kernel), lengths [B]
  int32 -> [B, nb] float32, equal to
  `jaxsparse.spin.algorithm._max_pooled_block_scores` per request. One pass over D in whole aligned
  rows (no flipped copy), V's block maxima from vm, and V itself only in the newest block.
  blocks_per_program, num_warps: the tile (`SpinKernelConfig.score_blocks`, `score_warps`)."""
  bsz, cap = v.shape
  nb = cap // page
  bpp = min(blocks_per_program, 1 << (nb - 1).bit_length())
  grid_n = -(-nb // bpp)
  row = pl.BlockSpec((None, cap), lambda b, t: (b, 0))
  one = pl.BlockSpec((1,), lambda b, t: (b,))
  out = pl.pallas_call(
      functools.partial(_block_score_kernel, page=page, blocks=bpp, nb=nb,
                        interpret=interpret, pos_shift=1 if pos is None else 0),
      grid=(bsz, grid_n),
      in_specs=[one, one, pl.BlockSpec((None, nb), lambda b, t: (b, 0)), row, row],
      out_specs=pl.BlockSpec((None, bpp), lambda b, t: (b, t)),
      out_shape=jax.ShapeDtypeStruct((bsz, grid_n * bpp), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_spin_block_scores",
  )((lengths if pos is None else pos).astype(jnp.int32), lengths.astype(jnp.int32), vm, v, d)
  return out[:, :nb]
