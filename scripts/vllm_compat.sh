#!/usr/bin/env bash
# vLLM's own prefix-caching suite with and without the lease-carrying block pool.
#
# Fetches the vllm==0.32.0 sdist with pip into vllm-sdist/ (git-ignored, never
# committed), runs tests/v1/core/test_prefix_caching.py twice -- once as is,
# once with vllm.v1.core.kv_cache_coordinator.BlockPool replaced by
# ladsd.engine.lease_pool.LeaseBlockPool (scripts/vllm_compat_plugin.py) --
# and fails unless both pass sets are identical. Prints both counts and times.
#
# The sdist's root conftest needs packages we do not install (tblib, ...), so
# the suite runs with --noconftest. A few tests build a scheduler for
# "facebook/opt-125m" and read only its config: an offline Hugging Face cache
# in vllm-sdist/hf holds that config.json alone (no weights, no tokenizer).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
DIR="$ROOT/vllm-sdist"
VER=0.32.0
SRC="$DIR/vllm-$VER"
SHA=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad
SUITE=tests/v1/core/test_prefix_caching.py

if [ ! -f "$SRC/$SUITE" ]; then
    mkdir -p "$DIR"
    if [ ! -f "$DIR/vllm-$VER.tar.gz" ]; then
        # pip cannot save this sdist by name (preparing its metadata reports
        # 0.32.0+empty), so take the file from pip's own index page for vllm
        # and pin it by sha256.
        "$PY" - "$DIR/vllm-$VER.tar.gz" "$VER" "$SHA" <<'PY'
import hashlib, re, sys, urllib.parse, urllib.request
from pip._internal.models.index import PyPI
out, ver, sha = sys.argv[1:]
index = PyPI.simple_url.rstrip("/") + "/vllm/"
page = urllib.request.urlopen(index, timeout=60).read().decode()
m = re.search(r'href="([^"]*/vllm-' + re.escape(ver) + r'\.tar\.gz)[#"]', page)
if not m:
    sys.exit(f"vllm-{ver}.tar.gz not found on the package index")
data = urllib.request.urlopen(urllib.parse.urljoin(index, m.group(1)), timeout=300).read()
if hashlib.sha256(data).hexdigest() != sha:
    sys.exit(f"vllm-{ver}.tar.gz: sha256 mismatch")
open(out, "wb").write(data)
PY
    fi
    tar -xzf "$DIR/vllm-$VER.tar.gz" -C "$DIR" "vllm-$VER/tests" "vllm-$VER/pyproject.toml"
fi

HF="$DIR/hf/hub/models--facebook--opt-125m"
if [ ! -f "$HF/refs/main" ]; then
    SNAP="$HF/snapshots/0000000000000000000000000000000000000000"
    mkdir -p "$HF/refs" "$SNAP"
    cat >"$SNAP/config.json" <<'JSON'
{"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768,
 "num_attention_heads": 12, "num_hidden_layers": 12, "ffn_dim": 3072, "vocab_size": 50272,
 "max_position_embeddings": 2048, "word_embed_proj_dim": 768, "do_layer_norm_before": true,
 "torch_dtype": "float16", "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1,
 "activation_function": "relu", "enable_bias": true, "layer_norm_elementwise_affine": true}
JSON
    printf 0000000000000000000000000000000000000000 >"$HF/refs/main"
fi

run() {  # $1 = 0 (plain) or 1 (lease pool); outcomes to $DIR/compat-$1.json
    local start end
    start=$(date +%s)
    (cd "$SRC" && LADSD_LEASE_POOL="$1" LADSD_COMPAT_OUT="$DIR/compat-$1.json" \
        HF_HOME="$DIR/hf" HF_HUB_OFFLINE=1 PYTHONPATH="$ROOT/scripts" \
        "$PY" -m pytest "$SUITE" -q --noconftest -p no:cacheprovider \
        -p vllm_compat_plugin -W ignore::DeprecationWarning >"$DIR/compat-$1.log" 2>&1) || true
    end=$(date +%s)
    echo $((end - start))
}

t0=$(run 0)
t1=$(run 1)
"$PY" "$ROOT/scripts/vllm_compat.py" "$DIR/compat-0.json" "$DIR/compat-1.json" "$t0" "$t1"
