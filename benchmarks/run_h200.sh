#!/usr/bin/env bash
# The device driver: one target per argument, logs and JSON in $OUT.
#   bash benchmarks/run_h200.sh TARGET...
# Targets:
#   gguf             collect the SmolLM2 GGUF carried in pieces (.device/g1 .. gN: `split -n N
#                    --numeric-suffixes=1 -a 1` of the file, one piece a call while the machine is
#                    warm) into $GGUF_DIR; once all are there, join them and check the SHA-256.
#                    Installs the `gguf` reader from .device/wheels/ (`pip download --no-deps
#                    gguf`; carry it with the last piece) when the machine lacks it
#   gpu-tests        tests/test_gpu.py compiled on the GPU (~40 min in one process: WORKERS=12
#                    runs it in parallel with pytest-xdist from .device/wheels; or split it over
#                    calls with JAXSPARSE_TEST_PART=1/3 .. 3/3)
#   indexer | topk   the full scoring / top-K benchmark sweeps
#   readme-tables    the README's performance rows (decode, top-K), one file each; the prefill
#                    rows come from prefill-topk
#   train-indexers   long-context lightning indexers (train.indexer, resumes from $RUN)
#   assets           quality report + shipped traces from $RUN/indexers.npz
#   quality          the quality report alone (dense, DSA and true top-K perplexity, recall)
#   inloop           every selection method in the model's loop on held-out text (TEXT: pydoc,
#                    the default, or numpy): perplexity, recall, unscored keys, copy and
#                    passkey; TOKENS (default 8192) and KS (default 256,64) pick the cells,
#                    METHODS the methods, WINDOWS (default 8) the windows; results in
#                    inloop_$TEXT.json (written after each cell) and .png
#   ivf-recall       AttentionIndex vs HiSA recall on real prefill traces, all layers: 8K and
#                    32K (extrapolated; the paper's W / group size / refit R; 47 min on 2 CPU cores
#                    per 32K trace), per-layer plans calibrated on training text (CORPUS).
#                    CONTEXTS="8192 32768" picks contexts; traces are kept in TRACES (default
#                    /tmp) and recorded only when missing; OFFSETS: the calibration texts'
#                    first tokens in CORPUS, pooled (default three texts); LAYERS=2: only
#                    those layers (files *_l2*; a CPU records 32K of layers 0-2 in 4 minutes);
#                    RECORD_ONLY=1: record the missing traces and stop (a later call evaluates)
#   cpu-tables       the README figures measured on a CPU (also runs here): replay, SPIN
#                    studies, TPU estimates, AttentionIndex recall at 256K / 1M, the 8K
#                    group-size and compact-index studies, the corrector (TRACES: the 8K
#                    held-out and training traces of ivf-recall; ~50 minutes on 2 cores)
#   ivf-prefill      AttentionIndex prefill time against full DSA's at 64K, 256K and 1M tokens
#                    (TOKENS=262144 runs one context into ivf_prefill_262144.json, ~5 min with
#                    PROFILE=1; 1M: TOKENS=1048576 WARMUP=1048576 REPEATS=1, most of a call;
#                    TRACE=prefill.npz LAYERS=0,1,2: a real trace's layers tiled to each N;
#                    QUERY_BLOCK=64 BUDGET=49152: shared query blocks; STAGES=N stage times
#                    on N windows, 0 off; PROFILE=1 kernel seconds of whole runs; WARMUP=N
#                    the untimed first run's context, default 65536; METRIC=1 also times the
#                    prefill under a grouping metric fitted on the run's first 8K tokens)
#   prefill-topk     prefill_topk's kernel path against scoring alone and scoring + top-K
#   spin             the SPIN decode step against the full step (scoring + exact top-K): B 64,
#                    40% sparsity, 128K and 512K slots (BATCHES, SLOTS, SPARSITIES widen it;
#                    STEP_ONLY=1 skips the stage timings; SPIN_NAME names the file; EXPLORE=query
#                    SPIN's query exploration). The
#                    command-buffer files: STEP_ONLY=1 SPIN_NAME=spin_step_cmdbuf_off
#                    XLA_FLAGS=--xla_gpu_enable_command_buffer= (and _on with
#                    =FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE
#                    --xla_gpu_graph_min_graph_size=1)
#   prefill-sharded  the sharded prefill on this one GPU against the unsharded path (its
#                    overhead; TOKENS, default 262144,524288: 1M does not fit 80 GB beside it)
# Environment: JAXSPARSE_GGUF (the SmolLM2 GGUF; the machine has no network),
# CORPUS (pre-tokenised training ids, .npy), RUN (training directory, default /root/run),
# TRAIN_SECONDS (checkpoint and stop after this long; a rerun resumes), INDEXER_ARGS (more
# train.indexer options, e.g. "--heads 16 --head-dim 64 --schedule 2048:300,8192:600"),
# INDEXERS (the indexer file `quality` reads, default the shipped one).
set -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# 1M-token runs hold q (16 GB), full DSA's [N, 2048] results and their segments: on an 80 GB
# card the default 75% pool is too small
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-.92}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; RUN=${RUN:-/root/run}; GGUF_DIR=${GGUF_DIR:-/root/g}
if [ -z "$JAXSPARSE_GGUF" ] && [ -f "$GGUF_DIR/smol.gguf" ]; then
  export JAXSPARSE_GGUF=$GGUF_DIR/smol.gguf
