#!/usr/bin/env bash
# Builds llama.cpp's own command-line binaries for THIS CPU (the peer of benchmarks/llamacpp_bench.py and of the
# draft-speculation benchmark), from the llama.cpp source vendored in the llama-cpp-python sdist, and installs
# them under $LLAMACPP_HOME/bin (default /work/llamacpp, outside the repository).
#
# Not for CI: it downloads ~75 MB and compiles for ~20-40 minutes on 2 cores. Run it by hand:
#   bash scripts/build_llamacpp.sh            # or LLAMACPP_VERSION=0.3.36 JOBS=2 bash scripts/build_llamacpp.sh
# Rules it follows: GGML_NATIVE=ON (the kernels this CPU has, as a user building from source gets), Release, no
# network code in the binaries (no curl/openssl), static libraries so the binaries are self-contained, and only the
# targets the benchmarks run. The build runs under `nice -n 15` so it does not disturb speed measurements.
# When the binaries run, their directory is written to $LLAMACPP_HOME/READY.
set -euo pipefail

if [[ -n "${CI:-}" ]]; then
    echo "build_llamacpp.sh: refusing to run in CI (a long native build; run it by hand)" >&2
    exit 1
fi

VERSION="${LLAMACPP_VERSION:-0.3.36}"
HOME_DIR="${LLAMACPP_HOME:-/work/llamacpp}"
JOBS="${JOBS:-2}"
SRC_DIR="$HOME_DIR/src"
BIN_DIR="$HOME_DIR/bin"
TREE="$SRC_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$HOME_DIR/build-$VERSION"

step() { echo "[build_llamacpp] $*" >&2; }

mkdir -p "$SRC_DIR" "$BIN_DIR"
if [[ ! -d "$TREE" ]]; then
    step "1/4 downloading the llama-cpp-python $VERSION sdist (its vendor/llama.cpp is the source) into $SRC_DIR"
    python3 -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$SRC_DIR"
    step "    unpacking"
    tar xzf "$SRC_DIR/llama_cpp_python-$VERSION.tar.gz" -C "$SRC_DIR"
else
    step "1/4 source already unpacked at $TREE"
fi

step "2/4 configuring (Release, GGML_NATIVE=ON, static, no network) in $BUILD"
cmake -S "$TREE" -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DGGML_OPENMP=ON >&2

# The speculative examples exist in some versions only: build those present.
TARGETS=(llama-bench llama-server llama-cli llama-quantize)
for extra in llama-speculative llama-speculative-simple; do
    if ninja -C "$BUILD" -t targets all 2>/dev/null | grep -q "^$extra:"; then
        TARGETS+=("$extra")
    fi
done
# llama-bench and llama-quantize first (the side-by-side benchmark needs only them), then the rest
step "3/4 compiling llama-bench llama-quantize, then the rest of ${TARGETS[*]}, with -j$JOBS under nice -n 15 (ninja prints [done/total])"
nice -n 15 cmake --build "$BUILD" --target llama-bench llama-quantize -j "$JOBS"
nice -n 15 cmake --build "$BUILD" --target "${TARGETS[@]}" -j "$JOBS"

step "4/4 installing into $BIN_DIR and checking that they run"
for t in "${TARGETS[@]}"; do
    cp -f "$BUILD/bin/$t" "$BIN_DIR/$t"
done
"$BIN_DIR/llama-bench" --help >/dev/null
"$BIN_DIR/llama-quantize" --help >/dev/null 2>&1 || true   # prints usage and exits 1
echo "$BIN_DIR" > "$HOME_DIR/READY"
step "done: $(ls "$BIN_DIR" | tr '\n' ' ')-> $BIN_DIR (written to $HOME_DIR/READY)"
