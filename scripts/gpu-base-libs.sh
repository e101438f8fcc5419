# The base system's libraries, which the GPU bundle neither carries nor may need from anywhere
# else (sourced by scripts/gpu-bundle.sh and tests/gpu_bundle_test.sh): a regex on a soname.
GPU_BASE_LIBS='^(libc|libstdc\+\+|libm|libgcc_s|libdl|libpthread|librt|libz|ld-linux-x86-64|linux-vdso)\.so'
