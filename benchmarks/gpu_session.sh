#!/usr/bin/env bash
# Everything on a GPU host in one command: environment, the gpu test suite, then benchmarks.
#   [TESTS_WORKERS=N] bash benchmarks/gpu_session.sh [tests[=PATHS]] [bench[=SUITES]] [tune[=SUITES]] [tuner[=HEAD_SIZES]] [apply] [matmul] [engine] [tp[=ARGS]] [serving] [http] [startup] [resources] [parts[=ARGS]] [ncu[=ARGS]] [ncu_pipes[=ARGS]]
# Logs and results land in $OUT (default /tmp/gpu_session). TESTS_K: a pytest -k expression for the tests.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-/tmp/gpu_session}"
mkdir -p "$out"
budget="${BENCH_BUDGET_S:-200}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
python3 -c "import jax, jaxlib, flax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, jax.devices())"
step_args() {  # "name=A,B,C" -> "A B C"; a bare "name" -> ""
  case "$1" in *=*) local args="${1#*=}"; echo "${args//,/ }" ;; esac
}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests bench)
for step in "${steps[@]}"; do
  case "$step" in
    tests|tests=*)
      paths="$(step_args "$step")"
      # -v: each result as it lands, so a run cut off by the time limit still says how far it
      # got; --timeout (pytest-timeout, when installed) stops one hung case, not the run;
      # failures print their tracebacks as they happen.
      per_test=()
      python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "${TEST_TIMEOUT_S:-200}")
      run_pytest() {  # $1: time limit (s), $2: marker expression, then pytest options
        local limit="$1" marks="$2"; shift 2
        JPA_REPORT_FAILURES_AT_ONCE=1 timeout "$limit" python3 -m pytest -m "$marks" -v --tb=short -p no:cacheprovider \
          --durations=5 "${per_test[@]}" ${TESTS_K:+-k "$TESTS_K"} "$@" ${paths:-tests}
      }
      if [ -n "${TESTS_WORKERS:-}" ]; then
        # TESTS_WORKERS=N: N pytest-xdist workers share the GPU (compiles run in parallel),
        # each allocating on demand with its pool capped at its share of 90 % of the GPU (a
        # pool keeps its peak; 8 uncapped peaks exhausted the GPU). The gpu_memory cases
        # (GBs each) then run one at a time in one process with the whole GPU.
        limit="${TESTS_TIMEOUT_S:-480}"
        ( export XLA_PYTHON_CLIENT_PREALLOCATE=false
          XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.9 / ${TESTS_WORKERS}, 3))") \
            run_pytest "$(( limit * 3 / 4 ))" "gpu and not gpu_memory" -n "$TESTS_WORKERS"
          run_pytest "$(( limit / 4 ))" "gpu and gpu_memory" ) 2>&1 | tee "$out/gpu_tests.log"
      else
        run_pytest "${TESTS_TIMEOUT_S:-480}" gpu 2>&1 | tee "$out/gpu_tests.log"
      fi ;;
    bench|bench=*)
      suites="${step#bench}"; suites="${suites#=}"
      timeout 420 python3 benchmarks/bench_attention.py --out "$out" --stem results --budget-s "$budget" ${suites:+--suite "$suites"} 2>&1 | tee "$out/bench.log" ;;
    tune|tune=*)
      suites="${step#tune}"; suites="${suites#=}"
      timeout 420 python3 benchmarks/bench_attention.py --tune --out "$out" --stem tuning --budget-s "${TUNE_BUDGET_S:-$budget}" ${suites:+--suite "$suites"} 2>&1 | tee "$out/tune.log" ;;
    tuner|tuner=*)  # the package's tuner as a user runs it, the shipped table ignored, into a fresh
      # folder, then --compare (its table against the shipped one in alternating rounds), per
      # head size (tuner=128,64; default both) at Hq 32 Hk 8: whether the tuner reproduces the
      # shipped figures within 5 %
      sizes="$(step_args "$step")"
      for head_size in ${sizes:-128 64}; do
        folder="$(mktemp -d /tmp/tuner.XXXX)"
        for mode in --ignore-shipped --compare; do
          timeout "${TUNER_TIMEOUT_S:-240}" python3 -m jax_paged_attn.tune --head-sizes "$head_size" --num-q-heads 32 \
            --num-kv-heads 8 --tuning-dir "$folder" "$mode" 2>&1 | grep -v "^W\|^I0\|Deprecat\|warnings.warn" \
            | tee -a "$out/tuner.log"
        done
        cp "$folder"/*.json "$out/" 2>/dev/null
      done ;;
    apply)  # the last sweep's winners become the package's measured table (copy kept in $out)
      python3 benchmarks/apply_tuning.py "$out/tuning.json" && cp jax_paged_attn/tuned_tables.json "$out/" ;;
    matmul)  # the weight-streaming matmul's sweep beside XLA's dot on the decode step's products
      timeout 330 python3 benchmarks/bench_matmul.py --out "$out" --budget-s "${MATMUL_BUDGET_S:-240}" 2>&1 | tee "$out/matmul.log" ;;
    engine)  # generate by wall clock, decode tok/s beside the one-jit and per-step dense loops
      timeout 540 python3 benchmarks/bench_engine.py 2>&1 | tee "$out/engine.log" ;;
    tp|tp=*)  # tensor parallelism: 8B at tp 1 and 2, 70B at tp 2 (needs 2 GPUs; tp=ARGS: bench_tp.py's options)
      # shellcheck disable=SC2046
      timeout 590 python3 benchmarks/bench_tp.py --json "$out/tp.json" $(step_args "$step") 2>&1 | tee "$out/tp.log" ;;
    serving)  # 1,000 mixed-length requests at once and at Poisson rates (SERVING_RATES, default the
      # script's): total tok/s, TTFT / TPOT percentiles, sum of parts, compiles after start
      timeout 570 python3 benchmarks/bench_serving.py ${SERVING_RATES:+--rates "$SERVING_RATES"} 2>&1 \
        | tee "$out/serving.log" ;;
    http)  # the serving workload offline, then over HTTP (bench_http.py) against `jax-paged-attn
      # serve` with the same engine options, once per server in HTTP_ENGINE_CORES (default
      # "process thread"; "core:N" adds --latency-scheduler-steps N, "core:N:M" also
      # --latency-max-rows M): rates inf and half the
      # saturating one (HTTP_RATES); each server's start (the offline run fills the caches
      # first) to its first served request, and a last start of the last server with the
      # program store filled; compilations after the port opened (/metrics)
      ckpt=/tmp/bench_http_checkpoint port=8123 rates="${HTTP_RATES:-inf,0.5x}"
      python3 benchmarks/bench_http.py --write-checkpoint "$ckpt" 2>&1 | tail -1 | tee "$out/http.log"
      timeout 420 python3 benchmarks/bench_serving.py --rates "$rates" --no-parts 2>&1 | tee -a "$out/http.log"
      cores=(${HTTP_ENGINE_CORES:-process thread})
      for core in "${cores[@]}" "${cores[-1]}-restart"; do
        server="${core%-restart}" latency=()
        if [ "${server#*:}" != "$server" ]; then
          steps="${server#*:}"; latency=(--latency-scheduler-steps "${steps%%:*}")
          [ "${steps#*:}" != "$steps" ] && latency+=(--latency-max-rows "${steps#*:}")
        fi
        t0=$(date +%s.%N)
        python3 -m jax_paged_attn.serve "$ckpt" --port "$port" --max-num-seqs 256 --max-num-batched-tokens 8192 \
          --num-scheduler-steps 16 "${latency[@]}" --max-model-len 4096 --block-size 16 --seed 0 \
          --no-enable-prefix-caching --engine-core "${server%%:*}" --log-level warning > "$out/server_$core.log" 2>&1 &
        pid=$!
        echo "engine core ${core}:" | tee -a "$out/http.log"
        python3 benchmarks/bench_http.py --url "http://127.0.0.1:$port" --wait-ready 400 --started-at "$t0" \
          2>&1 | tee -a "$out/http.log"
        if [ "$core" = "${core%-restart}" ]; then
          timeout 300 python3 benchmarks/bench_http.py --url "http://127.0.0.1:$port" --rates "$rates" \
            --json "$out/http_$core.json" 2>&1 | tee -a "$out/http.log"
        fi
        kill -TERM "$pid"; wait "$pid"; echo "server ($core) exited with $?" | tee -a "$out/http.log"
        tail -5 "$out/server_$core.log"
      done ;;
    startup)  # engine start, cold and warm persistent compilation cache (two processes)
      timeout 420 python3 benchmarks/bench_serving.py --startup 2>&1 | tee "$out/startup.log" ;;
    resources)  # registers / spills of the kernels as XLA compiles them (ptxas -v), and of the Mosaic
      # GPU prefill (its own ptxas report and SASS spill count), with and without overlap_softmax
      { for variant in "--kernel prefill" "--kernel prefill --config masked_block_k=16" "--kernel decode" \
          "--kernel prefill --implementation mosaic_gpu --sass --out $out/mosaic_default" \
          "--kernel prefill --implementation mosaic_gpu --sass --out $out/mosaic_overlap --config overlap_softmax=True"; do
          # shellcheck disable=SC2086
          timeout 120 python3 benchmarks/kernel_resources.py $variant 2>&1 | grep -v "fusion\|^$"
        done; } | tee "$out/resources.log" ;;
    parts|parts=*)  # the Mosaic GPU prefill call's plan / kernel / whole beside the stock kernel, and
      # its in-kernel timeline (the package's configs, or parts=ARG,ARG,...: prefill_parts.py's
      # arguments, e.g. parts=--head-sizes,64,--config,block_k=128; the traces, tens of MB,
      # stay outside $out, a fresh folder per step)
      args="$(step_args "$step")"
      # shellcheck disable=SC2086
      timeout 300 python3 benchmarks/prefill_parts.py --timeline "$(mktemp -d /tmp/prefill_timeline.XXXX)" $args 2>&1 \
        | grep -v "^W\|^I0\|Deprecat\|warnings.warn\|Failed to dump profile" | tee -a "$out/parts.log" ;;
    ncu|ncu=*)  # the Mosaic GPU prefill kernel's device time per launch, from Nsight Compute (ncu),
      # under prefill_parts.py (ncu=ARG,ARG,...: its arguments, as for parts); each launch's
      # duration, grid and shared-memory occupancy limit, beside the script's own timings
      args="$(step_args "$step")"
      # shellcheck disable=SC2086
      timeout 240 ncu --kernel-name regex:varlen_attention --launch-count "${NCU_LAUNCHES:-8}" --csv \
        --metrics gpu__time_duration.sum,launch__grid_size,launch__occupancy_limit_shared_mem,sm__cycles_elapsed.avg.per_second \
        python3 benchmarks/prefill_parts.py --no-stock --reps 2 $args 2>&1 \
        | grep -v "^W\|^I0\|Deprecat\|warnings.warn" | tee -a "$out/ncu.log" ;;
    ncu_pipes|ncu_pipes=*)  # how busy the Mosaic GPU prefill kernel keeps each SM pipe: the tensor
      # cores (wgmma), the XU (exp2 and conversions), FMA and ALU, % of peak while an SM is active,
      # per launch (ncu_pipes=ARG,ARG,...: prefill_parts.py's arguments, as for parts): the
      # softmax's work against the matmuls'. Metric names differ between ncu versions; those
      # this ncu lists for the GPU are asked for, and the list is printed.
      args="$(step_args "$step")"
      known="$(ncu --query-metrics --chip "${NCU_CHIP:-gh100}" 2>/dev/null | awk '{print $1}')"  # (H100 / H200)
      metrics="gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second"
      for name in sm__pipe_tensor_cycles_active sm__pipe_tensor_op_gmma_cycles_active sm__inst_executed_pipe_tensor_op_gmma \
          sm__inst_executed_pipe_xu sm__pipe_xu_cycles_active sm__inst_executed_pipe_fma sm__pipe_fma_cycles_active \
          sm__inst_executed_pipe_alu sm__pipe_alu_cycles_active; do
        grep -qx "$name" <<<"$known" && metrics+=",$name.avg.pct_of_peak_sustained_active"
      done
      [ -n "$known" ] || echo "ncu --query-metrics listed nothing for ${NCU_CHIP:-gh100}: durations only" | tee -a "$out/ncu_pipes.log"
      echo "ncu metrics: $metrics" | tee -a "$out/ncu_pipes.log"
      # shellcheck disable=SC2086
      timeout 240 ncu --kernel-name regex:varlen_attention --launch-count "${NCU_LAUNCHES:-4}" --csv --metrics "$metrics" \
        python3 benchmarks/prefill_parts.py --no-stock --reps 2 $args 2>&1 \
        | grep -v "^W\|^I0\|Deprecat\|warnings.warn" | tee -a "$out/ncu_pipes.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