fi
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
for what in "$@"; do
  case $what in
    gguf) mkdir -p "$GGUF_DIR"; cp .device/g[0-9]* "$GGUF_DIR/" 2>/dev/null; ls "$GGUF_DIR"
      # join the pieces in order once they are all there (the SHA-256 says when)
      ls "$GGUF_DIR"/g[0-9]* | sort -V | xargs cat > "$GGUF_DIR/joined"
      if python3 -c "import sys; from jaxsparse.model import fetch; \
sys.exit(fetch._sha256(sys.argv[1]) != fetch.GGUF_SHA256)" "$GGUF_DIR/joined"; then
        mv "$GGUF_DIR/joined" "$GGUF_DIR/smol.gguf"; echo "GGUF ready: $GGUF_DIR/smol.gguf"
        export JAXSPARSE_GGUF=${JAXSPARSE_GGUF:-$GGUF_DIR/smol.gguf}  # for later targets of this run
      else echo "GGUF pieces so far do not join to the file yet"; fi
      python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-deps \
        .device/wheels/gguf-*.whl 2>&1 | grep -v WARNING
      python3 -c "import gguf" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$(ls $PWD/.device/wheels/gguf-*.whl)
      python3 -c "import gguf" && echo "gguf reader ready" ;;
    gpu-tests)  # WORKERS processes share the card (compiling dominates; memory grows on demand)
      python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-deps \
        .device/wheels/execnet-*.whl .device/wheels/pytest_xdist-*.whl 2>&1 | grep -v WARNING
      name=$OUT/gpu_tests${JAXSPARSE_TEST_PART:+_${JAXSPARSE_TEST_PART%/*}}
      cmd="python3 -m pytest -q -p no:cacheprovider ${WORKERS:+-n $WORKERS} --durations=10 \
--junitxml=$name.xml tests/test_gpu.py"
      XLA_PYTHON_CLIENT_PREALLOCATE=false $cmd 2>&1 | tee "$name.log" | tail -25
      python3 -m jaxsparse._bench.junit "$name.xml" "$name.json" \
        "${WORKERS:+WORKERS=$WORKERS }${JAXSPARSE_TEST_PART:+JAXSPARSE_TEST_PART=$JAXSPARSE_TEST_PART }$cmd" ;;
    indexer) python3 benchmarks/bench_indexer.py --out "$OUT/indexer_h200.json" 2>&1 | tee "$OUT/bench_indexer.log" ;;
    topk) python3 benchmarks/bench_topk.py --out "$OUT/topk_h200.json" 2>&1 | tee "$OUT/bench_topk.log" ;;
    readme-tables)
      python3 benchmarks/bench_indexer.py --what decode --best-only --key-dtypes 'bfloat16,fp8 q+k' \
        --decode-batches 64,8 --decode-slots 1048576,131072 --out "$OUT/decode_table.json" 2>&1 | tail -12
      for shape in "64 131072 b64" "8 1048576 1m" "1 131072 b1"; do set -- $shape
        python3 benchmarks/bench_topk.py --default-config-only --kernels --no-approx --batches $1 \
          --n $2 --k 2048 --out "$OUT/topk_table_$3.json" 2>&1 | tail -6
      done ;;
    train-indexers)
      python3 -m train.indexer --out "$RUN" ${CORPUS:+--corpus "$CORPUS"} $INDEXER_ARGS \
        --max-seconds "${TRAIN_SECONDS:-0}" 2>&1 | tee -a "$OUT/train_indexers.log" | grep -v "━"
      cp "$RUN/report.json" "$OUT/indexer_report.json"; cp "$RUN/indexers.npz" "$OUT/" ;;
    assets)
      python3 -m jaxsparse.model.make_assets --indexers "$RUN/indexers.npz" --data-dir "$OUT" \
        --report "$OUT/dsa_quality.json" 2>&1 | tee "$OUT/assets.log" ;;
    quality)
      python3 -m jaxsparse.model.make_assets --indexers "${INDEXERS:-jaxsparse/data/smollm2_indexers.npz}" \
        --quality-only --report "$OUT/dsa_quality.json" 2>&1 | tee "$OUT/quality.log" | grep -v window ;;
    inloop)
      txt=${TEXT:-pydoc}; python3 -m jaxsparse.model.text --name "$txt" --out "/tmp/heldout_$txt.txt"
      python3 -m jaxsparse.cli quality --text "/tmp/heldout_$txt.txt" --tokens "${TOKENS:-8192}" \
        --k "${KS:-256,64}" --windows "${WINDOWS:-8}" --task ppl,copy,passkey \
        --methods "${METHODS:-dense,dsa,spin:0.4,spin:0.4:query:0.05,spin:0.4:query:0.2,ivf,ivf-metric,hisa,recent}" \
        --out "$OUT/inloop_$txt.json" --plot "$OUT/inloop_$txt.png" 2>&1 | tee "$OUT/inloop_$txt.log" ;;
    ivf-recall)  # held-out text, and training text (CORPUS) for the per-layer plans
      ids=${CORPUS:-.device/train_tokens.npy}; tr=${TRACES:-/tmp}; mkdir -p "$tr"
      lsuf=${LAYERS:+_l${LAYERS//,/_}}  # LAYERS=2: record and evaluate those layers alone
      for n in ${CONTEXTS:-8192 32768}; do
        if [ "$n" = 8192 ]; then offs=${OFFSETS:-3100000 600000 1600000}; name=8k
          flags="--query-block 64"  # the paper's settings scaled to 8K; corrector: the shipped one
        else offs=${OFFSETS:-2000000 1000000 3000000}; name=$((n / 1024))k
          flags="--topk 512 --budgets 2048,4096,8192 --main-budget 4096 --seal-window 1024 \
--cluster-size 128 --refit-interval 8192 --queries 256 --corrector ''"
        fi
        rec="python3 benchmarks/record_prefill.py --tokens $n ${LAYERS:+--layers $LAYERS}"
        [ -f "$tr/prefill_$name$lsuf.npz" ] || $rec --out "$tr/prefill_$name$lsuf.npz"
        cal=""  # the calibration texts (OFFSETS: first tokens in CORPUS), pooled
        for off in $offs; do
          [ -f "$tr/train_${name}${lsuf}_$off.npz" ] || $rec --ids "$ids" --offset $off \
            --out "$tr/train_${name}${lsuf}_$off.npz"
          cal=$cal${cal:+,}$tr/train_${name}${lsuf}_$off.npz
        done
        [ -n "$RECORD_ONLY" ] && continue
        suffix=$([ "$n" = 8192 ] || echo _$name)$lsuf
        eval python3 benchmarks/bench_ivf_recall.py --trace "$tr/prefill_$name$lsuf.npz" $flags \
          --calibration-trace "$cal" --out "$OUT/ivf_recall$suffix" 2>&1 \
          | tee "$OUT/ivf_recall$suffix.log" | tail -4
      done ;;
    ivf-prefill)
      python3 benchmarks/bench_ivf_prefill.py ${TOKENS:+--tokens $TOKENS --warmup-tokens ${WARMUP:-65536}} \
        ${REPEATS:+--repeats $REPEATS} ${TRACE:+--trace $TRACE --layers ${LAYERS:-0}} \
        ${QUERY_BLOCK:+--query-block $QUERY_BLOCK} ${BUDGET:+--budget $BUDGET} \
        ${STAGES:+--stages $STAGES} ${PROFILE:+--profile} ${METRIC:+--metric-timing} --out "$OUT/ivf_prefill${TOKENS:+_${TOKENS//,/_}}.json" 2>&1 \
        | tee "$OUT/ivf_prefill.log" | tail -8 ;;
    prefill-topk)
      python3 benchmarks/bench_prefill_topk.py --out "$OUT/prefill_topk.json" 2>&1 \
        | tee "$OUT/prefill_topk.log" | tail -8 ;;
    spin)
      python3 benchmarks/bench_spin.py --batches "${BATCHES:-64}" --slots "${SLOTS:-131072,524288}" \
        --sparsities "${SPARSITIES:-0.4}" ${STEP_ONLY:+--step-only} ${EXPLORE:+--explore $EXPLORE} \
        --out "$OUT/${SPIN_NAME:-spin_step}.json" 2>&1 | tee "$OUT/${SPIN_NAME:-spin_step}.log" | tail -12 ;;
    prefill-sharded)
      python3 -m jaxsparse.cli bench prefill --devices 1 --tokens "${TOKENS:-262144,524288}" \
        --k 2048 --heads 64 --head-dim 128 --out "$OUT/prefill_sharded.json" 2>&1 \
        | tee "$OUT/prefill_sharded.log" | tail -8 ;;
    cpu-tables)  # the README figures measured on a CPU: replay, SPIN studies, TPU estimates,
      # AttentionIndex recall at 256K and 1M on held-out layers tiled (TRACES/prefill_8k.npz)
      tr=${TRACES:-/tmp}
      jaxsparse eval --out "$OUT/eval_shipped_trace.json" | tail -3
      python3 benchmarks/spin_studies.py --out "$OUT/spin_studies" 2>&1 | tail -3
      python3 benchmarks/tpu_estimates.py --out "$OUT/tpu_estimates.json" | tail -3
      python3 benchmarks/bench_ivf_prefill.py --trace "$tr/prefill_8k.npz" --layers 3,15,27 \
        --tokens 262144 --query-block 64 --budget 24576 --recall-only \
        --out "$OUT/ivf_prefill_recall_b24576_cpu.json" 2>&1 | tail -4
      python3 benchmarks/bench_ivf_prefill.py --trace "$tr/prefill_8k.npz" --layers 3 \
        --tokens 1048576 --query-block 64 --budget 24576 --recall-only \
        --out "$OUT/ivf_prefill_recall_1m_cpu.json" 2>&1 | tail -4
      # 8K studies: groups and blocks of 16; the compact index against a float32 one
      python3 benchmarks/bench_ivf_recall.py --trace "$tr/prefill_8k.npz" --cluster-size 16 \
        --corrector '' --out "$OUT/ivf_recall_8k_g16" 2>&1 | tail -3
      for idx in compact float32; do
        python3 benchmarks/bench_ivf_recall.py --trace "$tr/prefill_8k.npz" --layers 3,15,25,27 \
          --budgets 512,1024 --main-budget 1024 --queries 128 \
          $([ $idx = float32 ] && echo --float32-index) --out "$OUT/ivf_recall_index_$idx" 2>&1 | tail -3
      done
      # the representative correction, retrained (the shipped file stays: CPU float sums differ
      # in the last bits from host to host); $OUT/corrector/report.json is results/corrector.json
      python3 train/corrector.py --train-trace "$tr/train_8k_3100000.npz,$tr/train_8k_600000.npz" \
        --val-trace "$tr/train_8k_1600000.npz" --eval-trace "$tr/prefill_8k.npz" \
        --out "$OUT/corrector" --steps 300 --lr 1e-3 --scale 0.25 --eval-every 300 \
        --eval-queries 128 --topk 128 --budget 512 --seal-window 256 --cluster-size 32 \
        --refit-interval 2048 2>&1 | tail -3 ;;
    *) echo "unknown target $what"; exit 2 ;;
  esac
done
