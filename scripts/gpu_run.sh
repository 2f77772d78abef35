#!/usr/bin/env bash
# A GPU host's wheel bundle and the GPU tests and benchmarks run on it, in one script: for a host whose
# image has torch with CUDA but not the rest of charstream's dependencies, and no package index.
#
#   here:       scripts/gpu_run.sh bundle [DIR]     the wheels the GPU host's image lacks, pinned, in parts that can
#                                                   be copied over one at a time: DIR/whl-a (~36 MB: av, pyzmq,
#                                                   structlog), DIR/whl-b (~30 MB: aiortc + its stack, silero-vad,
#                                                   espeak-ng, OpenTelemetry), DIR/whl-c (~29 MB: pocketsphinx),
#                                                   DIR/whl-d (2 MB: cuDNN's Python frontend, the FP8 window attention).
#                                                   DIR defaults to .gpu-bundle (ignore it in .git/info/exclude).
#   GPU host:   scripts/gpu_run.sh install DIR      the carried wheels and the package only
#               scripts/gpu_run.sh check DIR        GPU tests (the step graphed = eager, under TP at world size 1
#                                                   too), bench gpu of the serving step: characters-57b TP=3 and
#                                                   TP=4 shards, characters-14b whole with its decoder and the
#                                                   pipelined period (decoder graph on a second stream)
#               scripts/gpu_run.sh ab DIR           the TP=3 shard's step without and with its NCCL group (A/B)
#               scripts/gpu_run.sh kernels DIR [BASE]  the step's kernels: their GPU tests, scripts/kernels_check.py
#                                                   (KERNELS: its sections), bench gpu of the 57b shards (TP_SHARDS,
#                                                   default 3 4) with one replay profiled; BASE: a second tree
#                                                   (main's checkout) whose TP=3 steps are timed after, A/B;
#                                                   CUBLASLT_AB=1: the TP=3 steps again with and without
#                                                   cuBLASLt's workspace (without: profiled)
#               scripts/gpu_run.sh kernels-check DIR   only scripts/kernels_check.py (KERNELS: its sections)
#               scripts/gpu_run.sh tp DIR [N...]    multi-GPU kinds: `bench gpu --tp N` (NCCL, one process per
#                                                   GPU, the serving step graphed with its all-reduces), N = 3 4
#               scripts/gpu_run.sh batch DIR        cross-session batching: its GPU tests (batched = alone, graphed =
#                                                   eager, step and decoder) beside the single step's, then `bench
#                                                   batch` (tiny, K = 1 8 16 32 64 sessions per forward against K
#                                                   separate steps, and the same for the decoder)
#               [GPUS=3+1] [PACES="realtime synthesized"] scripts/gpu_run.sh live DIR [PRESET...]
#                                                   one `charstream demo --gpus $GPUS` (default 1) session per
#                                                   preset (default: characters-14b tiny) and agent pace (default:
#                                                   realtime; docs/ARCHITECTURE.md, Turn-start rollback), >= 2 min each;
#                                                   flashhead-pro / flashhead-lite: seeded random weights animating
#                                                   examples/portrait.png, without the recogniser (needs whl-a, whl-b)
#               scripts/gpu_run.sh flashhead DIR [PART...]   FlashHead on seeded random weights, by part (default: all):
#                                                   tests (its GPU tests), pro (`bench chunk` of Pro: one session by
#                                                   part, then 1-3 sessions side by side, each count on threads and
#                                                   batched; CHUNK_SESSIONS_PRO), lite (the same for Lite at 1, 4, 8,
#                                                   16 sessions; CHUNK_SESSIONS_LITE); CHUNK_SECONDS a count (12),
#                                                   CHUNK_MODES the bench's --modes (threads,batched),
#                                                   CHUNK_LIMIT the bench's limit (330 s); FH_TESTS_K: pytest -k;
#                                                   needs whl-a; capacity (not by default: `bench capacity` of Lite,
#                                                   live sessions to aiortc clients, FH_CAPACITY_SESSIONS 8 16,
#                                                   one ladder at FH_CAPACITY_BATCH 4 over FH_CAPACITY_WORKERS 4 server
#                                                   processes (one process of 8 sends its video at ~20 fps),
#                                                   FH_CAPACITY_ENGINES=1: every session's model stages in one
#                                                   engine process (one batch), the workers only front-ends,
#                                                   FH_CAPACITY_MODEL flashhead-pro for Pro; needs whl-a and whl-b);
#                                                   ltx-layout (not by default: scripts/flashhead_ltx_layout_gpu.py)
#               scripts/gpu_run.sh capacity DIR [BATCH...]   `charstream bench capacity --gpus 1` (~5 min): concurrent
#                                                   tiny sessions (CAPACITY_SESSIONS, default 32 48; 8 16 32 48
#                                                   with one ladder), one ladder per batch_sessions value (default
#                                                   1 8: without and with batching); needs whl-a and whl-b, not whl-c;
#                                                   CAPACITY_ENGINES=K: K model engines host every session's model
#                                                   stages (hosting engine; a batch value must cover 48 / K sessions)
#                                                   CAPACITY_PACE=synthesized: the scripted agent streams ahead of real time
#                                                   CAPACITY_SPREAD=S: a count's sessions start over S s (their turns out of phase)
#                                                   CAPACITY_CLIENT_NICE=N: the client processes' niceness (the bench's default: 10)
#                                                   CAPACITY_CHECKS=0: without the GPU tests and the encode bench first
#                                                   CAPACITY_LOG=info: the server workers' turn and underrun lines in capacity.log
#                                                   CAPACITY_FRESH_TRITON=1: Triton's on-disk cache empty at the bench's start (a new
#                                                   TRITON_CACHE_DIR): as on a host's first run, its first count compiles
#                                                   every kernel in every process (a later ladder finds them cached)
#                                                   (first: the capture and graphed-encoder GPU tests, bench gpu of tiny's encode)
#
# Every command on the GPU host installs the parts it finds under DIR into /tmp/site once (check needs
# whl-a; capacity a and b; live a, b, c; kernels d), so the parts may arrive one at a time.
# Each section runs under `timeout` with a line at its start and end; logs and JSON go to $OUT.
set -o pipefail
cmd=${1:?usage: gpu_run.sh bundle [DIR] | install DIR | check DIR | batch DIR | ab DIR | kernels DIR [BASE] | tp DIR [N...] | live DIR [PRESET...] | capacity DIR [BATCH...]}
dir=${2:-.gpu-bundle}
shift $(($# < 2 ? $# : 2))

WHEELS_A="av==18.1.0 pyzmq==27.3.0 structlog==26.1.0"
WHEELS_B="aiortc==1.16.0 aioice==0.13.0 pyee==13.0.1 pylibsrtp==1.0.0
  pyOpenSSL==26.4.0 cryptography==50.0.2 google-crc32c==1.9.0 dnspython==2.9.2 ifaddr==0.2.0 cffi==2.1.1 pycparser==3.12
  silero-vad==6.2.3 espeakng-loader==0.2.4 protobuf==6.33.6 googleapis-common-protos==1.76.0
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2"
# The built-in agent's recogniser (29 MB): 5.0.4 is the newest release with a cp312 wheel (the GPU host's Python).
WHEELS_C="pocketsphinx==5.0.4"
# cuDNN's Python frontend (2 MB, no dependencies; 1.18+ need nvidia-cutlass-dsl): the FP8 window attention.
WHEELS_D="nvidia-cudnn-frontend==1.17.0"

if [ "$cmd" = bundle ]; then
  # In this order: pip takes the first tag a wheel has (the 2_28 builds are the ones run on the GPU host).
  platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
             --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64)
  for part in a b c d; do
    names=WHEELS_${part^^}
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d "$dir/whl-$part" ${!names} || exit
  done
  du -sh "$dir"/whl-*
  exit 0
fi

# -- on the GPU host ----------------------------------------------------------------------------------
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# A copied tree need not carry its git state: the command names the commit, CHARSTREAM_COMMIT=<sha> bash ...
export CHARSTREAM_COMMIT=${CHARSTREAM_COMMIT:-unknown}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
START=$SECONDS
results=()

section() {  # section NAME LIMIT_S LOG COMMAND...: COMMAND under a time limit, to the console and $OUT/LOG
  local name=$1 limit=$2 log=$OUT/$3 rc
  shift 3
  echo "=== $name: start $(date -u +%T), limit ${limit}s, elapsed $((SECONDS - START))s" | tee -a "$log"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=$?
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "=== $name: TIMED OUT after ${limit}s" | tee -a "$log"
  echo "=== $name: rc=$rc, elapsed $((SECONDS - START))s" | tee -a "$log"
  results+=("$name rc=$rc")
}

for part in a b c d; do
  if compgen -G "$dir/whl-$part/*.whl" >/dev/null && [ ! -e "/tmp/site/.whl-$part" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$dir/whl-$part"/*.whl && touch "/tmp/site/.whl-$part" || exit
  fi
done
# The package itself (its folders map to charstream.* only through an install), each run afresh.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site-pkg . \
  >/dev/null || exit
# Safe path (inherited by spawned ranks): the checkout's charstream/ holds only the root package and must
# not shadow the installed one from the working directory.
export PYTHONPATH=/tmp/site-pkg:/tmp/site PYTHONSAFEPATH=1
nvidia-smi --query-gpu=name,driver_version,memory.used,temperature.gpu,power.draw --format=csv,noheader

if [ "$cmd" = install ]; then  # only the above
  exit 0
elif [ "$cmd" = check ]; then
  section "gpu tests" 150 gpu-tests.log python3 -m pytest -q -m gpu -p no:cacheprovider --timeout=120 \
    tests/test_graphed_gpu.py tests/test_diffusion_stage.py tests/test_capture_gpu.py
  section "bench characters-57b TP=3, TP=4 shards" 200 bench-57b.log python3 -m charstream.pipeline.bench.gpu \
    --tp-shard 3 4 --skip sweep decoder pipeline encoder --section-timeout 90 --json "$OUT/bench_57b.json"
  section "bench characters-14b, decoder, period" 200 bench-14b.log python3 -m charstream.pipeline.bench.gpu \
    --preset characters-14b --tp-shard 1 --skip sweep ceilings --section-timeout 90 --json "$OUT/bench_14b.json"
elif [ "$cmd" = batch ]; then  # needs no wheels: the model layer and the bench only
  section "gpu tests" 100 gpu-tests.log python3 -m pytest -q -s -m gpu -p no:cacheprovider --timeout=70 \
    tests/test_batched_step.py tests/test_batched_decoder.py tests/test_graphed_gpu.py
  section "bench batch" 70 bench-batch.log python3 -m charstream.pipeline.bench.batch --out "$OUT/bench_batch.json"
elif [ "$cmd" = ab ]; then  # the TP=3 shard's serving step without, then with, its one-rank NCCL group
  for group in --no-group ""; do
    # shellcheck disable=SC2086
    section "bench TP=3 step ${group:-with group}" 100 bench-ab.log python3 -m charstream.pipeline.bench.gpu \
      --tp-shard 3 --skip sweep kernels decoder pipeline ceilings $group --section-timeout 80
  done
elif [ "$cmd" = kernels ]; then
  k=tests/test_kernels_gpu.py
  section "gpu tests (kernels, graphed step)" 200 gpu-tests.log python3 -m pytest -q -m gpu -p no:cacheprovider \
    --timeout=90 $k::test_ring_write $k::test_ring_write_prep $k::test_ring_write_prep_without_the_ring_write_does_the_rest \
    $k::test_quantize_rows $k::test_quantize_rows_reads_the_leading_columns_from_the_prefix \
    $k::test_window_gathered_over_listed_frames_then_attended $k::test_delta_rotate $k::test_adaln_quant \
    $k::test_quantize_rows_reads_an_fp8_prefix_with_its_scales_per_head $k::test_ring_write_prep_writes_q_codes_and_an_fp8_window \
    $k::test_fp8_window_attention_matches_its_reference $k::test_attention_merge $k::test_cross_attention_in_place tests/test_graphed_gpu.py tests/test_batched_step.py \
    tests/test_kernel_compiles.py -k "not decoder"
  # KERNELS: the kernels_check sections; TP_SHARDS: the shards bench gpu times (both: this default)
  # shellcheck disable=SC2086
  section "kernels check" 150 kernels.log python3 scripts/kernels_check.py \
    --only ${KERNELS:-ring_write gelu_rows adaln window_attn cross_attn rotation} --json "$OUT/kernels.json"
  # shellcheck disable=SC2086
  section "bench characters-57b shards ${TP_SHARDS:-3 4}" 300 bench.log python3 -m charstream.pipeline.bench.gpu \
    --tp-shard ${TP_SHARDS:-3 4} --skip sweep decoder pipeline ceilings --section-timeout 100 --json "$OUT/bench.json"
  # bench-more.log: the runs after (at most 8 files come back)
  if [ "${CUBLASLT_AB:-0}" = 1 ]; then  # the TP=3 steps (bf16 and FP8 windows) with cuBLASLt's workspace, then
    # without, that one profiled (which GEMM kernels cuBLASLt takes then, and whether its memsets go)
    section "bench TP=3 steps, CUBLASLT_WORKSPACE_SIZE=default" 90 bench-more.log python3 -m charstream.pipeline.bench.gpu \
      --tp-shard 3 --skip sweep kernels profile decoder pipeline ceilings --section-timeout 80
    section "bench TP=3 steps, CUBLASLT_WORKSPACE_SIZE=0, profiled" 150 bench-more.log env CUBLASLT_WORKSPACE_SIZE=0 \
      python3 -m charstream.pipeline.bench.gpu --tp-shard 3 --skip sweep kernels decoder pipeline ceilings \
      --section-timeout 100 --json "$OUT/bench-ws0.json"
  fi
  if [ -n "${1:-}" ]; then  # the base tree's serving steps (both windows), same machine, right after: like with like
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site-base \
      "$1" >/dev/null || exit
    section "base bench TP=3 steps" 100 bench-more.log env PYTHONPATH=/tmp/site-base:/tmp/site \
      CHARSTREAM_COMMIT="${BASE_COMMIT:-base}" python3 -m charstream.pipeline.bench.gpu --tp-shard 3 \
      --skip sweep kernels profile decoder pipeline ceilings --section-timeout 90
  fi
elif [ "$cmd" = kernels-check ]; then  # only scripts/kernels_check.py's sections (KERNELS)
  # shellcheck disable=SC2086
  section "kernels check" 120 kernels.log python3 scripts/kernels_check.py \
    --only ${KERNELS:-ring_write gelu_rows adaln window_attn cross_attn rotation} --json "$OUT/kernels.json"
elif [ "$cmd" = tp ]; then  # multi-GPU kinds: the TP group with NCCL, one process per GPU, per size given
  [ $# -gt 0 ] || set -- 3 4
  for tp in "$@"; do
    section "bench --tp $tp" 300 "bench-tp$tp.log" python3 -m charstream.pipeline.bench.gpu --preset characters-57b \
      --tp "$tp" --json "$OUT/bench_tp$tp.json"
  done
elif [ "$cmd" = live ]; then
  [ $# -gt 0 ] || set -- characters-14b tiny
  gpus=${GPUS:-1}  # a layout of pipeline/runtime/layouts.py: 1, 3+1, 4+1, ...
  for preset in "$@"; do
    # 14 turns of the built-in script: a little over 2 minutes of media (11 gave 101 s)
    model=(--model "$preset" --weights random) turns=14
    [ "$preset" = tiny ] && model=(--model tiny --weights packaged)
    if [[ "$preset" = flashhead-* ]]; then  # the example portrait, no recogniser (whl-c); 10 turns gave 88 s
      # 16 turns: ~142 s of media after a fresh host's compile (~170 s), inside the section's 400 s
      model+=(--portrait examples/portrait.png --no-hear) turns=16
    fi
    for pace in ${PACES:-realtime}; do  # how the scripted agent streams its reply (--agent-pace)
      tag=$preset-$pace
      section "live $preset --gpus $gpus --agent-pace $pace" 400 "live-$tag.log" python3 -m charstream.pipeline.cli demo \
        "${model[@]}" --gpus "$gpus" --agent-pace "$pace" --turns $turns --timeout 370 --verbose \
        --out "/tmp/demo-$tag"
      cp "/tmp/demo-$tag/report.md" "$OUT/report-$tag.md" 2>/dev/null
      cp "/tmp/demo-$tag/trace.jsonl" "$OUT/trace-$tag.jsonl" 2>/dev/null
    done
  done
elif [ "$cmd" = flashhead ]; then
  [ $# -gt 0 ] || set -- tests pro lite
  for part in "$@"; do
    case $part in
      tests) section "flashhead gpu tests" 480 flashhead-tests.log python3 -m pytest -q -s -m gpu -p no:cacheprovider \
               --timeout=280 tests/test_flashhead_gpu.py ${FH_TESTS_K:+-k "$FH_TESTS_K"} ;;
      pro|lite) counts=$([ "$part" = pro ] && echo "${CHUNK_SESSIONS_PRO:-1,2,3}" || echo "${CHUNK_SESSIONS_LITE:-1,4,8,16}")
                section "bench chunk flashhead-$part" "${CHUNK_LIMIT:-330}" "bench-chunk-$part.log" python3 -m charstream.pipeline.cli \
                  bench chunk --model "flashhead-$part" --sessions "$counts" --seconds "${CHUNK_SECONDS:-12}" --chunks 6 \
                  --warmup 2 --modes "${CHUNK_MODES:-threads,batched}" --out "$OUT/bench_chunk_$part.json" ;;
      # live Lite sessions through WebRTC to aiortc clients, one worker process (its sessions share the model
      # and, batch > 1, batch their chunks); its start compiles the model (minutes): needs whl-a and whl-b
      capacity) # shellcheck disable=SC2086
                model=${FH_CAPACITY_MODEL:-flashhead-lite}
                section "capacity $model" 560 "capacity-$model.log" python3 -m charstream.pipeline.cli bench capacity \
                  --preset "$model" --weights random --portrait examples/portrait.png --gpus 1 --workers "${FH_CAPACITY_WORKERS:-4}" \
                  --clients "${CAPACITY_CLIENTS:-4}" --sessions ${FH_CAPACITY_SESSIONS:-8 16} \
                  --batch-sessions "${FH_CAPACITY_BATCH:-4}" ${FH_CAPACITY_ENGINES:+--engines "$FH_CAPACITY_ENGINES"} \
                  --hold 15 --start-timeout 450 --out "$OUT/capacity_$model.json" ;;
      # Lite's LTX decode in the default 3-D layout against channels-last (a lab: not served)
      ltx-layout) section "LTX decode layouts" 300 ltx-layout.log python3 scripts/flashhead_ltx_layout_gpu.py --out "$OUT" ;;
      *) echo "unknown flashhead part $part (tests pro lite capacity ltx-layout)"; exit 2 ;;
    esac
  done
