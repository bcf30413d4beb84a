"""Static configuration of the threshold-filter top-K kernels."""
from __future__ import annotations

import dataclasses

from pallas_kernels._util import is_pow2


__all__ = [
    "TopkConfig"
]


@dataclasses.dataclass(frozen=True)
class TopkConfig:
  """chunk: scores per program in the filter passes (power of two, >= 128). 2048: at 64 x 128K
    x 2048 on the H200 the whole call's kernels take 65.4 us at 2048, 66.5 at 1024 and 71.1 at
    4096 (4 warps), 85.1 at 8192 (8 warps; benchmarks/results/session9/); one row of 128K /
    1M takes 36.5 / 43.1 us at 2048 against 39.0 / 44.4 at 4096.
  small_chunk, small_chunk_entries: calls of at most small_chunk_entries scores (rows x N;
    0: none) use chunks of small_chunk instead (GPU): there the filter passes are one short
    wave, and more, shorter programs finish sooner. On the H200 (benchmarks/results/
    session16/topk_falsi_*_s16b.json, kernel time of the whole call) chunks of 512 took one
    row of 32K x 2048 from 13.39 to 12.79 us, 128K 13.82 -> 13.34, 32K x 512 10.03 -> 9.35,
    8 x 32K x 2048 20.46 -> 20.13, but 1M 16.55 -> 17.27 and 64 x 128K 40.26 -> 45.38.
  bucket_chunk, bucket_chunk_min_entries: the small-call chunk where the compaction fills
    two value buckets (`buckets_for`; 0: small_chunk), for calls of at least
    bucket_chunk_min_entries scores. 1024 from 2**16 (session 21): at one row of 64K / 128K
    / 256K x 2048 the call took 10.01 / 10.50 / 11.25 us of kernels with chunks of 512 and
    9.88 / 10.34 / 10.82 with 1024 (benchmarks/results/session21/topk_chunk_s21e.json),
    but one row of 32K x 2048 9.01 with 512 (topk_table_s21d.json) and 9.34 with 1024
    (topk_table_s21f.json). Without buckets (k = 512) 512 stays: 1024 took one row of 32K /
    128K x 512 from 6.91 / 7.29 to 7.13 / 7.44 (topk_chunk512_s21b.json).
  capacity_factor: candidate buffer = capacity_factor * k (rounded up to a power of two);
    a row with more candidates than that makes the call fall back to a full sort (still exact).
  groups_per_k: the group maxima, padded to a power of two, number at least groups_per_k * k
    (sets the group size, `group_size`).
  max_group, max_group_rows: the largest group (a power of two) for calls of at most
    max_group_rows rows on GPU; other calls (and TPU) stop at 64. Past N = 2 * max_group *
    groups_per_k * k the maxima outnumber groups_per_k * k, and the threshold kernel's time
    grows with them. On the H200 (benchmarks/results/session16/topk_groups_*_s16e.json,
    kernel time of the whole call) groups of up to 256 took one row of 512K x 512 from 12.31
    to 11.34 us, 1M x 512 15.64 -> 13.05, 8 x 1M x 512 27.2 -> 22.1 (the threshold kernel
    11.0 -> 3.5), but 64 x 512K x 512 58.8 -> 76.7 and 64 x 1M x 512 97.7 -> 107.8 (there
    the gathering compaction reads four times as many entries per listed group).
  num_warps: Triton launch option (GPU only).
  threshold: "falsi" (the default: GPU kernel, no sort; regula falsi on the value, the first
    probe from the maxima's mean and deviation, later ones interpolated between the
    bracket's counts, `gpu._search`; stops within `falsi_slack` maxima of k), "bisect" (the
    same kernel, `bisect_iters` steps of bisection) or "sort" (`lax.top_k` over the group
    maxima). A step is one count over all the maxima, so the kernel's time is steps x
    maxima: on the H200 (benchmarks/results/session16/topk_falsi_*_s16b.json, kernel time)
    falsi took the threshold kernel at one row of 128K x 2048 from 5.10 to 3.07 us (the
    whole call 15.85 -> 13.82), 1M 7.31 -> 3.16 (20.30 -> 16.55), 8 x 32K 5.11 -> 3.06
    (22.56 -> 20.46), 64 x 128K 9.12 -> 6.29 (42.99 -> 40.26).
  bisect_iters: bisection steps for the threshold, the most probes for "falsi". 14: the
    threshold kernel 6.8 -> 5.4 us at 64 x 128K on the H200 against 20 steps
    (benchmarks/results/session10/topk_variants_b64.json); on random rows the candidates stay
    far under the buffer (benchmarks/NOTES.md, session 9).
  falsi_slack, falsi_slack_entries: for threshold="falsi", how many maxima above k may reach
    the threshold when the search stops (at most `bisect_iters` probes either way): the
    larger of falsi_slack and falsi_slack_entries / the group size (`slack_for`), so that
    the slack admits about as many extra entries whatever the group size. 1024 entries (the
    default since session 20: a slack of 256 for groups of 4, as at one row of 32K x 2048;
    64 from groups of 16 on): on the H200 (benchmarks/results/session20/
    topk_threshold_s20d.json, kernel time of the whole call) a slack of 256 took one row of
    32K x 2048 from 9.88 to 9.25 us (the threshold 2.94 -> 2.31, the finish unchanged), but
    128K x 2048 (groups of 16) from 10.54 to 10.62 (the threshold -0.28, the finish +0.37:
    each extra maximum there admits up to 16 entries).
  finish: how the candidates become the sorted top-k (GPU): "bitonic" (one Pallas program
    per row sorts its candidates by (value, index) with a bitonic network in registers;
    order-free, so the candidates are compacted in one pass, chunk ranges reserved by an
    atomic add, no count pass), "sort" (`lax.top_k` over the candidate buffer, ~31 us on the
    H200 whatever the batch), "rank" (sorting by counting, `gpu.rank_finish`: a grid of
    rank_block_i x rank_block_j tiles counts, for every candidate, the candidates before it,
    and each is put in its place (by the last tile of its block, fused_rank, or a second
    kernel); O(candidates^2) compares but no dependent
    chain; order-free too), "persistent" (below) or "auto" (the default: persistent for at
    most `persist_max_rows` rows, none by default; else rank for at most `rank_max_rows`
    rows when k >= `rank_min_k`, else bitonic). On the H200 (benchmarks/results/session15/
    topk_small_*_s15a.json, kernel time of the whole call, k = 2048) the rank finish took
    one row of 128K from 21.9 to 18.8 us (32 x 256 tiles; 19.5 at 64 x 256), 1M 27.1 ->
    23.7, 32K 21.6 -> 19.1, but 8 rows of 32K 22.8 -> 37.7 (the compares fill the GPU); at
    k = 512 it then tied with bitonic (13.3-20.2 us); since session 16's place kernel (no
    read of the whole candidate row) it wins there too (`rank_min_k`). "persistent"
    (`gpu.persistent_select`): after the group maxima, one
    kernel of (rows, programs) programs does the threshold, the compaction, a barrier
    between the row's programs and a rank finish (see persist_max_rows for its times).
  rank_max_rows, rank_min_k: the "auto" rule above. rank_min_k 512: at one row of 32K /
    128K x 512 the rank finish took the call from 13.99 / 14.46 to 12.27 / 12.68 us
    (benchmarks/results/session16/topk_k512_s16a.json).
  rank_block_i, rank_block_j: the rank finish's tile (powers of two, >= 8 and >= 16);
    see rank_rows for rank_block_i's default. rank_block_j 256 (session 21; 512 before): at
    one row of 32K / 128K x 2048 the call took 9.30 / 10.49 us of kernels with 512 and
    9.09 / 10.42 with 256 (benchmarks/results/session21/topk_knobs{32k,128k}_s21c.json): a
    bucket's edges waste less of a shorter block. Without buckets (k = 512) it costs a
    little: one row of 32K x 512 6.86 -> 6.97 (topk_finish512_s21d.json);
    rank_warps: the warps of its programs. 16 x 512 at 4 warps: at one row of 128K the count
    kernel took 4.2 us and the whole call 16.3-16.5, against 6.6 / 18.7 at 32 x 256 and 7.2
    / 19.5 at 64 x 256 (benchmarks/results/session15/topk_rank_tiles_s15{e,f}.json): narrow,
    long tiles win.
  persist_max_rows: "auto" takes the persistent finish for calls of at most this many rows
    (0, the default: never). Exact on the H200 (compiled tests) but slower there: one row of
    32K x 2048 took 19.1 us of kernels (group maxima 1.0, the persistent kernel 18.1)
    against 12.6 for session 16's six-kernel path (topk_persist_k2048_s17b.json); the kernel cut
    after its barrier took 5.5 us, so its rank step is what loses (benchmarks/results/
    session17/topk_steps_s17c.json, benchmarks/NOTES.md session 17).
  persist_programs: programs per row of the persistent kernel; 0 (the default): the largest
    power of two with rows * programs <= the GPU's SMs, which the kernel's barrier needs
    (each program stays resident while it waits).
  persist_block_i, persist_block_j: the candidates each program ranks at a time, and the
    block size in which it reads the others (powers of two >= 16); persist_warps: warps of
    the persistent kernel's programs.
  persist_spin: how many times a program polls the barrier before it gives up and writes
    its row's top-k alone (exact, slow; the safeguard against programs that are not all
    resident).
  fused_rank: True, the rank finish is one kernel: the count tile that finishes last for a
    block of candidates sums the block's partial counts and places the candidates (an
    arrival counter per block, zeroed by the group maxima kernel; the default, used when
    rank_rows is False); False, a second kernel places them. On the H200
    (benchmarks/results/session18/topk_fused_k2048_s18a.json, kernel time, one row of k =
    2048) count + place took 5.63 -> 5.40 us at 32K, 5.82 -> 5.48 at 128K, 6.07 -> 5.74 at
    1M.
  rank_rows: True (the default), the rank finish is one kernel of (rows, capacity /
    rank_block_i) programs, each ranking its block of candidates against the whole row: the
    compares are accumulated elementwise over the row's blocks of rank_block_j and reduced
    once, then the block is placed; no partial counts, no counters, no atomics
    (`gpu._rank_rows_kernel`). Takes precedence over fused_rank. On the H200 (benchmarks/
    results/session19/topk_rows_*_s19a.json, kernel time of the whole call, against
    fused_rank) one row of 32K x 2048 took 11.30 -> 11.12 us (the finish 5.52 -> 5.28), 32K x
    512 8.05 -> 7.19, 128K x 512 8.49 -> 7.63; with rank_block_i=32 the finish took 10.72,
    so a program's time grows with its compares (blocks of 16 then). At 8 rows of 32K x
    2048 it lost to the split bitonic finish (15.77 us against 11.7,
    topk_rows_b8_s19a.json).
  rank_block_i 8 (the default since session 20; 16 before): the busiest SM's compares bound
    the per-block finish, and smaller blocks spread them over more SMs. On the H200
    (benchmarks/results/session20/topk_onerow*_s20b.json, kernel time of the whole call,
    blocks of 16 -> 8) one row of 32K / 128K / 512K x 2048 took 10.88 / 11.92 / 13.73 ->
    10.56 / 11.03 / 12.13 us, 32K x 512 7.11 -> 6.85.
  rank_preload: with rank_rows, the blocks of rank_block_j each program loads before its
    first compare; 0 (the default): enough for k * 1.25 candidates. The rest are loaded one
    block at a time in a loop bounded by the row's live count.
  rank_split_ties: with rank_rows, each compared pair adds (vj > vi) + (vj == vi) * 2**16 to
    one packed accumulator (two compares instead of three, and no logic), and the index
    tie-break runs in a second loop only for a block holding a value that occurs twice
    (capacities up to 2**14; above, ignored). Off: it loses on the H200, one row of 32K x
    2048 with blocks of 8 took 10.57 -> 12.22 us (the finish 4.76 -> 6.36;
    benchmarks/results/session20/topk_variants2048_s20a.json).
  rank_buckets: with rank_rows (and repair_in_finish, the threshold kernel and the "scan"
    compaction reading every chunk: `buckets_for`), the threshold kernel also writes a pivot
    between the threshold and the row's largest maximum, estimated to split the candidates
    in half (`gpu._pivot`, no extra count), and the compaction fills the buffer with the
    candidates at or above it from the front and the others from the back (one scan and one
    two-lane atomic add per chunk, float32 counters). The finish compares each block of
    candidates only with its own bucket and adds the upper bucket's count to the lower's
    ranks: about half the compares, which bound the finish (session 19). On (the default
    since session 20) for k >= rank_buckets_min_k. On the H200 (benchmarks/results/
    session20/topk_onerow*_s20b.json, kernel time of the whole call with blocks of 8) one
    row of 32K / 128K / 512K x 2048 took 10.56 / 11.03 / 12.13 -> 9.84 / 10.48 / 11.69 us
    (at 32K the finish 4.75 -> 3.80, the compaction 1.96 -> 2.19), but 32K x 512 6.85 ->
    7.06: there the finish's ~75 programs fit the SMs once and do not gain.
  rank_buckets_min_k: the smallest k that gets rank_buckets (1024: between the measured
    512, which loses, and 2048, which wins; from ~1100 candidates on, blocks of 8 outnumber
    the H200's 132 SMs).
  rank_pivot_probes: with rank_buckets, counts of the group maxima that refine the pivot
    (`gpu._pivot`: each one reduction in the threshold kernel, plus one for the first).
    0 (the default): the exponential-tail model alone. Its split, as the larger bucket's
    share of one row's candidates at k = 2048 (benchmarks/results/session20/
    pivot_split_cpu.json, interpret mode, 3 random rows each): normal rows 0.58-0.63 at 32K
    and 0.50-0.58 at 128K; exponential, Gumbel and DSA-like ReLU sums 0.51-0.60; uniform
    0.90-0.91; Student-t(3) 0.86-0.99. One probe: normal 0.50-0.56, Student-t 0.56-0.76,
    uniform 0.83-0.84. Two: every distribution but uniform 0.51-0.58, uniform 0.77-0.79.
    On the H200 it loses: one row of 32K x 2048 took 9.28 / 9.92 / 10.12 us of kernels
    with 0 / 1 / 2 probes, 128K 10.53 / 11.07 with 0 / 1: each probe costs the threshold
    kernel ~0.5 us and the finish did not shorten (benchmarks/results/session21/
    topk_pivot_s21a.json, topk_chunk2048_s21a.json).
  repair_in_finish: True, the fused rank finish and the split bitonic finish repair rows
    whose candidates overflowed the buffer themselves (GPU): they read the compaction's
    counters, and for such a row one program (the first rank tile, the row's merge program)
    writes its exact sorted top-k (`gpu._repair_sorted`) while the others leave it; the
    repair kernel (one program per row, a no-op for every row that fits) is not launched.
    False: that kernel runs before the finish. On the H200 (session18/topk_rif_*_s18b.json,
    kernel time of the whole call, with fused_rank) one row of 32K x 2048 took 12.21 -> 11.28
    us, 32K x 512 8.80 -> 7.88, 128K x 512 9.61 -> 8.26; 8 x 32K x 2048 20.08 -> 19.56
    (session18/topk_mid_s18b.json). (Session 18 also measured the compaction's last program
    doing the repair instead: 12.21 -> 12.83 at 32K x 2048, session18/topk_fused_*_s18a.json.)
  bitonic_mid: 0, the split bitonic finish's per-row program does every merge after the
    runs; m (a power of two, bitonic_run < m < capacity), a kernel of (rows, capacity / m)
    programs first merges the runs into blocks of m, so the per-row program does only the
    last log2(capacity / m) merge sizes (GPU). Ignored when not between the two. 2048 (the
    default): 8 x 32K x 2048 took 19.56 -> 18.18 us of kernels on the H200 (the per-row merge
    9.36 -> 3.45, the middle kernel 4.62; session18/topk_mid_s18b.json).
  threshold_warps: warps of the threshold kernel (GPU). 8: with bisection, at one row of 128K it
    takes 5.05 us, 6.13 at 4 warps and 5.20 at 16; at 64 rows 9.12, 12.8 and 8.30
    (benchmarks/results/session15/topk_thr_*_s15b.json).
  bitonic_warps: warps of the bitonic finish's program (GPU; 16: 25.8-27.7 us at 4K
    candidates on the H200, 8: 28.3, 4: 60.6, benchmarks/results/session7/).
  bitonic_run: 0, the bitonic finish is one program per row; r (a power of two), it is two
    kernels running the same network: (rows, capacity / r) programs sort runs of r
    candidates, then one program per row does the remaining merges, dropping the lower half
    in the last one. 512 (the default): the finish takes 17.4 us instead of 25.6 at
    64 x 128K x 2048 on the H200, and one row of 128K 12.3 instead of 23.7
    (benchmarks/results/session10/topk_variants_b*.json).
  bitonic_run_warps: warps of each run-sorting program of the split finish (GPU).
  bitonic_rank_merge, rank_merge_warps, rank_merge_max_rows, rank_merge_min_k: 0, the split
    bitonic finish merges its runs (the middle and per-row merge kernels); b (a power of
    two >= 16; 32, the default), for calls of at most rank_merge_max_rows rows (8) and
    k >= rank_merge_min_k (1024), the runs are sorted descending and one kernel of (rows,
    capacity / b) programs of rank_merge_warps places each entry at the sum of its ranks in
    every run, by binary searches (`gpu._rank_merge_kernel`: log2(bitonic_run) + 1
    dependent probes instead of the merges' ~33 network steps over 2 kernels at capacity
    4096). On the H200 at 8 x 32K x 2048 it took the call 17.63 -> 14.51 us of kernels
    (blocks of 256: 18.54; session22/topk_merge_s22{d,f}.json). At 64 rows it loses
    (28.67 -> 33.5-36.0): every entry does ~80 probes against the network's ~33 steps.
  rank_merge_samples: 0 (the default), the rank merge's searches gather every probe; m (a
    power of two >= 2), their first log2(m) steps compare against m keys of each run
    loaded once a program (capped at bitonic_run); m = 16 gathers 6 probes an entry and
    run instead of 10. Opt-in: on the H200 at 8 x 32K x 2048 the rank merge took 4.90 ->
    5.96 us (m = 16) and 5.82 (m = 32), the whole call 14.84 -> 15.98 / 15.96
    (benchmarks/results/session23/topk_samples_s23a.json).
  rank_merge_live_probes: True (the default), the rank merge's searches load no probe past
    a run's live count (a dead slot's key is known: 0, after every live entry), which is
    ~40% of them with ~k + 15% candidates in a 2k buffer; False, every probe. On the H200
    at 8 x 32K x 2048 it saves only 0.05-0.2 us of the rank merge's ~4.7
    (session23/topk_live_s23{b,e}.json).
  rank_merge_run_warps: warps of the run-sorting programs (bitonic_run_warps' role) where
    the rank merge applies (`rank_merge_for`): at most 8 rows, so few programs (64 at
    8 x 2048), each best with more warps: 8 (the default) took them from 3.81-3.91 to
    3.64-3.66 us at 8 x 32K x 2048 (session23/topk_samples_s23a.json,
    topk_live_s23e.json). With both defaults the call took 14.35 us, against 14.62 without
    (topk_live_s23e.json).
  rank_merge_arity: 2 (the default), the rank merge's searches are binary; a (a power of
    two), each step probes a - 1 places of the range at once and keeps one of a parts:
    at runs of 512, 6 dependent loads a search at a = 4 (14 loads in all) and 4 at a = 8
    (22), against 10 binary. Opt-in: on the H200 at 8 x 32K x 2048 the rank merge took
    4.53 us binary, 4.55 at a = 4 and 5.62 at a = 8 (session23/topk_arity_s23f.json).
  skip_groups: True, the compaction passes (GPU) read only the groups whose maximum reaches
    the threshold (exact: no other group holds a candidate; with 2048 of 128K kept, about a
    quarter of the groups); False (the default), they read every score. On the H200 it
    gains nothing at 64 x 128K (compaction 25.4 us with it, 24.7 without) and 3% at 64 x 1M
    (179.7 / 185.8): the compaction is latency-bound, not byte-bound
    (benchmarks/results/session11/topk_skip_s11a.json).
  compact: how the one-pass compaction before an order-free finish places candidates (GPU):
    "scan", a chunk reserves a range with one atomic add of its count and a chunk-wide scan
    orders its candidates inside it; "rows", the same with the scan split over rows of 32
    lanes; "lane", every candidate takes its slot with its own atomic add on the row's
    counter (no scan, no chunk-wide reduction). Rows over 2**24 entries use "scan" for
    "lane" (the lane counter is a float32). "auto" (the default): "lane" for at least
    `lane_min_rows` rows of at least `lane_min_ratio` * k entries, else "scan". On the H200
    (benchmarks/results/session13/) "lane" took the whole call at 64 x 512K x 2048 from 155.8
    to 141.1 us, 64 x 1M x 2048 284.1 -> 234.2, 64 x 1M x 512 270.6 -> 211.6 and 8 x 1M x
    2048 52.7 -> 47.7, where a 2048-entry chunk holds ~5-9 candidates; it lost where chunks
    hold more (64 x 128K x 2048, ~37: compaction 24.7 -> 35.2 us) and on one row (1 x 1M:
    27.1 -> 30.0), since every candidate's atomic waits for the one before it. "rows" (the
    scan split over rows of 32 lanes) measured no faster than "scan" anywhere.
  lane_min_rows, lane_min_ratio: the "auto" rule above.
  gather: True, before an order-free finish with the threshold kernel (GPU), the threshold
    kernel also lists the groups whose maximum reaches the threshold (each holds at least one
    candidate, so a row lists at most `capacity` of them unless it overflows anyway) and the
    compaction gathers only those groups' entries, `chunk` entries per program
    (`gpu.compact_groups`): about k * group entries per row instead of all N, in a grid of
    capacity * group / chunk programs per row of which only the listed share work. "auto"
    placement is then "scan" (a gathered chunk is as dense in candidates as a chunk of a
    128K row). False: the compaction reads every chunk of the row (`gpu.compact_atomic`).
    "auto" (the default): gather for at least `gather_min_entries` scores in the call. On the
    H200 (benchmarks/results/session14/topk_gather_*_s14b.json, kernel time of the whole
    call) gathering took 64 x 128K x 2048 from 52.5 to 42.5 us (compaction 24.0 -> 9.8,
    threshold 5.4 -> 9.1 with the list), 64 x 1M x 2048 224.5 -> 132.6, 64 x 512K 136.0 ->
    93.1, 64 x 1M x 512 202.9 -> 101.3, 64 x 128K x 512 37.6 -> 26.8, 8 x 1M 45.8 -> 40.4;
    it lost where the row compaction is one short wave anyway: 8 x 128K 25.4 -> 28.2,
    8 x 32K x 2048 22.8 -> 27.2, 8 x 32K x 512 14.0 -> 15.4 (the list scan costs ~3.7 us).
  gather_min_entries: the "auto" rule above.
  """
  chunk: int = 2048
  small_chunk: int = 512
  small_chunk_entries: int = 1 << 18
  bucket_chunk: int = 1024
  bucket_chunk_min_entries: int = 1 << 16
  capacity_factor: int = 2
  groups_per_k: int = 4
  max_group: int = 256
  max_group_rows: int = 8
  num_warps: int = 4
  threshold: str = "falsi"
  bisect_iters: int = 14
  falsi_slack: int = 64
  falsi_slack_entries: int = 1024
  finish: str = "auto"
  rank_max_rows: int = 1
  rank_min_k: int = 512
  bitonic_warps: int = 16
  bitonic_run: int = 512
  bitonic_run_warps: int = 4
  skip_groups: bool = False
  compact: str = "auto"
  lane_min_rows: int = 8
  lane_min_ratio: int = 256
  gather: bool | str = "auto"
  gather_min_entries: int = 1 << 23
  rank_block_i: int = 8
  rank_block_j: int = 256
  rank_warps: int = 4
  threshold_warps: int = 8
  persist_max_rows: int = 0
  persist_programs: int = 0
  persist_block_i: int = 16
  persist_block_j: int = 512
  persist_warps: int = 8
  persist_spin: int = 1 << 20
  fused_rank: bool = True
  repair_in_finish: bool = True
  rank_rows: bool = True
  rank_preload: int = 0
  rank_split_ties: bool = False
  rank_buckets: bool = True
  rank_buckets_min_k: int = 1024
  rank_pivot_probes: int = 0
  bitonic_mid: int = 2048
  bitonic_rank_merge: int = 32
  rank_merge_warps: int = 4
  rank_merge_max_rows: int = 8
  rank_merge_min_k: int = 1024
  rank_merge_samples: int = 0
  rank_merge_live_probes: bool = True
  rank_merge_run_warps: int = 8
  rank_merge_arity: int = 2

  def finish_for(self, rows: int, k: int, persistent: bool = True) -> str:
    """The sorted finish for rows of top-k ("auto" resolved): "persistent", "bitonic", "rank"
    or "sort". persistent=False (no room for the persistent kernel's programs), or
    threshold="sort": "persistent" becomes what "auto" takes without it."""
    how = self.finish
    if how == "auto" and rows <= self.persist_max_rows:
      how = "persistent"
    if how == "persistent" and (not persistent or self.threshold == "sort"):
      how = "auto"  # the persistent kernel searches the threshold itself
    if how == "auto":
      return "rank" if rows <= self.rank_max_rows and k >= self.rank_min_k else "bitonic"
    return how

  def persist_parties(self, rows: int, sms: int) -> int:
    """Programs per row of the persistent kernel for `rows` rows on a GPU of `sms` SMs (0:
    unknown, as in interpret mode): persist_programs if set, else the largest power of two
    with rows * programs <= sms (8 when sms is 0); 0 when fewer than 2 fit."""
    if self.persist_programs:
      return self.persist_programs
    if not sms:
      return 8
    per = sms // rows
    return 1 << (per.bit_length() - 1) if per >= 2 else 0

  def finish_repairs(self, how: str, capacity: int) -> bool:
    """Whether the finish `how` (GPU) repairs overflowing rows itself for a buffer of
    `capacity` (repair_in_finish resolved: the fused or per-block rank finish and the split
    bitonic finish can; the others get the repair kernel before them)."""
    return self.repair_in_finish and (
        (how == "rank" and (self.fused_rank or self.rank_rows))
        or (how == "bitonic" and 0 < self.bitonic_run < capacity))

  def buckets_for(self, how: str, rows: int, n: int, k: int, capacity: int) -> bool:
    """Whether the rank finish `how` of rows x n scores (GPU) gets its candidates in two value
    buckets (rank_buckets resolved: it needs the per-block rank finish repairing rows
    itself, the threshold kernel, and the compaction reading every chunk with "scan", in
    chunks below 2**16 of rows up to 2**24: `gpu.compact_atomic(..., pivot=)`)."""
    return (self.rank_buckets and k >= self.rank_buckets_min_k and how == "rank"
            and self.rank_rows and n <= 1 << 24
            and self.chunk_for(rows, n, buckets=True) < 1 << 16
            and self.finish_repairs(how, capacity) and self.threshold in ("bisect", "falsi")
            and not self.gathers(rows, n) and self.placement(rows, n, k) == "scan")

  def slack_for(self, group: int) -> int:
    """The threshold kernel's stopping slack, in maxima, for groups of `group` scores (0:
    none, bisection)."""
    if self.threshold != "falsi":
      return 0
    return max(self.falsi_slack, self.falsi_slack_entries // group)

  def rank_merge_for(self, rows: int, k: int) -> int:
    """The split bitonic finish's rank merge block for `rows` rows of top-k (0: the merges;
    at most bitonic_run where it applies)."""
    if rows > self.rank_merge_max_rows or k < self.rank_merge_min_k:
      return 0
    return min(self.bitonic_rank_merge, self.bitonic_run)

  def run_warps_for(self, rows: int, k: int) -> int:
    """Warps of the split bitonic finish's run-sorting programs for `rows` rows of top-k:
    rank_merge_run_warps where the rank merge applies, else bitonic_run_warps."""
    return self.rank_merge_run_warps if self.rank_merge_for(rows, k) else self.bitonic_run_warps

  def mid_for(self, capacity: int) -> int:
    """The split bitonic finish's middle block for a buffer of `capacity` (0: none)."""
    return self.bitonic_mid if self.bitonic_run < self.bitonic_mid < capacity else 0

  def chunk_for(self, rows: int, n: int, buckets: bool = False) -> int:
    """The filter passes' chunk for rows x n scores (GPU; the small-call rule resolved);
    buckets: the compaction fills two value buckets (`buckets_for`; bucket_chunk applies)."""
    if rows * n > self.small_chunk_entries:
      return self.chunk
    if buckets and rows * n >= self.bucket_chunk_min_entries:
      return max(self.small_chunk, self.bucket_chunk)
    return self.small_chunk

  def gathers(self, rows: int, n: int) -> bool:
    """Whether the compaction of rows x n scores gathers listed groups ("auto" resolved)."""
    if self.gather == "auto":
      return rows * n >= self.gather_min_entries
    return self.gather

  def placement(self, rows: int, n: int, k: int, gather: bool = False) -> str:
    """The compaction's placement for rows x n entries, k kept, reading every chunk or
    (gather) only the listed groups ("auto" resolved; "lane" only for rows of at most 2**24
    entries)."""
    p = self.compact
    if p == "auto":
      p = "lane" if (not gather and rows >= self.lane_min_rows
                     and n >= self.lane_min_ratio * k) else "scan"
    return "scan" if p == "lane" and n > 1 << 24 else p

  def __post_init__(self):
    if not isinstance(self.max_group, int) or not is_pow2(self.max_group) or self.max_group < 2:
      raise ValueError(f"max_group={self.max_group!r} must be a power of two >= 2")
    for name in ("chunk", "small_chunk"):
      v = getattr(self, name)
      if not isinstance(v, int) or not is_pow2(v) or v < 128:
        raise ValueError(f"{name}={v!r} must be a power of two >= 128")
    if not isinstance(self.bucket_chunk, int) or not (
        self.bucket_chunk == 0 or (is_pow2(self.bucket_chunk) and self.bucket_chunk >= 128)):
      raise ValueError(f"bucket_chunk={self.bucket_chunk!r} must be 0 or a power of two >= 128")
    if not isinstance(self.small_chunk_entries, int) or self.small_chunk_entries < 0:
      raise ValueError(f"small_chunk_entries={self.small_chunk_entries!r} must be an int >= 0")
    if not isinstance(self.bucket_chunk_min_entries, int) or self.bucket_chunk_min_entries < 0:
      raise ValueError(f"bucket_chunk_min_entries={self.bucket_chunk_min_entries!r} must be an "
                       "int >= 0")
    if self.finish not in ("sort", "rank", "bitonic", "persistent", "auto"):
      raise ValueError(f"finish={self.finish!r} must be 'sort', 'rank', 'bitonic', "
                       "'persistent' or 'auto'")
    if self.threshold not in ("bisect", "falsi", "sort"):
      raise ValueError(f"threshold={self.threshold!r} must be 'bisect', 'falsi' or 'sort'")
    if self.compact not in ("auto", "scan", "rows", "lane"):
      raise ValueError(f"compact={self.compact!r} must be 'auto', 'scan', 'rows' or 'lane'")
    for name in ("skip_groups", "fused_rank", "repair_in_finish", "rank_rows",
                 "rank_split_ties", "rank_buckets", "rank_merge_live_probes"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
    if not (isinstance(self.gather, bool) or self.gather == "auto"):
      raise ValueError(f"gather={self.gather!r} must be True, False or 'auto'")
    for name, low in (("rank_block_i", 8), ("rank_block_j", 16), ("persist_block_i", 16),
                      ("persist_block_j", 16)):
      v = getattr(self, name)
      if not isinstance(v, int) or not is_pow2(v) or v < low:
        raise ValueError(f"{name}={v!r} must be a power of two >= {low}")
    for name in ("persist_programs", "persist_max_rows", "rank_preload", "falsi_slack_entries",
                 "rank_pivot_probes", "rank_merge_max_rows"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 0:
        raise ValueError(f"{name}={v!r} must be an int >= 0")
    for name in ("bitonic_run", "bitonic_mid"):
      v = getattr(self, name)
      if not isinstance(v, int) or (v and (not is_pow2(v) or v < 2)):
        raise ValueError(f"{name}={v!r} must be 0 or a power of two >= 2")
    if not isinstance(self.rank_merge_samples, int) or (self.rank_merge_samples and (
        not is_pow2(self.rank_merge_samples) or self.rank_merge_samples < 2)):
      raise ValueError(f"rank_merge_samples={self.rank_merge_samples!r} must be 0 or a power "
                       "of two >= 2")
    if not isinstance(self.rank_merge_arity, int) or not (
        is_pow2(self.rank_merge_arity) and self.rank_merge_arity >= 2):
      raise ValueError(f"rank_merge_arity={self.rank_merge_arity!r} must be a power of two "
                       ">= 2")
    if not isinstance(self.bitonic_rank_merge, int) or (self.bitonic_rank_merge and (
        not is_pow2(self.bitonic_rank_merge) or self.bitonic_rank_merge < 16)):
      raise ValueError(f"bitonic_rank_merge={self.bitonic_rank_merge!r} must be 0 or a power "
                       "of two >= 16")
    for name in ("capacity_factor", "groups_per_k", "num_warps", "bisect_iters", "rank_max_rows",
                 "rank_min_k", "rank_buckets_min_k", "bitonic_warps", "bitonic_run_warps",
                 "lane_min_rows", "lane_min_ratio", "gather_min_entries", "rank_warps",
                 "threshold_warps", "falsi_slack", "max_group_rows", "persist_warps",
                 "persist_spin", "rank_merge_warps", "rank_merge_min_k", "rank_merge_run_warps"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive int")
