#!/usr/bin/env bash
# Build the llama.cpp that `kstep bench llamacpp` runs against, from a pinned source: the llama.cpp
# vendored in llama-cpp-python's source distribution on PyPI (the same code, tagged by its commit in
# the report). Never part of CI or set-up: it takes ~10 minutes on 2 cores.
#
#   scripts/build_llamacpp.sh [DIR]      default DIR: .kstep-cache/llamacpp
#
# Leaves DIR/src (the llama.cpp tree: convert_hf_to_gguf.py and gguf-py), DIR/src/build/bin
# (libllama, llama-bench, llama-completion, llama-simple, llama-diffusion-cli, llama-quantize) and
# DIR/python (llama-cpp-python's ctypes bindings of that libllama).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.kstep-cache/llamacpp}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
if [ ! -f "$DIR/src/CMakeLists.txt" ]; then
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR"
  tar -xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
  rm -rf "$DIR/src"
  mv "$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DIR/src"
  # its ctypes bindings alone (the package's other modules need more dependencies): the bench's
  # llama.cpp side runs libllama through them, on token ids
  mkdir -p "$DIR/python/llama_cpp"
  cp "$DIR/llama_cpp_python-$VERSION/llama_cpp/"{llama_cpp.py,_ctypes_extensions.py,_ggml.py} "$DIR/python/llama_cpp/"
  touch "$DIR/python/llama_cpp/__init__.py"
  rm -rf "$DIR/llama_cpp_python-$VERSION"
fi
# The converter's own dependencies: gguf from the tree, numpy, transformers and sentencepiece (its tokenizer readers).
"$PYTHON" -m pip install --quiet --disable-pip-version-check -e "$DIR/src/gguf-py" numpy transformers sentencepiece
# GGML_NATIVE builds for this CPU's flags (-march=native). Some VMs list AMX in /proc/cpuinfo but
# fault on its instructions (measured: an AVX-512 Xeon whose ggml Q8_0 matmuls then died of an
# illegal instruction): probe AMX, and build without it where it faults.
NO_AMX=""
if grep -q amx_tile /proc/cpuinfo; then
  probe=$(mktemp -d)
  cat > "$probe/amx.c" <<'EOF'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char cfg[64];
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 1;
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;  /* palette 1, tile 0: 16 rows of 64 bytes */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
EOF
  if ! { cc -O2 -mamx-tile "$probe/amx.c" -o "$probe/amx" && "$probe/amx"; } 2>/dev/null; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    echo "this CPU lists AMX but cannot run it: building llama.cpp without AMX"
  fi
  rm -rf "$probe"
fi
cmake -S "$DIR/src" -B "$DIR/src/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" >/dev/null
cmake --build "$DIR/src/build" -j "$(nproc)" \
  --target llama-bench llama-simple llama-diffusion-cli llama-quantize llama-completion
echo "llama.cpp built in $DIR/src/build/bin"