elif [ "$cmd" = capacity ]; then
  [ $# -gt 0 ] || set -- 1 8  # without and with cross-session batching (diffusion and decode)
  # The premise of sessions sharing a process on the GPU (model/graphs.py): captures beside running sessions.
  if [ "${CAPACITY_CHECKS:-1}" != 0 ]; then
    section "capture beside running sessions, the graphed encoder, a stream per stage thread" 120 capacity.log python3 -m pytest -q -m gpu \
      -p no:cacheprovider --timeout=80 tests/test_capture_gpu.py tests/test_conditioning_gpu.py tests/test_stage_worker.py
    section "bench gpu: tiny's audio encode, eager and graphed" 60 capacity.log python3 -m charstream.pipeline.bench.gpu \
      --preset tiny --no-group --skip ceilings step decoder --json "$OUT/bench_encoder.json"
  fi
  # ~5 minutes of ladders: each gets its share (the bench starts no count that would not fit); with two
  # ladders each holds 32 then 48 (the target is 32). 16 server processes (2 sessions each at 32, 3 at 48)
  # and 4 client processes on the 16 cores: a process's sessions share its GIL (at 8 x 4 each process
  # used 1.13 cores and its loop lagged 50 ms), and a client process holds 8-12 sessions at < 0.5 core.
  sessions=${CAPACITY_SESSIONS:-$([ $# -gt 1 ] && echo 32 48 || echo 8 16 32 48)}
  [ "${CAPACITY_FRESH_TRITON:-0}" = 1 ] && export TRITON_CACHE_DIR=$(mktemp -d /tmp/triton-cache.XXXX)
  # shellcheck disable=SC2086
  section "capacity tiny --gpus 1, batch_sessions $*${CAPACITY_ENGINES:+, $CAPACITY_ENGINES engines}" 360 capacity.log python3 -m charstream.pipeline.cli bench capacity \
    --gpus 1 --sessions $sessions --workers "${CAPACITY_WORKERS:-16}" --clients "${CAPACITY_CLIENTS:-4}" \
    --batch-sessions "$@" ${CAPACITY_ENGINES:+--engines "$CAPACITY_ENGINES"} ${CAPACITY_PACE:+--agent-pace "$CAPACITY_PACE"} ${CAPACITY_LOG:+--log-level "$CAPACITY_LOG"} ${CAPACITY_SPREAD:+--spread-s "$CAPACITY_SPREAD"} ${CAPACITY_CLIENT_NICE:+--client-nice "$CAPACITY_CLIENT_NICE"} --hold 30 --budget-s $((300 / $#)) \
    --out "$OUT/capacity.json"
else
  echo "unknown command $cmd" >&2
  exit 2
fi

{
  echo "commit $CHARSTREAM_COMMIT, $(date -u +%FT%TZ), total $((SECONDS - START))s"
  printf '%s\n' "${results[@]}"
} | tee "$OUT/summary.txt"
! grep -q "rc=[1-9]" "$OUT/summary.txt"
